"""The streams of one session along a route: open it along the ring, send windows, receive results.

The head opens one stream to the first peer and sends `OpenSession` with the rest
of the route; the last peer opens a stream back to the head (the return leg),
announced by an `Ack` carrying the session id. Errors from any peer flow back to
the head along the first stream; results arrive on the return leg. A leg opened over a relay moves to a direct
stream when a direct connection appears (`dsd.discovery.handover`): the head moves its first leg itself, the peers
move theirs and say so (`Moved`), and `links` follows. Timing, blame and
failover are not here: the head's `RouteState` (`dsd.protocol.route_state`) decides them
and `client.RouteClient` carries its decisions out.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from dsd.discovery.framing import FramedStream, close_quietly
from dsd.discovery.handover import LegMover
from dsd.discovery.host import P2PNode
from dsd.discovery.tasks import owned_nursery
from dsd.protocol import (
    Ack,
    Attach,
    CloseSession,
    Error,
    Forward,
    Hop,
    Message,
    Moved,
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


class Traffic:
    """Bytes this head has put on and taken off the wire for one session, frame headers included.

    Exact, not estimated: what was written to and read from the session's two streams (the first
    stream carries the windows out and errors back, the return leg carries the results).
    """

    def __init__(self) -> None:
        self._streams: list[FramedStream] = []

    def watch(self, stream: FramedStream) -> None:
        """Count every byte this stream moves, both ways (its counters are read when asked)."""
        self._streams.append(stream)

    @property
    def sent(self) -> int:
        return sum(s.bytes_sent for s in self._streams)

    @property
    def received(self) -> int:
        return sum(s.bytes_received for s in self._streams)

    def __repr__(self) -> str:
        return f"Traffic(sent={self.sent}, received={self.received})"


class RouteSession:
    """One inference session over a chain of block peers: `open` it in a nursery that runs its watcher, `close` it
    from any task (see `open_route_session` for the plain `async with` form)."""

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
        self.links: list[str | None] = []  # once open: the leg into each hop, then the leg back to the head
        self.moves: list[dict[str, str]] = []  # legs moved off a relay while the session ran: whose leg, to what link
        self._mover = LegMover(node, self.hops[0].peer_id, tuple(self.hops[0].addrs))
        self._send_lock = trio.Lock()  # a move and the windows around it keep their order on the first leg
        self.hidden_size: int | None = None  # width of the hidden states sent (for trial windows)
        self._stream: FramedStream | None = None
        self._inbox: trio.MemoryReceiveChannel[Message | BaseException] | None = None
        # The watcher runs in whichever nursery `open` is given; `close` (from any task) cancels this scope.
        self._watch_scope = trio.CancelScope()

    @property
    def peers(self) -> list[str]:
        return [h.peer_id for h in self.hops]

    def head_hop(self) -> Hop:
        return Hop(self.node.peer_id, tuple(self.node.addrs), 0, 0)

    async def open(self, nursery: trio.Nursery) -> None:
        """Open the route (RouteError on refusal or after `open_timeout_s`); then watch the first stream in `nursery`."""
        try:
            await self._open()
        except BaseException:
            self.legs.forget(self.id)
            if self._stream is not None:
                with trio.CancelScope(shield=True):
                    await close_quietly(self._stream, timeout_s=2.0)
            raise
        nursery.start_soon(self._watch_first_stream)
        log.info("session %s open over %d peers", self.id, len(self.hops))

    async def _open(self) -> None:
        first = self.hops[0]
        self._inbox = self.legs.expect(self.id, self.traffic.watch)
        route = tuple(self.hops[1:]) + (self.head_hop(),)
        try:
            with trio.fail_after(self.open_timeout_s):
                await self._connect_last_peer()
                self._stream = await self.node.open(first.peer_id, first.addrs, INFER_PROTOCOL)
                self.traffic.watch(self._stream)
                await self._stream.send(
                    OpenSession(self.id, self.model, first.start, first.end, self.max_len, route)
                )
                reply = await self._stream.receive()
                if isinstance(reply, Error):  # the peer it names (a later hop that refused), else the first
                    raise RouteError(f"opening session: {reply.message}", peer=self._blamed(reply, first.peer_id),
                                     code=reply.code)
                if not isinstance(reply, Ack):
                    raise RouteError(f"first peer answered {type(reply).__name__}", peer=first.peer_id)
                self.links = [self.node.link_kind(first.peer_id, self._stream), *reply.links]
                leg = await self._next_message()
                if not isinstance(leg, Ack):
                    raise RouteError(f"return leg opened with {type(leg).__name__}", peer=self.hops[-1].peer_id)
        except trio.TooSlowError as exc:
            raise RouteError(f"opening the route timed out after {self.open_timeout_s:.0f} s", peer=first.peer_id,
                             code="timeout") from exc
        except (EOFError, ProtocolError, OSError) as exc:
            raise RouteError(f"opening the route failed: {exc!r}", peer=first.peer_id) from exc

    async def _connect_last_peer(self) -> None:
        """Connect to the route's last peer before opening it: its return leg then comes back over this
        connection, which works when this head sits behind a NAT that nobody can dial into."""
        last = self.hops[-1]
        if last.peer_id in (self.hops[0].peer_id, self.node.peer_id):
            return
        try:
            await self.node.connect(last.peer_id, last.addrs)
        except Exception as exc:
            raise RouteError(f"cannot reach the last peer {last.peer_id}: {exc!r}", peer=last.peer_id) from exc

    async def _watch_first_stream(self) -> None:
        """Errors relayed back along the chain arrive on the first stream; hand them to the inbox."""
        with self._watch_scope:
            await self._watch()

    async def _watch(self) -> None:
        inbox = self.legs.inbox(self.id)
        while True:  # on from the new stream when the first leg moved (the first peer ends the old one)
            stream = self._stream
            assert stream is not None
            try:
                while True:
                    msg = await stream.receive()
                    if inbox is not None:
                        await inbox.send(msg)
            except (EOFError, ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                if stream is not self._stream:
                    await close_quietly(stream)
                    continue
                if inbox is not None:
                    with trio.move_on_after(1):
                        try:
                            await inbox.send(RouteError(f"stream to first peer ended: {exc!r}",
                                                        peer=self.hops[0].peer_id))
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                return

    async def _next_message(self) -> Message:
        assert self._inbox is not None
        while True:
            try:  # what has arrived is taken even when the caller's deadline has already passed
                item = self._inbox.receive_nowait()
            except trio.WouldBlock:
                item = await self._inbox.receive()
            if not isinstance(item, Moved):
                break
            self._note_moved(item.peer, item.link)
        failed: str | None = None
        if isinstance(item, RouteError) and item.code == "route":
            # A stream ended; the peer that caused it usually sends an Error along the ring
            # right behind: prefer that, it names the culprit (shielded: the end is never lost).
            failed = item.peer
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                follow = await self._inbox.receive()
                if isinstance(follow, Error):
                    item = follow
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Error):
            raise RouteError(f"peer error {item.code}: {item.message}", code=item.code, peer=self._blamed(item, failed))
        return item

    def _note_moved(self, sender: str, link: str) -> None:
        """The leg out of `sender` (this head or a hop) travels as `link` now."""
        at = 0 if sender == self.node.peer_id else self.peers.index(sender) + 1 if sender in self.peers else None
        if at is None or at >= len(self.links):
            return
        self.links[at] = link
        self.moves.append({"from": sender, "link": link})

    def _blamed(self, error: Error, failed: str | None) -> str | None:
        """The hop the error's `blame` names, else (no blame, or not on this route) the peer whose stream failed."""
        return error.blame if error.blame in self.peers else failed

    async def send_message(self, msg: Message) -> None:
        """Send any message on the session's first stream (windows normally go through `send_window`); a window first
        moves the first leg onto a direct stream when it is relayed and one to the first peer exists now."""
        assert self._stream is not None
        try:
            async with self._send_lock:
                if isinstance(msg, Forward) and self._mover.wants_move(self._stream):
                    await self.move_first_leg()
                await self._stream.send(msg)
        except Exception as exc:  # reset, closed, peer gone
            raise RouteError(f"sending to the first peer failed: {exc!r}", peer=self.hops[0].peer_id) from exc

    async def move_first_leg(self) -> None:
        """Move the first leg onto a new stream to the first peer (`Move`, then `Attach`): what a window does when the
        leg is relayed and a direct connection exists; callable alone (tests move a direct leg this way)."""
        first = self.hops[0]
        assert self._stream is not None
        new = await self._mover.move(self._stream, self.id, Attach(self.id, first.start))
        if new is None:
            return
        self.traffic.watch(new)
        self._stream = new  # the watcher reads the old one to its end, then this one
        self._note_moved(self.node.peer_id, self.node.link_kind(first.peer_id, new) or "direct")

    async def send_window(
        self,
        hidden: np.ndarray,
        *,
        start: int,
        commit: int | None,
        epoch: int = 0,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
        ahead: bool = False,
    ) -> None:
        """Send hidden states [tokens, hidden] at positions start.. down the route (does not wait).

        `parents` makes the window a token tree; `keep` commits the accepted path of the previous
        window (root first) after `commit` = its start, so then start = commit + len(keep). `ahead`: sent on a
        bet, before the result it follows (busy peers run the windows heads are blocked on first).
        """
        wire = self.wire.encode(np.ascontiguousarray(hidden, dtype=np.float32))
        tree = None if parents is None else tuple(parents)
        path = None if keep is None else tuple(keep)
        self.hidden_size = int(hidden.shape[-1])
        await self.send_message(Forward(self.id, epoch, start, commit, wire, tree, path, ahead))

    async def receive(self, *, until: float) -> Result | None:
        """The next result on this session (of any epoch), or None at `until` (trio time) if none has come.
        A stream that ends or a peer's `Error` raises RouteError naming the peer."""
        with trio.move_on_at(until):
            while True:
                msg = await self._next_message()
                if isinstance(msg, Result):
                    return msg
                log.debug("session %s skipped %s", self.id, type(msg).__name__)
        return None

    async def receive_result(self, *, epoch: int = 0, timeout: float = 120.0) -> tuple[int, np.ndarray]:
        """The next result of `epoch` (older epochs are skipped): (start, hidden [tokens, hidden]); RouteError
        (code timeout) when none comes within `timeout`."""
        give_up = trio.current_time() + timeout
        while True:
            msg = await self.receive(until=give_up)
            if msg is None:
                raise RouteError(f"no result within {timeout:.0f} s", code="timeout")
            if msg.epoch >= epoch:
                return msg.start, decode_tensor(msg.hidden)

    async def forward(
        self,
        hidden: np.ndarray,
        *,
        start: int,
        commit: int | None,
        epoch: int = 0,
        timeout: float = 120.0,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> np.ndarray:
        """One round trip: send a window (a tree with `parents`) and wait for its final hidden states, a row per node."""
        await self.send_window(hidden, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)
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

    async def close(self, timeout_s: float = 5.0) -> None:
        """Tell the route the session is over (best effort, within `timeout_s`), then stop the watcher and drop the
        inbox.

        Shielded: a generation that is cancelled (its client went away) still frees the peers' state at once."""
        try:
            if self._stream is not None:
                with trio.move_on_after(timeout_s) as scope:
                    scope.shield = True
                    try:
                        await self._stream.send(CloseSession(self.id))
                        await self._stream.close()
                    except Exception as exc:
                        log.debug("session %s close: %r", self.id, exc)
        finally:
            self._watch_scope.cancel()
            self.legs.forget(self.id)


@asynccontextmanager
async def open_route_session(
    node: P2PNode, legs: ReturnLegs, hops: Sequence[Hop], **options: Any
) -> AsyncIterator[RouteSession]:
    """A `RouteSession` (options as its constructor's) open for the block, with its watcher in a nursery of its own.

    An error inside the block comes out as itself, not wrapped in an exception group.
    """
    session = RouteSession(node, legs, hops, **options)
    async with owned_nursery() as nursery:
        await session.open(nursery)
        try:
            yield session
        finally:
            await session.close()
