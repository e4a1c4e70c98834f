"""Moving a running session's leg from a relayed stream to a direct one, without replaying anything.

A leg of a session (head -> first peer, peer -> next peer, last peer -> head) is one stream, written by its sender
and read by its receiver. When it was opened over a relay and a direct connection to the same peer appears later
(a hole punch that succeeded, a port the gateway mapped), the sender opens a new stream over the direct connection,
writes `Move` as the old stream's last message and `Attach` as the new one's first (`LegMover`). The receiver's
handler of the new stream gives it to the task reading the leg (`Handover`), which reads the old stream up to
`Move` and then carries on from the new one: order is kept, the KV caches stay where they are.
"""

from __future__ import annotations

import logging

import trio

from dsd.protocol import Message, Move
from dsd.protocol.ids import INFER_PROTOCOL

from .framing import FramedStream, close_quietly
from .host import P2PNode

log = logging.getLogger(__name__)

MOVE_OPEN_TIMEOUT_S = 10.0  # opening the direct stream; the leg stays on the relay if it takes longer
MOVE_RETRY_S = 15.0  # after a move that did not happen, the next try waits this long
ATTACH_TIMEOUT_S = 30.0  # a receiver waits this long after a Move for the stream that attaches


class Handover:
    """The streams that attach to one running leg, handed from the handler that accepted them to the task reading it.

    Only `remote`, the peer that writes the leg, may attach; the handler holds its stream until the reader is done
    with it (the next move or the end of the session), so the dispatcher does not close it under the reader."""

    def __init__(self, remote: str) -> None:
        self.remote = remote
        self._send, self._recv = trio.open_memory_channel[tuple[FramedStream, trio.Event]](1)
        self._done: trio.Event | None = None

    async def give(self, stream: FramedStream, remote: str) -> bool:
        """Hand `stream` to the reader and wait until it is done with it; False at once (nothing handed) when
        `remote` is not the leg's writer or another stream is already waiting."""
        if remote != self.remote:
            return False
        done = trio.Event()
        try:
            self._send.send_nowait((stream, done))
        except (trio.WouldBlock, trio.ClosedResourceError):
            return False
        await done.wait()
        return True

    async def take(self, timeout_s: float = ATTACH_TIMEOUT_S) -> FramedStream:
        """The stream that attached after a `Move` (trio.TooSlowError after `timeout_s`); the last one is let go."""
        with trio.fail_after(timeout_s):
            stream, done = await self._recv.receive()
        self.release()
        self._done = done
        return stream

    def release(self) -> None:
        """Let the handler holding the stream read now return (a new move, or the session ended); refuse any more."""
        if self._done is not None:
            self._done.set()
            self._done = None

    def close(self) -> None:
        """The leg is over: let every handler go, refuse later attaches."""
        self.release()
        self._send.close()
        while True:
            try:
                _, done = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            done.set()


class LegMover:
    """The sending end of one leg to `peer_id`: moves it onto a direct connection once one exists (see the module)."""

    def __init__(self, node: P2PNode, peer_id: str, addrs: tuple[str, ...] = (), retry_s: float = MOVE_RETRY_S) -> None:
        self.node = node
        self.peer_id = peer_id
        self.addrs = addrs
        self.retry_s = retry_s
        self._next_try = 0.0
        self._direct: FramedStream | None = None  # a stream found direct stays direct: not looked at again

    def wants_move(self, stream: FramedStream) -> bool:
        """Is `stream` relayed while new streams to the peer would travel directly (and no failed try is recent)?
        Called before every window: a node without NAT services, or a stream already found direct, costs nothing."""
        if self.node.nat is None or stream is self._direct or trio.current_time() < self._next_try:
            return False
        if self.node.link_kind(self.peer_id, stream) != "relayed":
            self._direct = stream
            return False
        return self.node.link_kind(self.peer_id) not in (None, "relayed")

    async def move(self, old: FramedStream, session: str, attach: Message) -> FramedStream | None:
        """The new direct stream carrying the leg on (`Move` written on `old`, `attach` on the new one), or None when
        none opened directly (the leg stays on `old`; tried again after `retry_s`). Errors writing `old` propagate:
        the leg is broken either way."""
        self._next_try = trio.current_time() + self.retry_s
        try:
            with trio.fail_after(MOVE_OPEN_TIMEOUT_S):
                new = await self.node.open(self.peer_id, self.addrs, INFER_PROTOCOL)
        except Exception as exc:
            log.info("session %s: the leg to %s stays relayed: no direct stream (%r)", session, self.peer_id, exc)
            return None
        if self.node.link_kind(self.peer_id, new) == "relayed":
            log.info("session %s: the leg to %s stays relayed: a new stream went over the relay too", session,
                     self.peer_id)
            await close_quietly(new)
            return None
        try:
            await old.send(Move(session))
            await new.send(attach)
        except BaseException:
            await close_quietly(new)
            raise
        log.info("session %s: the leg to %s moved from the relay to a %s link, nothing replayed", session,
                 self.peer_id, self.node.link_kind(self.peer_id, new))
        return new
