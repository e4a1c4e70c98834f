"""Return legs: the streams that the last peers of this head's routes open back to it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from dsd.discovery.framing import FramedStream, close_quietly, send_quietly
from dsd.discovery.handover import Handover
from dsd.protocol import (
    Ack,
    Attach,
    Error,
    Message,
    Move,
    ProtocolError,
)

from .errors import RouteError

log = logging.getLogger(__name__)


class ReturnLegs:
    """Streams that the last peers of this head's routes open back to it, matched by session id; a leg that moves off
    a relay carries on over the stream that attaches to it (`dsd.discovery.handover`)."""

    def __init__(self) -> None:
        self._inboxes: dict[str, trio.MemorySendChannel[Message | BaseException]] = {}
        self._watchers: dict[str, Callable[[FramedStream], None]] = {}  # session id -> told of each leg stream
        self._handovers: dict[str, Handover] = {}

    def expect(self, session: str, watch: Callable[[FramedStream], None] | None = None,
               ) -> trio.MemoryReceiveChannel[Message | BaseException]:
        """The inbox of `session`'s return leg; `watch` is given each stream the leg comes over (for byte counts)."""
        send, recv = trio.open_memory_channel[Message | BaseException](64)
        self._inboxes[session] = send
        if watch is not None:
            self._watchers[session] = watch
        return recv

    def forget(self, session: str) -> None:
        self._inboxes.pop(session, None)
        self._watchers.pop(session, None)
        handover = self._handovers.pop(session, None)
        if handover is not None:
            handover.close()

    def inbox(self, session: str) -> trio.MemorySendChannel[Message | BaseException] | None:
        return self._inboxes.get(session)

    async def serve(self, stream: FramedStream, remote: str, first: Ack) -> None:
        """Pump one return leg into its session's inbox until EOF."""
        inbox = self._inboxes.get(first.session)
        if inbox is None:
            await stream.send(Error("unknown_session", f"this head has no session {first.session!r}", first.session))
            await stream.close()
            return
        sid = first.session
        handover = self._handovers[sid] = Handover(remote)
        self._use(sid, stream)
        try:
            await inbox.send(first)
            while True:
                msg = await stream.receive()
                if isinstance(msg, Move):  # the last peer moved the leg off a relay: read on from the new stream
                    old, stream = stream, await handover.take()
                    self._use(sid, stream)
                    await close_quietly(old)
                    log.info("session %s: the return leg from %s moved off the relay", sid, remote)
                    continue
                await inbox.send(msg)
        except trio.TooSlowError:
            await _broken(inbox, RouteError(f"return leg from {remote} moved, but no stream attached", peer=remote))
        except (EOFError, ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # After a normal close nobody reads the inbox any more; otherwise the route is broken.
            await _broken(inbox, RouteError(f"return leg from {remote} ended: {exc!r}", peer=remote))
        finally:
            handover.close()
            with trio.move_on_after(2):
                await stream.close()

    def _use(self, session: str, stream: FramedStream) -> None:
        watch = self._watchers.get(session)
        if watch is not None:
            watch(stream)

    async def attach(self, stream: FramedStream, remote: str, first: Attach) -> None:
        """A new stream taking over `first.session`'s return leg after its `Move`: hand it to the leg's reader (held
        until it is done with it); refused when this head has no such leg or `remote` is not its last peer."""
        handover = self._handovers.get(first.session)
        if handover is not None and await handover.give(stream, remote):
            return
        await send_quietly(stream, Error("unknown_session", f"this head has no return leg {first.session!r} that "
                                         f"{remote} may attach to", first.session))
        await close_quietly(stream)


async def _broken(inbox: trio.MemorySendChannel[Message | BaseException], error: RouteError) -> None:
    """Tell the session its return leg broke (within 1 s; nobody may be reading any more)."""
    with trio.move_on_after(1):
        try:
            await inbox.send(error)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass
