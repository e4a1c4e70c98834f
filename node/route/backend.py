"""The head engine's target backend over a route of block peers (with failover replay)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
import trio

from dsd.discovery.planner import remote_blocks
from dsd.node.head.backend import Capabilities, TargetBackend
from dsd.protocol import decode_tensor
from dsd.shard_store import HeadModule, SpanModule

from .audit import AuditLedger, Auditor
from .audit_rules import HeldTokens
from .client import Reopened, RouteClient
from .ends import rows_into_route
from .record import RouteRecord, ring_hops
from .session import RouteSession

log = logging.getLogger(__name__)


class RouteBackend(TargetBackend):
    """DSD over a route of block peers: embed on the head, layers on the peers, logits on the head.

    Only hidden states cross the wire, and the head computes the target logits
    itself, so verification sees exactly the target's distribution. The backend
    remembers every token it has placed in the peers' caches; when its `RouteClient`
    replaces a failed route, it replays them into the new peers (in chunks) and
    re-sends the window, so the engine never notices beyond the delay.

    Whatever is sent in chunks (a long prompt, a replay, a window longer than a
    chunk), the result rows of the chunk before the last are kept: a window that
    straddles a chunk boundary still gets all its rows.

    Token trees: a window with `parents` goes out whole (at most 64 nodes), and the
    next one commits its accepted path with `keep`. A replay sends the committed
    tokens as a chain, then the tree window in flight again on the new route.

    A co-located head (`local`, a span it serves itself: the model's first layers or its last
    ones) runs every window through that span with its own KV cache, exactly as a block peer
    does (`SpanModule.step`: commit or keep the last window, then run the window or tree):
    the first layers before the window goes out, the last ones on each result before the
    logits. The route covers only the other layers. A replay after a failover starts again
    at position 0 with commit 0, so the local span's cache is rebuilt with the new route's.

    Pipelining (dsd): a chain window may be sent *ahead*, before the results of the windows in
    flight are collected (same epoch, starting where they end, keeping all of them). Results
    come back in sending order. A window of a newer epoch drops the ones sent ahead (their results
    are skipped as stale). A failover replays only the oldest window in flight and drops those sent
    ahead; `replays` counts failovers so the engine knows they are gone.

    Audits (`auditor`): every result is offered to the auditor with the window's context (the tokens the peers held
    before it, followed by `HeldTokens`) and the rows as the route returned them (before the head's own last
    layers); `collect` raises `LieCaught` once an audit found the route lying, and `settle` waits for the audits.
    """

    capabilities = Capabilities(trees=True, pipeline=True)

    def __init__(
        self, head: HeadModule, client: RouteClient, *, timeout_s: float = 300.0, replay_chunk: int = 128,
        local: SpanModule | None = None, auditor: Auditor | None = None, audits: AuditLedger | None = None,
    ) -> None:
        self.head = head
        self.client = client
        self.timeout_s = timeout_s
        self.replay_chunk = replay_chunk
        self.local = local
        self._local_cache = local.new_cache() if local is not None else None
        self._local_first = local is not None and local.start == 0
        # With the last layers local: the windows sent on this route whose results have not come back
        # yet, as (start, commit, parents, keep), oldest first; results arrive in that order.
        self._tail_windows: deque[tuple[int, int | None, Sequence[int] | None, Sequence[int] | None]] = deque()
        if local is not None:
            num_layers = int(local.config.num_hidden_layers)
            routed = remote_blocks((local.start, local.end), num_layers)
            if client.swarm.blocks != routed:
                raise ValueError(f"the head serves blocks {local.start}:{local.end}: the route must serve "
                                 f"{routed[0]}:{routed[1]}, not {client.swarm.blocks}")
        self._limiter = trio.CapacityLimiter(1)
        self.head_compute_s = 0.0
        self._prefix: list[int] = []  # committed tokens the peers hold before the window in flight
        self._window: list[int] = []  # the window in flight (its nodes in order, for a tree)
        self._parents: list[int] | None = None  # the window's parents when it is a tree
        self._before_last: np.ndarray | None = None  # result rows of the chunk before the last one sent
        self._ahead: list[list[int]] = []  # chain windows sent after `_window`, before its result came
        self._uncollected = 0  # windows of `_epoch` sent whose results have not been collected
        self._epoch = 0
        self._route_lock = trio.Lock()  # a window sent ahead waits while a failover replays
        self.replays = 0
        self.auditor = auditor
        self.audits = auditor.ledger if auditor is not None else audits  # what `transport` reports of the audits
        self._held = HeldTokens()  # the tokens the peers hold, as the windows sent say
        # Windows sent whose results have not come back: (epoch, start, context, tokens, parents), oldest first.
        self._sent: deque[tuple[int, int, list[int], list[int], list[int] | None]] = deque()

    @property
    def session(self) -> RouteSession:
        assert self.client.session is not None
        return self.client.session

    def transport(self) -> RouteRecord:
        """The route's record so far: its peers, the bytes on the wire, the head's compute and the failovers."""
        client, local = self.client, self.local
        hops = client.hops
        mine = None if local is None else (local.start, local.end)
        links = client.session.links if client.session is not None else []
        return RouteRecord(
            route=[h.peer_id for h in hops], spans=[(h.start, h.end) for h in hops],
            hops=ring_hops(hops, client.node.peer_id, mine, links[: len(hops)]), bytes_sent=client.bytes_sent,
            return_link=links[len(hops)] if len(links) > len(hops) else None,
            link_moves=list(client.session.moves) if client.session is not None else [],
            bytes_received=client.bytes_received, head_compute_s=self.head_compute_s, failovers=list(client.events),
            audits=self.audits,
        )

    def _rows_out(
        self, tokens: Sequence[int], start: int, commit: int | None,
        parents: Sequence[int] | None, keep: Sequence[int] | None,
    ) -> np.ndarray:
        """The window's hidden states as they leave the head: embedded, and through its own first layers if it serves them."""
        first = self.local if self._local_first else None
        return rows_into_route(self.head, first, self._local_cache, tokens, start, commit, parents, keep)

    def _run_tail(
        self, hidden: np.ndarray, start: int, commit: int | None,
        parents: Sequence[int] | None, keep: Sequence[int] | None,
    ) -> np.ndarray:
        """A result's rows through the head's own last layers (the window's commit/keep first, as a peer does)."""
        assert self.local is not None and self._local_cache is not None
        rows = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)).unsqueeze(0)
        out = self.local.step(rows, start, self._local_cache, commit=commit, parents=parents, keep=keep)
        return out[0].to("cpu").to(torch.float32).numpy()

    async def _receive(self, epoch: int) -> np.ndarray:
        """The next result's rows (through the head's own last layers if it serves them); `Reopened` when the route
        was replaced meanwhile."""
        msg = await self.client.receive(epoch=epoch, timeout=self.timeout_s)
        start, hidden = msg.start, decode_tensor(msg.hidden)
        self.load = msg.load
        if self.auditor is not None:
            self._offer_audit(self.auditor, msg.epoch, start, hidden)
        if self.local is None or self._local_first:
            return hidden
        if not self._tail_windows or self._tail_windows[0][0] != start:
            sent = [w[0] for w in self._tail_windows]
            raise RuntimeError(f"a result at position {start} came back, but the windows in flight start at {sent}")
        t0 = time.perf_counter()
        hidden = await trio.to_thread.run_sync(self._run_tail, hidden, *self._tail_windows.popleft(), limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        return hidden

    def _offer_audit(self, auditor: Auditor, epoch: int, start: int, hidden: np.ndarray) -> None:
        """Match a result to the window it answers (those skipped as stale drop out) and offer it for audit."""
        while self._sent:
            sent_epoch, sent_start, context, tokens, parents = self._sent.popleft()
            if (sent_epoch, sent_start) == (epoch, start):
                auditor.offer(context, tokens, parents, hidden, self.client.hops)
                return

    async def settle(self) -> None:
        """Wait for the audits of the windows collected so far (`LieCaught` if one failed), at most one deadline of
        this route's own rounds: what one more round would be given."""
        if self.auditor is not None:
            rounds = self.client.state.rounds
            await self.auditor.settle(rounds.deadline_s(rounds.last_tokens))

    def _logits(self, hidden: np.ndarray, rows: int) -> torch.Tensor:
        with torch.inference_mode():
            h = torch.from_numpy(np.ascontiguousarray(hidden[-rows:], dtype=np.float32)).unsqueeze(0)
            return self.head.logits(h)[0].to("cpu").to(torch.float32)  # the verifier works on the CPU

    async def _send(
        self, tokens: Sequence[int], start: int, commit: int | None, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None, ahead: bool = False,
    ) -> None:
        t0 = time.perf_counter()
        hidden = await trio.to_thread.run_sync(self._rows_out, tokens, start, commit, parents, keep, limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        if self.local is not None and not self._local_first:
            self._tail_windows.append((start, commit, parents, keep))
        context = self._held.sent(tokens, start, commit, parents, keep)
        if self.auditor is not None:
            self._sent.append((epoch, start, context, list(tokens), None if parents is None else list(parents)))
        await self.client.send_window(hidden, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep,
                                      ahead=ahead)

    async def submit(
        self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        """Send a window; a long chain (a prompt) goes in chunks, all but the last awaited here; a tree whole.

        `keep` (after a tree window, with commit = its start) names the accepted nodes, root first.
        A window of the same epoch sent before the last one's result is collected goes ahead (see the
        class doc)."""
        if self._uncollected and epoch == self._epoch:
            await self._submit_ahead(tokens, start, commit, epoch, parents, keep)
            return
        self._prefix = self._held.context(start, commit, keep)
        self._window = list(tokens)
        self._parents = None if parents is None else list(parents)
        self._ahead = []
        self._tail_windows.clear()  # windows still in flight are stale: their results are skipped
        self._epoch, self._uncollected = epoch, 1
        try:
            if parents is None:
                await self._send_chunks(tokens, start, commit, epoch, keep)
            else:
                self._before_last = None
                await self._send(tokens, start, commit, epoch, parents, keep)
        except Reopened:  # the route was replaced between two chunks of a long window: replay all of it
            await self._replay_on_new_route(epoch)

    async def _submit_ahead(
        self, tokens: Sequence[int], start: int, commit: int, epoch: int,
        parents: Sequence[int] | None, keep: Sequence[int] | None,
    ) -> None:
        """Send a chain window before the results of those in flight (they stay whole in the caches)."""
        end = len(self._prefix) + len(self._window) + sum(len(w) for w in self._ahead)
        if parents is not None or keep is not None or start != end or commit != start or len(tokens) > self.replay_chunk:
            raise ValueError(f"a window sent ahead must be a chain of at most {self.replay_chunk} tokens at {end} "
                             f"keeping every row before it (got start {start}, commit {commit})")
        async with self._route_lock:
            self._ahead.append(list(tokens))
            self._uncollected += 1
            await self._send(tokens, start, commit, epoch, ahead=True)  # a broken route: collect() recovers

    async def _send_chunks(
        self, tokens: Sequence[int], start: int, commit: int, epoch: int, keep: Sequence[int] | None = None
    ) -> None:
        """Send `tokens` at positions start.. in chunks of `replay_chunk`, awaiting every result but the last's.

        The rows of the chunk before the last are kept: with them, the last `rows` positions are at
        hand for any window of up to `replay_chunk` + 1 tokens, wherever the chunk boundaries fall.
        `keep` goes with the first chunk (it commits the last tree window's path before it).
        """
        self._before_last = None
        at = start
        while len(tokens) - (at - start) > self.replay_chunk:
            first = at == start
            await self._send(tokens[at - start : at - start + self.replay_chunk], at, commit if first else at, epoch,
                             keep=keep if first else None)
            self._before_last = await self._receive(epoch)
            at += self.replay_chunk
        first = at == start
        await self._send(tokens[at - start :], at, commit if first else at, epoch, keep=keep if first else None)

    async def _replay(self, epoch: int) -> None:
        """On a new route: every committed token as a chain, then the window in flight (a tree whole, last).

        Windows in flight on the old route never answer (those sent ahead are dropped: `replays`);
        the local span is rebuilt from position 0."""
        self._tail_windows.clear()
        self._sent.clear()
        self._ahead, self._uncollected = [], 1
        self.replays += 1
        if self._parents is None:
            await self._send_chunks(self._prefix + self._window, 0, 0, epoch)
            return
        start = len(self._prefix)
        if start:
            await self._send_chunks(self._prefix, 0, 0, epoch)
            await self._receive(epoch)
        self._before_last = None
        await self._send(self._window, start, start, epoch, self._parents)

    async def _replay_on_new_route(self, epoch: int) -> None:
        """Replay into the route the client just opened, again if it is replaced during the replay."""
        async with self._route_lock:
            while True:
                try:
                    await self._replay(epoch)  # replay every committed token, the window last
                    return
                except Reopened:
                    continue

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        """The target's logits for the window's last `rows` positions; a route that fails meanwhile is replaced
        and replayed into (RouteGaveOut when none is left; LieCaught when an audit found the route lying)."""
        if self.auditor is not None:
            self.auditor.check()
        while True:
            try:
                hidden = await self._receive(epoch)
                break
            except Reopened:
                await self._replay_on_new_route(epoch)
        if len(hidden) < rows and self._before_last is not None:
            hidden = np.concatenate([self._before_last, hidden])
        self._uncollected -= 1
        if self._ahead:  # the oldest window is in: the next one sent ahead is now the oldest
            self._prefix, self._window, self._parents = self._prefix + self._window, self._ahead.pop(0), None
            self._before_last = None
        if len(hidden) < rows:
            raise ValueError(f"{rows} rows asked of a window sent in chunks of {self.replay_chunk} (at most chunk + 1)")
        t0 = time.perf_counter()
        logits = await trio.to_thread.run_sync(self._logits, hidden, rows, limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        return logits
