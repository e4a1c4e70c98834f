"""TCP against QUIC in py-libp2p, on loopback: what each transport costs per connection and per round trip (issue 58).

libp2p hosts in this process (a server, and a fresh client for every connection), each listening on `/tcp` and `/udp/…/quic-v1` (TCP upgraded with Noise and yamux,
as dsd's hosts are; QUIC brings its own TLS 1.3 and streams). For each of `--connections` repetitions, the
transports in turn (alternating which goes first): a fresh connection (its setup time), one stream, then
`--round-trips` echoes of each `--sizes` payload (64 B: a control frame; 6 KB: one token's hidden state of the 1.5B
target in fp32; 64 KB: a window of ten); the median round trip per connection. Reported: each figure's median and
range over the connections, and QUIC / TCP paired per connection. Loopback has no latency of its own, so this
measures the transports' own CPU cost on this machine (aioquic, which py-libp2p's QUIC uses, is pure Python);
link latency adds the same to both.

    python bench/transports.py                      # 10 connections per transport, 64 B / 6 KB / 64 KB

Record: results/transports-loopback-DATE.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import multiaddr
import trio
from harness import RESULTS_DIR, comma_list, run_metadata, spread, today, write_json
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

ECHO = TProtocol("/dsd/bench-echo/1")
TRANSPORTS = ("tcp", "quic")
LISTEN = ("/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic-v1")


def _host():
    key_pair = create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    listen = [multiaddr.Multiaddr(a) for a in LISTEN]
    return new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise}, muxer_preference="YAMUX",
                    listen_addrs=listen), listen


async def _echo(stream) -> None:
    while data := await stream.read(1 << 20):
        await stream.write(data)
    await stream.close()


async def _connection(client, server, transport: str, sizes: list[int], round_trips: int) -> dict:
    """One fresh connection over `transport`: its setup seconds and the median round trip per payload size."""
    addr = next(a for a in server.get_addrs() if ("quic" in str(a)) == (transport == "quic"))
    info = info_from_p2p_addr(addr)
    t0 = time.perf_counter()
    with trio.fail_after(10):
        await client.connect(info)
        stream = await client.new_stream(info.peer_id, [ECHO])
    setup = time.perf_counter() - t0
    kinds = {type(c.muxed_conn).__name__ if hasattr(c, "muxed_conn") else type(c).__name__
             for c in client.get_network().get_connections(info.peer_id)}
    rtts: dict[str, float] = {}
    for size in sizes:
        payload, times = b"x" * size, []
        for _ in range(round_trips):
            t = time.perf_counter()
            await stream.write(payload)
            got = 0
            while got < size:
                got += len(await stream.read(1 << 20))
            times.append(time.perf_counter() - t)
        rtts[str(size)] = statistics.median(times)
    await stream.close()
    return {"transport": transport, "connection": sorted(kinds), "setup_s": setup, "rtt_s": rtts}


async def _run(args: argparse.Namespace) -> list[dict]:
    """Every connection from a client host of its own (py-libp2p may hand a redial a connection still closing)."""
    server, listen_s = _host()
    out: list[dict] = []
    async with server.run(listen_addrs=listen_s):
        server.set_stream_handler(ECHO, _echo)
        for rep in range(args.connections):
            order = TRANSPORTS if rep % 2 == 0 else TRANSPORTS[::-1]
            for transport in order:
                client, listen_c = _host()
                async with client.run(listen_addrs=listen_c):
                    row = await _connection(client, server, transport, args.sizes, args.round_trips)
                out.append({"rep": rep, **row})
                print(f"  rep {rep} {transport}: setup {1e3 * row['setup_s']:.1f} ms, round trips "
                      + ", ".join(f"{k} B {1e3 * v:.2f} ms" for k, v in row["rtt_s"].items()), flush=True)
    return out


def summarize(runs: list[dict], sizes: list[int]) -> dict:
    """Median and range over connections, per transport, and QUIC / TCP paired by repetition."""
    by = {t: [r for r in runs if r["transport"] == t] for t in TRANSPORTS}
    out: dict = {}
    for t, rows in by.items():
        out[t] = {"setup_ms": spread([1e3 * r["setup_s"] for r in rows]),
                  **{f"rtt_ms_{s}": spread([1e3 * r["rtt_s"][str(s)] for r in rows]) for s in sizes}}
    pairs = list(zip(sorted(by["tcp"], key=lambda r: r["rep"]), sorted(by["quic"], key=lambda r: r["rep"]),
                     strict=True))
    out["quic_over_tcp"] = {
        "setup": spread([q["setup_s"] / t["setup_s"] for t, q in pairs]),
        **{f"rtt_{s}": spread([q["rtt_s"][str(s)] / t["rtt_s"][str(s)] for t, q in pairs]) for s in sizes},
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=10, help="fresh connections per transport (default 10)")
    p.add_argument("--round-trips", type=int, default=50, help="echoes per payload size and connection (default 50)")
    p.add_argument("--sizes", default="64,6144,65536", help="payload sizes in bytes (default 64,6144,65536)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/transports-loopback-DATE.json)")
    args = p.parse_args(argv)
    args.sizes = comma_list(p, "--sizes", args.sizes, int)
    if args.connections < 1 or args.round_trips < 1 or not args.sizes or min(args.sizes) < 1:
        p.error("--connections, --round-trips and every size must be >= 1")
    out = args.out or RESULTS_DIR / f"transports-loopback-{today()}.json"
    result = run_metadata("transports", args)
    runs = trio.run(_run, args)
    result.update(runs=runs, summary=summarize(runs, args.sizes))
    write_json(out, result)
    print(f"wrote {out}")
    for key, value in result["summary"].items():
        print(key, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
