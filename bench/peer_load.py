"""One block peer under load (issue 54): H sessions at once, each sending its next window as soon as the last came
back, with batching on and off, in the same run.

What runs is the peer's own compute path: a span of the real target (`--layers`, default 7 of the 1.5B's 28, layers
0:7) loaded as `dsd-node start` loads it, and the block server's `Batcher` (the one class that schedules a peer's
steps) driven by H trio tasks, one per session, each with its own KV cache, first filled with one of the 10 fixed
HumanEval prompts (as the head embeds them), then `--windows` windows of w rows each. No network: the links add the
same latency to both arms and hide nothing the span does. Arms alternate per (H, w) cell and repetition.

Per cell: tokens/s (all sessions' window rows / wall time) and each window's latency (queued to rows back), p50 and
p95, batched and unbatched; the ratio batched / unbatched per repetition, its median and range.

    python bench/peer_load.py --results bench/results/peer_load-DATE.json     # ~20 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    comma_list,
    command_line,
    percentile,
    run_metadata,
    today,
    write_json,
)

PROBLEMS = (0, 16, 32, 49, 65, 82, 98, 114, 131, 147)  # the fixed 10 of the other benchmarks


def drive(span: Any, batcher: Any, contexts: list[Any], w: int, windows: int, seed: int) -> dict[str, Any]:
    """H sessions (one per context) at once through `batcher`: each prefilled with its context, then `windows`
    windows of `w` random rows, each sent when the last returned. Tokens/s over the windows, latencies."""
    import numpy as np
    import torch
    import trio

    from dsd.node.server.batching import Job
    from dsd.shard_store import SpanWindow

    rng = np.random.default_rng(seed)
    caches = [span.new_cache() for _ in contexts]
    with torch.inference_mode():
        for ctx, cache in zip(contexts, caches, strict=True):
            span.step(ctx, 0, cache)
    rows = [torch.from_numpy(rng.standard_normal((1, w, span.hidden_size)).astype(np.float32) * 0.5)
            for _ in range(windows)]
    latencies: list[float] = []

    async def session(cache: Any) -> None:
        for x in rows:
            t0 = time.perf_counter()
            await batcher.run(Job(span, SpanWindow(x, cache.length, cache, cache.length)))
            latencies.append(time.perf_counter() - t0)

    async def main() -> float:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for cache in caches:
                nursery.start_soon(session, cache)
        return time.perf_counter() - t0

    wall = trio.run(main)
    tokens = len(contexts) * windows * w
    return {"tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 3),
            "latency_p50_s": round(percentile(latencies, 0.5) or 0.0, 4),
            "latency_p95_s": round(percentile(latencies, 0.95) or 0.0, 4), "steps": batcher.steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="1,2,4,8,16", help="H values (default 1,2,4,8,16)")
    p.add_argument("--rows", default="1,8", help="window sizes w (default 1,8)")
    p.add_argument("--layers", type=int, default=7, help="layers 0:N of the real target (default 7)")
    p.add_argument("--windows", type=int, default=12, help="windows per session per cell (default 12)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch-tokens", type=int, default=None, help="the batched arm's row budget (default: the "
                   "peer's default)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR / f"peer_load-{today()}.json")
    args = p.parse_args(argv)
    hs = comma_list(p, "--sessions", args.sessions, int)
    ws = comma_list(p, "--rows", args.rows, int)

    import torch

    from dsd.node.server.batching import Batcher
    from dsd.node.server.limits import BatchOptions
    from dsd.node.testnet.workload import humaneval_problems
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    if not prepared(weights="fp32"):
        p.error("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
    torch.set_num_threads(args.threads)
    store = Store(default_store_paths(weights="fp32")["target"])
    span = store.load_span(0, args.layers)
    head = store.load_head()
    tok = store.load_tokenizer()
    problems = humaneval_problems()
    with torch.inference_mode():
        contexts = [head.embed(torch.tensor([tok(problems[i]["prompt"])["input_ids"]])) for i in PROBLEMS]
    on = BatchOptions() if args.max_batch_tokens is None else BatchOptions(max_tokens=args.max_batch_tokens)
    result: dict[str, Any] = {**run_metadata("peer_load", args), "command": command_line("peer_load.py", sys.argv[1:]
                              if argv is None else argv), "model_id": store.manifest.model_id,
                              "span": [0, args.layers], "batch_options": asdict(on),
                              "load_before": os.getloadavg(), "runs": [], "cells": []}
    started = time.monotonic()
    for rep in range(args.reps):
        for h in hs:
            for w in ws:
                ctx = [contexts[i % len(contexts)] for i in range(h)]
                arms = ("batched", "unbatched") if rep % 2 == 0 else ("unbatched", "batched")
                for arm in arms:
                    batcher = Batcher(on if arm == "batched" else BatchOptions(enabled=False))
                    run = drive(span, batcher, ctx, w, args.windows, seed=rep)
                    run.update(rep=rep, H=h, w=w, arm=arm)
                    result["runs"].append(run)
                    print(f"rep {rep} H {h} w {w} {arm}: {run['tokens_per_s']} tok/s, p50 {run['latency_p50_s']} s, "
                          f"p95 {run['latency_p95_s']} s, {run['steps']} steps", flush=True)
                    write_json(args.results, result)
    for h in hs:
        for w in ws:
            mine = [r for r in result["runs"] if r["H"] == h and r["w"] == w]
            by = {arm: [r for r in mine if r["arm"] == arm] for arm in ("batched", "unbatched")}
            ratios = [b["tokens_per_s"] / u["tokens_per_s"] for b, u in zip(by["batched"], by["unbatched"], strict=True)]
            result["cells"].append({
                "H": h, "w": w,
                "batched_tokens_per_s": statistics.median(r["tokens_per_s"] for r in by["batched"]),
                "unbatched_tokens_per_s": statistics.median(r["tokens_per_s"] for r in by["unbatched"]),
                "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
                "batched_latency_p50_s": statistics.median(r["latency_p50_s"] for r in by["batched"]),
                "unbatched_latency_p50_s": statistics.median(r["latency_p50_s"] for r in by["unbatched"]),
                "batched_latency_p95_s": statistics.median(r["latency_p95_s"] for r in by["batched"]),
                "unbatched_latency_p95_s": statistics.median(r["latency_p95_s"] for r in by["unbatched"]),
            })
    result["seconds"] = round(time.monotonic() - started, 1)
    result["load_after"] = os.getloadavg()
    write_json(args.results, result)
    for c in result["cells"]:
        print(f"H {c['H']:>2} w {c['w']}: batched {c['batched_tokens_per_s']:.1f} tok/s vs {c['unbatched_tokens_per_s']:.1f}"
              f" = {c['ratio_median']}x [{c['ratio_min']}, {c['ratio_max']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
