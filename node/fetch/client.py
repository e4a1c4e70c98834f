"""One `/dsd/shard/1` stream to one peer: ask for a manifest or a file range and check every reply's shape.

Three ways a request ends besides success, each its own exception: the peer answered a clear
`Error` (`ShardRefused`: it lacks the file, is busy, ...), the peer broke the protocol
(`PeerFault`: chunks out of order or outside the range, a wrong reply: blacklist it), or the
link failed or stalled past the reply deadline (`ConnectionError` / `trio.TooSlowError`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from dsd.discovery.framing import FramedStream, close_quietly
from dsd.discovery.host import P2PNode
from dsd.protocol import (
    Error,
    FileChunk,
    FileEnd,
    GetFile,
    GetManifest,
    ManifestData,
    Message,
    ProtocolError,
)
from dsd.protocol.ids import SHARD_PROTOCOL


class ShardRefused(Exception):
    """The peer answered a request with an Error frame; `.code` says why (not_found, busy, bad_request, ...)."""

    def __init__(self, peer_id: str, error: Error) -> None:
        self.code = error.code
        super().__init__(f"{peer_id} refused: {error.code}: {error.message}")


class PeerFault(Exception):
    """The peer sent something the protocol does not allow (a wrong reply, misplaced bytes, a bad frame)."""


class ShardClient:
    """Requests on one shard stream, one at a time; each reply waits at most `reply_timeout_s`."""

    def __init__(self, stream: FramedStream, peer_id: str, reply_timeout_s: float = 30.0) -> None:
        self.stream = stream
        self.peer_id = peer_id
        self.reply_timeout_s = reply_timeout_s

    @classmethod
    async def connect(cls, node: P2PNode, peer_id: str, addrs: Sequence[str], *, timeout_s: float = 10.0,
                      reply_timeout_s: float = 30.0) -> ShardClient:
        """Open a shard stream to `peer_id` (TooSlowError past `timeout_s`, LinkError if unreachable)."""
        with trio.fail_after(timeout_s):
            stream = await node.open(peer_id, addrs, SHARD_PROTOCOL)
        return cls(stream, peer_id, reply_timeout_s)

    async def close(self) -> None:
        await close_quietly(self.stream)

    async def abort(self) -> None:
        """Reset the stream (after a failed or stalled request its replies can no longer be trusted in order)."""
        await self.stream.reset()

    async def _reply(self) -> Message:
        try:
            with trio.fail_after(self.reply_timeout_s):
                msg = await self.stream.receive()
        except ProtocolError as exc:
            raise PeerFault(f"{self.peer_id} sent a bad frame: {exc}") from None
        except EOFError as exc:
            raise ConnectionError(f"{self.peer_id} closed the stream: {exc}") from None
        if isinstance(msg, Error):
            raise ShardRefused(self.peer_id, msg)
        return msg

    async def manifest(self, model: str) -> bytes:
        """The manifest bytes the peer stores for `model` (unchecked: the caller hashes them)."""
        await self.stream.send(GetManifest(model))
        reply = await self._reply()
        if not isinstance(reply, ManifestData) or reply.model != model:
            raise PeerFault(f"{self.peer_id} answered GetManifest({model!r}) with {type(reply).__name__}")
        return reply.data

    async def file_range(self, sha256: str, offset: int, length: int, chunk: int,
                         on_chunk: Callable[[FileChunk], Awaitable[None]]) -> None:
        """Fetch bytes [offset, offset + length) of a file, handing each chunk (in order, checked) to `on_chunk`."""
        await self.stream.send(GetFile(sha256, offset, length, chunk))
        at, end = offset, offset + length
        while at < end:
            msg = await self._reply()
            if not isinstance(msg, FileChunk) or msg.sha256 != sha256:
                raise PeerFault(f"{self.peer_id} answered GetFile with {type(msg).__name__} instead of a chunk")
            if msg.offset != at or msg.end > end or len(msg.data) > chunk:
                raise PeerFault(f"{self.peer_id} sent bytes [{msg.offset}, {msg.end}) where [{at}, ...) of at most "
                                f"{chunk} bytes, ending by {end}, was due")
            await on_chunk(msg)
            at = msg.end
        done = await self._reply()
        if not isinstance(done, FileEnd) or done.sha256 != sha256 or done.end != end:
            raise PeerFault(f"{self.peer_id} did not end the range at {end} (sent {done!r:.120})")
