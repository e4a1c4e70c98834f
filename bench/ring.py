"""Ring round trip: how long one window of hidden states takes around a 4-peer ring, what it costs in
bytes, and how long `testnet up` takes to a complete route. Prints JSON (also saved under results/).

For each model (a tiny random target and the real Qwen2.5-Coder-1.5B target) and each emulated
one-way latency (0 and 50 ms), it starts a testnet, opens a session over the planned route,
prefills a prompt embedded by the head, then sends the same 8-token window (and a 1-token one)
repeatedly at the same position (commit = start, so each peer drops the previous copy first) and
times `RouteSession.forward`. Expected with latency L: RTT ≈ (N+1)·L + N·t0(window) + overheads.

    python bench/ring.py                      # tiny and real, 0 and 50 ms
    python bench/ring.py --models tiny --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    comma_list,
    model_kinds,
    plan_once,
    real_tokenizer_store,
    run_metadata,
    testnet,
    today,
    write_json,
)

PROMPT = 'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


async def time_ring(state: Any, store: Any, latency_ms: float, windows: Sequence[int], reps: int,
                    prefill: int) -> dict[str, Any]:
    """Median/min/max round trip of each window size through the testnet's route, and bytes per window."""
    import numpy as np
    import torch

    from dsd.node.peer.host import head_node
    from dsd.node.peer.shaper import LinkProfile
    from dsd.node.route.session import open_route_session

    head = store.load_head()
    vocab = int(store.manifest.config["vocab_size"])
    ids = torch.randint(0, vocab, (1, prefill + max(windows)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = head.embed(ids)[0].to(torch.float32).numpy()
    out: dict[str, Any] = {"prefill_tokens": prefill, "windows": {}}
    async with head_node([state.bootstrap], LinkProfile.from_options(latency_ms)) as (node, legs):
        hops = await plan_once(node, store.manifest.model_id, store.num_layers)
        out["route"] = [[h.start, h.end] for h in hops]
        async with open_route_session(node, legs, hops, model=store.manifest.model_id, max_len=prefill + 64) as session:
            t = time.perf_counter()
            await session.forward(np.ascontiguousarray(hidden[:prefill]), start=0, commit=0)
            out["prefill_rtt_s"] = round(time.perf_counter() - t, 4)
            for w in windows:
                window = np.ascontiguousarray(hidden[prefill : prefill + w])
                times, sent, received = [], [], []
                for _ in range(reps + 1):  # the first is a warm-up
                    s0, r0 = session.traffic.sent, session.traffic.received
                    t = time.perf_counter()
                    result = await session.forward(window, start=prefill, commit=prefill)
                    times.append(time.perf_counter() - t)
                    sent.append(session.traffic.sent - s0)
                    received.append(session.traffic.received - r0)
                    if result.shape != window.shape:
                        raise RuntimeError(f"ring returned {result.shape} for a window of {window.shape}")
                times = times[1:]
                out["windows"][str(w)] = {
                    "rtt_median_s": round(statistics.median(times), 4),
                    "rtt_min_s": round(min(times), 4),
                    "rtt_max_s": round(max(times), 4),
                    "head_bytes_sent": sent[-1],
                    "head_bytes_received": received[-1],
                    "ring_bytes_est": sent[-1] * (len(hops) + 1),
                }
    return out


def run(models: str, latency_ms: float, peers: int, reps: int, work: Path) -> dict[str, Any]:
    """One testnet (model, latency): bring-up time plus the ring timings."""
    import trio

    from dsd.node.testnet.calibrate import measure_t0
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    if models == "real":
        if not prepared(weights="fp32"):
            raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
        path = default_store_paths(weights="fp32")["target"]
    else:
        path = build_tiny_store(work / "tiny", tokenizer_store=real_tokenizer_store())
    store = Store(path)
    t0 = measure_t0(store, max(1, store.num_layers // peers))
    print(f"[{models} latency {latency_ms:g} ms] t0 {t0 * 1000:.1f} ms; starting {peers} peers", file=sys.stderr, flush=True)
    with testnet(path, peers, latency_ms, work / f"ring-{models}-{latency_ms:g}") as state:
        row = {"models": models, "model_id": store.manifest.model_id, "hidden_size": int(store.manifest.hidden_size),
               "peers": peers, "latency_ms": latency_ms, "t0_s": round(t0, 5), "testnet_up_s": state.up_seconds}
        row.update(trio.run(time_ring, state, store, latency_ms, (1, 8), reps, 32))
    w8 = row["windows"]["8"]
    print(f"  up {row['testnet_up_s']:.1f} s; 8-token window RTT {w8['rtt_median_s'] * 1000:.0f} ms, "
          f"{w8['head_bytes_sent']} B out", file=sys.stderr, flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    import json

    import torch

    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real")
    p.add_argument("--latencies", default="0,50", help="one-way emulated latencies in ms")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--state", type=Path, default=Path(".dsd/bench"))
    args = p.parse_args(argv)
    models = model_kinds(p, args.models)
    latencies = comma_list(p, "--latencies", args.latencies, float)
    if args.peers < 1 or args.reps < 1 or any(latency < 0 for latency in latencies):
        p.error("--peers and --reps must be >= 1 and latencies >= 0")
    results = {**run_metadata("ring", args), "runs": []}
    for m in models:
        for latency in latencies:
            results["runs"].append(run(m, latency, args.peers, args.reps, args.state))
    write_json(RESULTS_DIR / f"ring-{today()}.json", results)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
