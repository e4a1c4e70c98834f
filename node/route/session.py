"""Head-side client of a route: open a session along the ring, send windows, collect results.

The head opens one stream to the first peer and sends `OpenSession` with the rest
of the route; the last peer opens a stream back to the head (the return leg),
announced by an `Ack` carrying the session id. Errors from any peer flow back to
the head along the first stream; results arrive on the return leg.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import trio

from dsd.discovery.framing import FramedStream
from dsd.discovery.host import P2PNode
from dsd.protocol import (
    Ack,
    CloseSession,
    Error,
    Forward,
    Hop,
    Message,
    OpenSession,
    ProtocolError,
    Result,
    Truncate,
    WireFormat,
    decode_tensor,
)
from dsd.protocol.ids import INFER_PROTOCOL

from .errors import RouteError
from .legs import ReturnLegs

log = logging.getLogger(__name__)


@dataclass
class Traffic:
    """Bytes this head has put on and taken off the wire for one session."""

    sent: int = 0
    received: int = 0


class RouteSession:
    """One inference session over a chain of block peers; an async context manager owning its tasks."""

    def __init__(
        self,
        node: P2PNode,
        legs: ReturnLegs,
        hops: Sequence[Hop],
        *,
        model: str,
        max_len: int,
        wire: WireFormat | None = None,
        open_timeout_s: float = 60.0,
        session_id: str | None = None,
        nursery: trio.Nursery | None = None,
    ) -> None:
        if not hops:
            raise ValueError("a route needs at least one hop")
        self.node = node
        self.legs = legs
        self.hops = list(hops)
        self.model = model
        self.max_len = max_len
        self.wire = wire or WireFormat()
        self.open_timeout_s = open_timeout_s
        self.id = session_id or secrets.token_hex(8)
        self.traffic = Traffic()
        self._stream: FramedStream | None = None
        self._inbox: trio.MemoryReceiveChannel[Message | BaseException] | None = None
        # The watcher task runs in the caller's nursery when given (so the session can be opened
        # and closed from different tasks), else in one this session opens for itself.
        self._nursery = nursery
        self._own_nursery_cm = None if nursery is not None else trio.open_nursery()
        self._watch_scope = trio.CancelScope()

    @property
    def peers(self) -> list[str]:
        return [h.peer_id for h in self.hops]

    def head_hop(self) -> Hop:
        return Hop(self.node.peer_id, tuple(self.node.addrs), 0, 0)

    async def __aenter__(self) -> RouteSession:
        if self._own_nursery_cm is not None:
            self._nursery = await self._own_nursery_cm.__aenter__()
        try:
            await self._open()
        except BaseException as exc:  # noqa: BLE001  (re-raised below, after the nursery is closed)
            self._watch_scope.cancel()
            self.legs.forget(self.id)
            if self._own_nursery_cm is not None:
                await self._own_nursery_cm.__aexit__(None, None, None)
            raise exc
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        try:
            await self._close()
        finally:
            self._watch_scope.cancel()
            self.legs.forget(self.id)
        if self._own_nursery_cm is not None:
            return await self._own_nursery_cm.__aexit__(*exc)
        return None

    async def _open(self) -> None:
        first = self.hops[0]
        self._inbox = self.legs.expect(self.id)
        route = tuple(self.hops[1:]) + (self.head_hop(),)
        try:
            with trio.fail_after(self.open_timeout_s):
                self._stream = await self.node.open(first.peer_id, first.addrs, INFER_PROTOCOL)
                await self._stream.send(
                    OpenSession(self.id, self.model, first.start, first.end, self.max_len, route)
                )
                reply = await self._stream.receive()
                if isinstance(reply, Error):
                    raise RouteError(f"opening session: {reply.message}", peer=first.peer_id, code=reply.code)
                if not isinstance(reply, Ack):
                    raise RouteError(f"first peer answered {type(reply).__name__}", peer=first.peer_id)
                leg = await self._next_message()
                if not isinstance(leg, Ack):
                    raise RouteError(f"return leg opened with {type(leg).__name__}", peer=self.hops[-1].peer_id)
        except trio.TooSlowError as exc:
            raise RouteError(f"opening the route timed out after {self.open_timeout_s:.0f} s", peer=first.peer_id) from exc
        except (EOFError, ProtocolError, OSError) as exc:
            raise RouteError(f"opening the route failed: {exc!r}", peer=first.peer_id) from exc
        assert self._nursery is not None
        self._nursery.start_soon(self._watch_first_stream)
        log.info("session %s open over %d peers", self.id, len(self.hops))

    async def _watch_first_stream(self) -> None:
        """Errors relayed back along the chain arrive on the first stream; hand them to the inbox."""
        with self._watch_scope:
            await self._watch()

    async def _watch(self) -> None:
        assert self._stream is not None
        inbox = self.legs.inbox(self.id)
        try:
            while True:
                msg = await self._stream.receive()
                if inbox is not None:
                    await inbox.send(msg)
        except (EOFError, ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if inbox is not None:
                with trio.move_on_after(1):
                    try:
                        await inbox.send(RouteError(f"stream to first peer ended: {exc!r}", peer=self.hops[0].peer_id))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    async def _next_message(self) -> Message:
        assert self._inbox is not None
        item = await self._inbox.receive()
        if isinstance(item, RouteError) and item.code == "route":
            # A stream ended; the peer that caused it usually sends an Error along the ring
            # right behind: prefer that, it names the culprit.
            with trio.move_on_after(1.0):
                follow = await self._inbox.receive()
                if isinstance(follow, Error):
                    item = follow
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Error):
            raise RouteError(f"peer error {item.code}: {item.message}", code=item.code, peer=self._culprit(item.message))
        return item

    def _culprit(self, message: str) -> str | None:
        """A peer's error starts with its own id; another hop it names (next hop unreachable,
        upstream gone) is the one to blame, else the reporter itself."""
        reporter = next((h.peer_id for h in self.hops if message.startswith(h.peer_id)), None)
        others = [h.peer_id for h in self.hops if h.peer_id in message and h.peer_id != reporter]
        return others[0] if others else reporter

    async def send_message(self, msg: Message) -> None:
        """Send any message on the session's first stream (windows normally go through `send_window`)."""
        assert self._stream is not None
        try:
            self.traffic.sent += await self._stream.send(msg)
        except Exception as exc:  # reset, closed, peer gone
            raise RouteError(f"sending to the first peer failed: {exc!r}", peer=self.hops[0].peer_id) from exc

    async def send_window(self, hidden: np.ndarray, *, start: int, commit: int | None, epoch: int = 0) -> None:
        """Send hidden states [tokens, hidden] at positions start.. down the route (does not wait)."""
        await self.send_message(Forward(self.id, epoch, start, commit, self.wire.encode(np.ascontiguousarray(hidden, dtype=np.float32))))

    async def receive_result(self, *, epoch: int = 0, timeout: float = 120.0) -> tuple[int, np.ndarray]:
        """The next result of `epoch` (older epochs are skipped): (start, hidden [tokens, hidden])."""
        try:
            with trio.fail_after(timeout):
                while True:
                    msg = await self._next_message()
                    if isinstance(msg, Result) and msg.epoch >= epoch:
                        self.traffic.received += _wire_bytes(msg)
                        return msg.start, decode_tensor(msg.hidden)
                    log.debug("session %s skipped %s", self.id, type(msg).__name__)
        except trio.TooSlowError as exc:
            raise RouteError(f"no result within {timeout:.0f} s", code="timeout") from exc

    async def forward(self, hidden: np.ndarray, *, start: int, commit: int | None, epoch: int = 0, timeout: float = 120.0) -> np.ndarray:
        """One round trip: send a window and wait for its final hidden states."""
        await self.send_window(hidden, start=start, commit=commit, epoch=epoch)
        _, out = await self.receive_result(epoch=epoch, timeout=timeout)
        return out

    async def truncate(self, length: int, *, timeout: float = 60.0) -> int:
        """Drop every peer's KV entries at positions >= length; returns the length the last peer reports."""
        await self.send_message(Truncate(self.id, length))
        try:
            with trio.fail_after(timeout):
                while True:
                    msg = await self._next_message()
                    if isinstance(msg, Ack):
                        return msg.length
        except trio.TooSlowError as exc:
            raise RouteError(f"truncate not acknowledged within {timeout:.0f} s", code="timeout") from exc

    async def _close(self) -> None:
        if self._stream is None:
            return
        with trio.move_on_after(5):
            try:
                await self._stream.send(CloseSession(self.id))
                await self._stream.close()
            except Exception as exc:
                log.debug("session %s close: %r", self.id, exc)


def _wire_bytes(msg: Result) -> int:
    """Approximate frame size of a result (tensor payload dominates)."""
    return len(msg.hidden.data) + 64
