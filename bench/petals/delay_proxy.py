"""A byte-stream delay proxy: what puts dsd's emulated WAN latency on Petals' links.

Petals' traffic goes through hivemind's p2pd daemon, so dsd's in-process link shaper cannot delay it; a proxy in
front of each Petals server (the server announcing the proxy's address) can. Every chunk read from one side is
released to the other `delay` seconds after it was read, in both directions: a queue of (release time, chunk) per
direction, drained in order by a writer that waits only for the head's release time, so back-to-back chunks are
all delayed by d once (a chunk sent at t arrives at t + d) rather than d each, and reading never waits for writing.

Standard library only (asyncio), so it runs under dsd's .venv, the Petals venv or the system python alike:

    python bench/petals/delay_proxy.py serve --delay-ms 25 --map 127.0.0.1:4100=127.0.0.1:31330 [--map ...]
    python bench/petals/delay_proxy.py measure --delays-ms 0,25,50   # added round-trip time, JSON

`serve` prints one JSON line once listening, then runs until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHUNK = 1 << 16
Address = tuple[str, int]


def parse_address(text: str) -> Address:
    """HOST:PORT as a (host, port) pair."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def _delayed_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader to writer, each chunk released `delay_s` after it was read; EOF is forwarded the same way."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def pump_in() -> None:
        while True:
            data = await reader.read(CHUNK)
            queue.put_nowait((loop.time() + delay_s, data))
            if not data:
                return

    async def pump_out() -> None:
        while True:
            release, data = await queue.get()
            wait = release - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(pump_in())
        tasks.create_task(pump_out())


class DelayProxy:
    """Listens on `listen` and forwards every connection to `target`, delaying each direction by `delay_s`."""

    def __init__(self, target: Address, delay_s: float, listen: Address = ("127.0.0.1", 0)) -> None:
        self.target, self.delay_s, self.listen = target, delay_s, listen
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> Address:
        """The bound (host, port) (port 0 in `listen` picks a free one)."""
        assert self.server is not None, "start() first"
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> DelayProxy:
        """Start listening."""
        self.server = await asyncio.start_server(self._accept, *self.listen)
        return self

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One connection: dial the target, then both delayed pipes until both sides are done or one fails."""
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        target_w: asyncio.StreamWriter | None = None
        try:
            target_r, target_w = await asyncio.open_connection(*self.target)
            async with asyncio.TaskGroup() as pipes:
                pipes.create_task(_delayed_pipe(client_r, target_w, self.delay_s))
                pipes.create_task(_delayed_pipe(target_r, client_w, self.delay_s))
        except (OSError, ExceptionGroup):  # a reset or refused connection ends this connection only
            pass
        except asyncio.CancelledError:  # close(): the normal end of a handler task (re-raised, 3.11 logs it)
            pass
        finally:
            for w in (client_w, target_w):
                if w is not None:
                    w.close()
            self.connections.discard(task)

    async def close(self) -> None:
        """Stop listening and drop the open connections."""
        if self.server is not None:
            self.server.close()
        for task in list(self.connections):
            task.cancel()
        for task in list(self.connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.server is not None:
            await self.server.wait_closed()

    async def __aenter__(self) -> DelayProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --- measuring the added latency --------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation (as bench/harness.py's)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Median, 10th and 90th percentiles in milliseconds."""
    return {k: round(percentile(values_s, q) * 1000, 3) for k, q in (("median", 0.5), ("p10", 0.1), ("p90", 0.9))}


async def echo_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo server: every byte back."""
    with contextlib.suppress(OSError, asyncio.CancelledError):  # cancelled: the event loop is closing
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    writer.close()


async def _round_trips(address: Address, rounds: int, size: int, warmup: int = 3) -> list[float]:
    """`rounds` request/response round-trip times (s) of `size`-byte messages over one connection."""
    reader, writer = await asyncio.open_connection(*address)
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    rtts = []
    try:
        for n in range(warmup + rounds):
            t0 = time.perf_counter()
            writer.write(payload)
            await writer.drain()
            assert await reader.readexactly(size) == payload
            if n >= warmup:
                rtts.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return rtts


async def _burst(address: Address, messages: int, size: int) -> float:
    """Seconds from writing `messages` messages back to back until the last echo is in (≈ 2d through a proxy)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        t0 = time.perf_counter()
        for _ in range(messages):
            writer.write(bytes(size))
        await writer.drain()
        await reader.readexactly(messages * size)
        return time.perf_counter() - t0
    finally:
        writer.close()


async def measure_async(delays_ms: Sequence[float], rounds: int = 40, size: int = 64,
                        burst: int = 20) -> dict[str, Any]:
    """Round trips to an echo server directly and through a proxy per delay: the added RTT against 2·d."""
    echo = await asyncio.start_server(echo_handler, "127.0.0.1", 0)
    target = echo.sockets[0].getsockname()[:2]
    try:
        direct = await _round_trips(target, rounds, size)
        base = percentile(direct, 0.5)
        out: dict[str, Any] = {"rounds": rounds, "message_bytes": size, "direct_rtt_ms": summary_ms(direct),
                               "delays": []}
        for d in delays_ms:
            async with DelayProxy(target, d / 1000) as proxy:
                rtts = await _round_trips(proxy.address, rounds, size)
                burst_s = await _burst(proxy.address, burst, size)
            out["delays"].append({"delay_ms": d, "expected_added_ms": 2 * d, "rtt_ms": summary_ms(rtts),
                                  "added_rtt_ms": summary_ms([r - base for r in rtts]),
                                  f"burst_of_{burst}_last_echo_ms": round(burst_s * 1000, 3)})
        return out
    finally:
        echo.close()
        await echo.wait_closed()


def measure(delays_ms: Sequence[float], rounds: int = 40, size: int = 64, burst: int = 20) -> dict[str, Any]:
    """`measure_async` in a fresh event loop."""
    return asyncio.run(measure_async(delays_ms, rounds, size, burst))


async def serve(maps: Sequence[tuple[Address, Address]], delay_s: float) -> None:
    """Run one proxy per (listen, target) pair until cancelled; print their addresses as a JSON line once up."""
    proxies = [await DelayProxy(target, delay_s, listen).start() for listen, target in maps]
    try:
        print(json.dumps({"delay_ms": delay_s * 1000, "proxies": [
            {"listen": "{}:{}".format(*p.address), "target": "{}:{}".format(*p.target)} for p in proxies]}),
              flush=True)
        await asyncio.Event().wait()
    finally:
        for p in proxies:
            await p.close()


def provenance(script: str, argv: Sequence[str]) -> dict[str, Any]:
    """What a committed measurement carries: its command, the checkout's commit (the benchmarks' own
    `harness.git_commit`, standard library only like this file, which also runs under the Petals venv) and the date."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness import git_commit

    return {"command": " ".join([script, *argv]), "commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_count": os.cpu_count()}


def main(argv: Sequence[str] | None = None) -> int:
    """serve / measure."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run proxies until interrupted")
    s.add_argument("--delay-ms", type=float, required=True, help="one-way latency added in each direction")
    s.add_argument("--map", action="append", required=True, metavar="LISTEN=TARGET",
                   help="HOST:PORT=HOST:PORT (repeat for several servers)")
    m = sub.add_parser("measure", help="added round-trip time through the proxy, as JSON")
    m.add_argument("--delays-ms", default="0,25,50")
    m.add_argument("--rounds", type=int, default=40)
    m.add_argument("--bytes", type=int, default=64)
    args = p.parse_args(argv)
    if args.cmd == "measure":
        load_before = os.getloadavg()
        result = measure([float(x) for x in args.delays_ms.split(",")], args.rounds, args.bytes)
        print(json.dumps({**provenance("python3 bench/petals/delay_proxy.py", argv if argv is not None else sys.argv[1:]),
                          "load_before": load_before,
                          "load_after": os.getloadavg(), **result}, indent=1))
        return 0
    try:
        maps = [(parse_address(a), parse_address(b)) for a, _, b in (m.partition("=") for m in args.map)]
    except ValueError as exc:
        p.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(maps, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
