"""Raw frames and streams, as a hostile client sends them."""

from __future__ import annotations

import contextlib


def raw_frame(body: dict | bytes) -> bytes:
    """A frame of any wire map (msgpack), or of any bytes as they are, with its 4-byte length: what the
    message classes refuse to build."""
    import msgpack

    raw = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return len(raw).to_bytes(4, "big") + raw


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the offsets `cuts` (taken modulo its length + 1): the chunks a stream may deliver."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


async def read_frames(stream, decoder, replies: int | None = None) -> list:
    """Frames read from a raw stream until the peer closes (or resets) it, or `replies` have come."""
    got: list = []
    while replies is None or len(got) < replies:
        try:
            chunk = await stream.read(65536)
        except Exception:  # reset by the peer
            break
        if not chunk:
            break
        got.extend(decoder.feed(chunk))
    return got


async def raw_exchange(node, peer: dict, protocol: str, data: bytes, *, replies: int | None = None,
                       timeout: float = 20.0, close_write: bool = False) -> list:
    """Write raw bytes on a fresh `protocol` stream to `peer` ({peer_id, addrs}), closing our side after them
    if `close_write`; the frames answered until the peer closed the stream (or `replies` came). Taking
    longer than `timeout` fails the test (trio.TooSlowError). The stream is reset at the end."""
    import trio

    from dsd.protocol import FrameDecoder

    stream = await node.open_raw(peer["peer_id"], peer["addrs"], protocol)
    try:
        with trio.fail_after(timeout):
            await stream.write(data)
            if close_write:
                with contextlib.suppress(Exception):
                    await stream.close_write()
            return await read_frames(stream, FrameDecoder(), replies)
    finally:
        with trio.move_on_after(5), contextlib.suppress(Exception):
            await stream.reset()
