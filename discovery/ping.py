"""RTT probes over `/dsd/ping/1`: Ping/Pong frames on one stream; the median of a few round trips.

Probes travel through the node's stream wrapper (the WAN link shaper), so what the
route planner measures is what the link costs.
"""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Callable, Sequence

import trio

from dsd.protocol import Ping, Pong, ProtocolError
from dsd.protocol.ids import PING_PROTOCOL

from .framing import FramedStream
from .host import P2PNode

MAX_PINGS_PER_STREAM = 1000


def install_ping_handler(node: P2PNode) -> None:
    """Answer every Ping on `/dsd/ping/1` with a Pong carrying the same nonce and payload."""

    async def handle(stream: FramedStream, remote: str) -> None:
        for _ in range(MAX_PINGS_PER_STREAM):
            try:
                msg = await stream.receive()
            except EOFError:
                return
            if not isinstance(msg, Ping):
                raise ProtocolError(f"expected Ping on {PING_PROTOCOL}, got {type(msg).__name__}", "type")
            await stream.send(Pong(msg.nonce, msg.payload))

    node.set_handler(PING_PROTOCOL, handle)


async def measure_rtt(
    node: P2PNode,
    peer_id: str,
    addrs: Sequence[str],
    *,
    samples: int = 3,
    timeout: float = 5.0,
    payload: bytes = b"",
    on_sample: Callable[[float], None] | None = None,
) -> float:
    """Median round-trip time in seconds of `samples` pings (after connecting); TimeoutError past `timeout`.

    `on_sample` sees each round trip as it is measured (a caller cutting probes short keeps those).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    times: list[float] = []
    with trio.fail_after(timeout):
        stream = await node.open(peer_id, addrs, PING_PROTOCOL)
        try:
            for _ in range(samples):
                nonce = secrets.randbits(63)
                t0 = trio.current_time()
                await stream.send(Ping(nonce, payload))
                reply = await stream.receive()
                if not isinstance(reply, Pong) or reply.nonce != nonce:
                    raise ProtocolError(f"{peer_id} answered a ping with a wrong reply", "nonce")
                times.append(trio.current_time() - t0)
                if on_sample is not None:
                    on_sample(times[-1])
        finally:
            await stream.close()
    return statistics.median(times)
