"""Routing each incoming `/dsd/infer/1` stream by its first message."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from dsd.discovery.framing import FramedStream
from dsd.node.route.legs import ReturnLegs
from dsd.node.server.metrics import PeerMetrics
from dsd.protocol import Ack, Attach, Error, OpenSession, ProtocolError

if TYPE_CHECKING:  # a head's dispatcher has no server: heads and bootstrap nodes load no torch for it
    from dsd.node.server.block import BlockServer

log = logging.getLogger(__name__)


class InferDispatcher:
    """Routes each incoming `/dsd/infer/1` stream by its first message: a session to serve, a return leg, or a stream
    that takes over a running leg of either (`Attach`).

    Every stream's bytes and every bad opening are counted in `metrics` (the block server's, once
    the daemon has loaded one, so a peer exposes one registry).
    """

    def __init__(self, server: BlockServer | None, legs: ReturnLegs, first_timeout_s: float = 30.0,
                 metrics: PeerMetrics | None = None) -> None:
        self.server = server
        self.legs = legs
        self.first_timeout_s = first_timeout_s
        self.metrics = metrics or PeerMetrics()

    async def __call__(self, stream: FramedStream, remote: str) -> None:
        metrics = self.metrics
        metrics.track(stream)
        try:
            await self._dispatch(stream, remote)
        finally:
            metrics.untrack(stream)

    async def _dispatch(self, stream: FramedStream, remote: str) -> None:
        try:
            with trio.fail_after(self.first_timeout_s):
                first = await stream.receive()
        except (trio.TooSlowError, EOFError, ProtocolError, OSError, trio.BrokenResourceError) as exc:
            log.info("infer stream from %s: bad opening (%r)", remote, exc)
            code = "bad_frame" if isinstance(exc, ProtocolError) else "bad_request"
            await self._refuse(stream, Error(code, f"bad opening message: {exc}"))
            return
        if isinstance(first, OpenSession) and self.server is not None:
            await self.server.serve(stream, remote, first)
        elif isinstance(first, Ack):
            await self.legs.serve(stream, remote, first)
        elif isinstance(first, Attach) and (first.start is None or self.server is None):
            await self.legs.attach(stream, remote, first)  # a return leg moving off a relay (or nothing to attach to)
        elif isinstance(first, Attach):
            await self.server.attach(stream, remote, first)  # a leg into a session served here moving off a relay
        elif isinstance(first, OpenSession):
            await self._refuse(stream, Error("bad_request", "this peer serves no blocks", first.session))
        else:
            await self._refuse(stream, Error("bad_request", f"a session must start with OpenSession, got {type(first).__name__}", getattr(first, "session", None)))

    async def _refuse(self, stream: FramedStream, error: Error) -> None:
        self.metrics.error(error.code)
        with trio.move_on_after(5):
            try:
                await stream.send(error)
                await stream.close()
            except Exception as exc:
                log.debug("refusal not delivered: %r", exc)
