"""The byte-stream delay proxy put in front of Petals servers (bench/petals/delay_proxy.py) adds the one-way
latency it is told to in each direction, once per chunk, keeping bytes and order."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "petals"))

from delay_proxy import DelayProxy, echo_handler, measure  # noqa: E402


def test_every_chunk_is_delayed_once_and_never_early() -> None:
    """Lower bounds only (a loaded machine can only make a chunk later): no echo comes back before 2·d, and 20
    messages written back to back are delayed together, not one after another (that would take 20 × 2·d).
    How close to 2·d the added round trip is gets measured, not asserted: `delay_proxy.py measure`."""
    result = measure([0.0, 25.0, 50.0], rounds=30, size=64, burst=20)
    print(json.dumps(result))
    for row in result["delays"]:
        d = row["delay_ms"]
        assert row["added_rtt_ms"]["p10"] >= 2 * d - 1.0, f"d={d} ms: a chunk was released before its time"
        assert row["burst_of_20_last_echo_ms"] < 2 * d + 10 * max(d, 5.0), f"d={d} ms: the burst was serialised"


def test_bytes_arrive_intact_and_in_order_both_ways() -> None:
    async def run() -> tuple[bytes, bytes]:
        echo = await asyncio.start_server(echo_handler, "127.0.0.1", 0)
        payload = os.urandom(3 << 20)  # many chunks, each way
        try:
            async with DelayProxy(echo.sockets[0].getsockname()[:2], 0.005) as proxy:
                reader, writer = await asyncio.open_connection(*proxy.address)

                async def send() -> None:
                    writer.write(payload)
                    await writer.drain()
                    writer.write_eof()

                sender = asyncio.create_task(send())
                back = await reader.read(-1)  # until the echo's EOF comes back through the proxy
                await sender
                writer.close()
                return payload, back
        finally:
            echo.close()
            await echo.wait_closed()

    sent, received = asyncio.run(run())
    assert received == sent
