"""Announcing this peer's records in the DHT and fetching everyone's: the IO around `records`.

An `Announcer` publishes the record(s) its `record_fn` builds now and every TTL/3;
`fetch_records` reads a model's key and keeps the live, correctly signed records.
Both take plain data (a record function, a model id), not node objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import trio

from .host import P2PNode
from .records import (
    DEFAULT_TTL_S,
    PeerRecord,
    RecordError,
    newest_live,
    record_key,
    sign_record,
    verify_record,
)

log = logging.getLogger(__name__)


class Announcer:
    """Publishes this peer's record(s) now and every `refresh_s` (default TTL/3), each valid for `ttl_s`.

    `record_fn()` is called at every refresh so fields like free cache tokens stay current;
    it returns one PeerRecord or several. peer_id, addrs and reachability are the node's now (a private
    peer's relayed addresses change as relays come and go), issued/expires are set here. `await stop()` (while the node still runs)
    publishes withdrawn copies (expires = issued) unless `withdraw_on_stop` is False;
    otherwise the TTL removes the records.
    """

    def __init__(
        self,
        node: P2PNode,
        record_fn: Callable[[], PeerRecord | Iterable[PeerRecord]],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        refresh_s: float | None = None,
        withdraw_on_stop: bool = True,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.node = node
        self.record_fn = record_fn
        self.ttl_s = float(ttl_s)
        self.refresh_s = float(refresh_s) if refresh_s is not None else self.ttl_s / 3
        if not 0 < self.refresh_s < self.ttl_s:
            raise ValueError(f"refresh_s must be in (0, ttl_s), got {self.refresh_s}")
        self.withdraw_on_stop = withdraw_on_stop
        self.published = 0  # successful publications (any storing node took the record)
        self.last_stored_at = 0  # storing nodes reached at the last publication
        self._last: list[PeerRecord] = []
        self._scope: trio.CancelScope | None = None  # the wait between publications
        self._publishing = trio.Lock()  # a publication and the withdrawal never overlap
        self._stopping = False

    def _current(self, now: float, ttl: float) -> list[PeerRecord]:
        got = self.record_fn()
        recs = [got] if isinstance(got, PeerRecord) else list(got)
        return [
            replace(r, peer_id=self.node.peer_id, addrs=tuple(self.node.addrs) or r.addrs, issued=now, expires=now + ttl,
                    reachability=self.node.reachability)
            for r in recs
        ]

    async def publish_once(self) -> int:
        """Publish the current record(s) once; returns how many storing nodes accepted them (self included)."""
        now = time.time()
        recs = self._current(now, self.ttl_s)
        self._last = recs
        stored = await self._put(recs)
        self.last_stored_at = stored
        if stored:
            self.published += 1
        return stored

    async def publish_now(self) -> int:
        """Publish the current record(s) at once (after what they say changed: a peer that moved its span), never
        alongside another publication; the refreshes go on as before."""
        async with self._publishing:
            return await self.publish_once()

    async def _put(self, recs: list[PeerRecord]) -> int:
        by_model: dict[str, list[bytes]] = {}
        for r in recs:
            by_model.setdefault(r.model, []).append(sign_record(r, self.node.key_pair))
        total = 0
        for model, blobs in by_model.items():
            total += await self.node.put_records(record_key(model), blobs)
        return total

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish now, signal started, then refresh until cancelled or `stop()`ped."""
        await self._publish_logged()
        task_status.started()
        while not self._stopping:
            with trio.CancelScope() as self._scope:  # stop() cancels the wait, never a publication
                await trio.sleep(self.refresh_s)
            if not self._stopping:
                await self._publish_logged()

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Stop refreshing and, if withdraw_on_stop, publish withdrawn copies (expires = issued = now).

        A publication in flight is let finish (within the timeout): cancelling one mid-stream
        resets libp2p connections the withdrawal then needs. Call it while the node still runs:
        cancelling the node's nursery cancels libp2p's own tasks too, so a withdrawal attempted
        during that cancellation cannot get out.
        """
        self._stopping = True
        if self._scope is not None:
            self._scope.cancel()
        with trio.move_on_after(timeout_s):
            async with self._publishing:
                if not (self.withdraw_on_stop and self._last):
                    return
                now = time.time()
                gone = [replace(r, issued=now, expires=now) for r in self._last]
                self._last = []
                try:
                    await self._put(gone)
                except Exception as exc:  # best effort: the TTL removes the records anyway
                    log.debug("withdrawing records failed: %r", exc)

    async def _publish_logged(self) -> None:
        try:
            with trio.move_on_after(self.refresh_s) as scope:
                async with self._publishing:
                    stored = await self.publish_once()
                if not stored:
                    log.warning("record published to no storing node")
            if scope.cancelled_caught:
                log.warning("publishing the record took over %.1f s: cut short (the next refresh tries again)",
                            self.refresh_s)
        except Exception as exc:
            log.warning("publishing discovery record failed: %r", exc)


def software_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"dsd/{version('dsd')}"
    except PackageNotFoundError:
        return "dsd/unknown"


async def fetch_records(node: P2PNode, model: str, num_layers: int) -> list[PeerRecord]:
    """Every live record for `model` found in the DHT; expired, invalid or out-of-range ones dropped.

    num_layers <= 0 means unknown: no range check.
    """
    blobs = await node.get_records(record_key(model))
    recs: list[PeerRecord] = []
    for blob in blobs:
        try:
            rec = verify_record(blob)
        except RecordError as exc:
            log.debug("dropping record: %s", exc)
            continue
        if rec.model != model or (num_layers > 0 and rec.end > num_layers):
            continue
        if not node.accepts_record_of(rec.peer_id):
            log.debug("dropping record of %s: not in this private swarm's allow list", rec.peer_id)
            continue
        recs.append(rec)
    return newest_live(recs)
