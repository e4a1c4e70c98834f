"""Does a peer busy computing still answer pings, refresh its record and show up in surveys? (issue 43's candidates)

A real swarm (the default target split over `--peers` peers, or the tiny 8-layer model) and a head that keeps
the first peer computing back to back: `--sessions` sessions on that peer alone, each sending windows of
`--window` tokens as soon as the last came back. Beside it, for an idle stretch and then a busy one:

- pings to the busy peer every 100 ms (a new stream each, as the head's probes open them): RTT percentiles;
- its DHT record read every 2 s: whether it was found live, and the gaps between its refreshes;
- full surveys (what a head runs before planning): how often the busy peer was left out for want of a pong.

    python bench/busy_peer.py --models real --seconds 60      # the default pair, 4 peers (about 5 minutes)
    python bench/busy_peer.py --models tiny --seconds 20      # a smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    command_line,
    run_metadata,
    swarm,
    today,
    write_json,
)


def percentiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 2)

    return {"n": len(values), "p50_ms": q(0.5), "p95_ms": q(0.95), "max_ms": round(ordered[-1] * 1000, 2)}


async def watch(node: Any, peer: dict[str, Any], model: str, num_layers: int, seconds: float) -> dict[str, Any]:
    """Ping the peer, read its record and survey the swarm for `seconds`; what each saw."""
    import trio

    from dsd.discovery.announce import fetch_records
    from dsd.discovery.ping import measure_rtt
    from dsd.discovery.survey import survey

    rtts: list[float] = []
    lost_pings = 0
    issued: list[float] = []
    found, reads = 0, 0
    surveys, left_out = 0, 0

    async def pings() -> None:
        nonlocal lost_pings
        while True:
            try:
                rtts.append(await measure_rtt(node, peer["peer_id"], [peer["multiaddr"]], samples=1, timeout=5.0))
            except Exception:
                lost_pings += 1
            await trio.sleep(0.1)

    async def records() -> None:
        nonlocal found, reads
        while True:
            recs = {r.peer_id: r for r in await fetch_records(node, model, num_layers)}
            reads += 1
            rec = recs.get(peer["peer_id"])
            if rec is not None:
                found += 1
                if not issued or rec.issued != issued[-1]:
                    issued.append(rec.issued)
            await trio.sleep(2.0)

    async def surveying() -> None:
        nonlocal surveys, left_out
        while True:
            view = await survey(node, model, num_layers)
            surveys += 1
            left_out += view.rtts.get(peer["peer_id"]) is None
            await trio.sleep(1.0)

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for task in (pings, records, surveying):
                nursery.start_soon(task)
    gaps = [b - a for a, b in zip(issued, issued[1:], strict=False)]
    return {"ping": {**percentiles(rtts), "lost": lost_pings}, "record_reads": reads, "record_found": found,
            "refresh_gaps_s": [round(g, 2) for g in gaps], "surveys": surveys, "surveys_without_the_peer": left_out}


async def keep_busy(node: Any, legs: Any, hop: Any, model: str, hidden_size: int, window: int, counter: list[int]) -> None:
    """Windows of `window` tokens on a session over the one hop, each sent as soon as the last came back."""
    import numpy as np

    from dsd.node.route.session import open_route_session

    rng = np.random.default_rng(0)
    async with open_route_session(node, legs, [hop], model=model, max_len=4096) as session:
        at = 0
        while True:
            if at + window > 4000:
                at = 0
            hidden = rng.standard_normal((window, hidden_size)).astype(np.float32)
            await session.forward(hidden, start=at, commit=at, timeout=120)
            at += window
            counter[0] += 1


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    import trio

    from dsd.node.peer.host import head_node
    from dsd.node.testnet.swarm import SwarmSpec
    from dsd.protocol import Hop
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", choices=("tiny", "real"), default="real")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0, help="length of the idle and of the busy stretch")
    p.add_argument("--sessions", type=int, default=2, help="sessions keeping the peer busy")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="busy-"))
    if args.models == "real":
        if not prepared(weights="fp32"):
            raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
        target = default_store_paths(weights="fp32")["target"]
    else:
        target = build_tiny_store(work / "tiny", layers=8)
    store = Store(target)
    model, layers, hidden = store.manifest.model_id, store.num_layers, int(store.manifest.hidden_size)
    results = args.results or RESULTS_DIR / f"busy_peer-{args.models}-{today()}.json"
    data: dict[str, Any] = {"meta": run_metadata("busy_peer", args), "command": command_line("busy_peer.py", sys.argv[1:]),
                            "load_before": os.getloadavg()}
    with swarm(SwarmSpec(state=work / "testnet", store=target, peers=args.peers)) as testnet:
        first = testnet.peers[1]  # after the bootstrap
        peer = {"peer_id": first.peer_id, "multiaddr": first.multiaddr}
        hop = Hop(first.peer_id, (first.multiaddr,), first.start, first.end)

        async def run() -> None:
            async with head_node([testnet.bootstrap]) as (node, legs):
                data["idle"] = await watch(node, peer, model, layers, args.seconds)
                windows = [0]
                t0 = time.monotonic()
                async with trio.open_nursery() as nursery:
                    for _ in range(args.sessions):
                        nursery.start_soon(keep_busy, node, legs, hop, model, hidden, args.window, windows)
                    await trio.sleep(2.0)  # the sessions are open and computing
                    data["busy"] = await watch(node, peer, model, layers, args.seconds)
                    nursery.cancel_scope.cancel()
                data["busy"]["windows_computed"] = windows[0]
                data["busy"]["window_s"] = round((time.monotonic() - t0) / max(1, windows[0]) * args.sessions, 4)

        trio.run(run)
    data["load_after"] = os.getloadavg()
    write_json(results, data)
    print(f"idle: {data['idle']}\nbusy: {data['busy']}\n-> {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
