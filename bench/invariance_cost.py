"""What batch invariance costs a quantized span: step time of w rows with row attention (the default) and with the
family's batched kernel, on the layers one of four peers serves of the real target's shape (Qwen2.5-Coder-1.5B:
hidden 1536, 12 heads, 2 key/value heads, intermediate 8960), in q4k, after a prompt of each context length.

The weights are random (`shard_store/random_q4k.py`): a step's time does not depend on their values. The two ways
alternate within each repetition, so load on the machine falls on both. Prints JSON; `--out` writes it too.

    python bench/invariance_cost.py --out bench/results/invariance-cost-YYYY-MM-DD.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import run_metadata, write_json

from dsd.shard_store import Store
from dsd.shard_store.random_q4k import write_random_q4k_store

TARGET_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)


def step_ms(span, cache, prompt_len: int, rows: torch.Tensor) -> float:
    """One step of `rows` after the prompt's cache, in ms; the cache is cut back after it."""
    t0 = time.perf_counter()
    span.step(rows, prompt_len, cache)
    ms = (time.perf_counter() - t0) * 1e3
    cache.truncate(prompt_len)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=7, help="layers in the span (one of four peers of 28: 7)")
    ap.add_argument("--contexts", default="160,800", help="prompt lengths before the step")
    ap.add_argument("--widths", default="1,4,8,16", help="rows per step")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2", num_hidden_layers=args.layers, **TARGET_SHAPE)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_q4k_store(config, Path(tmp) / "store", model_id="qwen2.5-1.5b-shape-random")
        span = Store(Path(tmp) / "store").load_span(0, args.layers)
    gen = torch.Generator().manual_seed(0)
    results = []
    for ctx in map(int, args.contexts.split(",")):
        cache = span.new_cache()
        span.step(torch.randn(1, ctx, 1536, generator=gen), 0, cache)
        for w in map(int, args.widths.split(",")):
            rows = torch.randn(1, w, 1536, generator=gen)
            times: dict[str, list[float]] = {"rows_apart": [], "batched": []}
            for _ in range(args.reps + 2):
                for way in times:
                    span.batch_invariant = way == "rows_apart"
                    times[way].append(step_ms(span, cache, ctx, rows))
            cell = {"context": ctx, "rows": w}
            for way, ms in times.items():
                ms = ms[2:]  # warm-up
                q = statistics.quantiles(ms, n=4)
                cell[way] = {"median_ms": round(statistics.median(ms), 2), "iqr_ms": [round(q[0], 2), round(q[2], 2)]}
            cell["ratio"] = round(cell["rows_apart"]["median_ms"] / cell["batched"]["median_ms"], 3)
            results.append(cell)
            print(json.dumps(cell), flush=True)
    span.batch_invariant = True
    out = {**run_metadata("invariance_cost", args),
           "what": "q4k span step time, row attention (batch-invariant) against the batched kernel",
           "span_layers": args.layers, "shape": TARGET_SHAPE, "load_after": open("/proc/loadavg").read().split()[:3],
           "cells": results}
    print(json.dumps(out, indent=1))
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
