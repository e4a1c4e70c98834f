"""What the head of the default target holds in memory: its ends as fp32 (a float route's head), bf16 (a quantized
route's head before issue 70) and int8 rows (a quantized route's head now), each loaded in a fresh process from the
prepared q4k target store; resident set after the load, its peak, and the bytes the head's tensors hold.

    python bench/head_memory.py --out bench/results/head-memory-YYYY-MM-DD.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness import run_metadata, write_json

VARIANTS = {"fp32": ("float32", "fp32"), "bf16": ("bfloat16", "bf16"), "int8": ("bfloat16", "q4k")}


def measure(store: str, dtype: str, weights: str) -> dict[str, float]:
    """Load the head in a child process and read its own /proc status: what the load costs, alone."""
    code = f"""
import json, torch
from dsd.shard_store import Store
from dsd.shard_store.quant import held_bytes
def status(key):
    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(key + ':')) / 1024
base = status('VmRSS')
head = Store({store!r}).load_head(dtype=getattr(torch, {dtype!r}), weights={weights!r})
print(json.dumps({{"rss_mb": round(status('VmRSS'), 1), "peak_rss_mb": round(status('VmHWM'), 1),
                  "before_load_mb": round(base, 1), "held_mb": round(held_bytes(head) / 2**20, 1),
                  "lm_head": type(head.lm_head).__name__}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from dsd.shard_store.default_models import default_store_paths

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    store = str(default_store_paths(weights="q4k")["target"])
    heads = {name: measure(store, dtype, weights) for name, (dtype, weights) in VARIANTS.items()}
    result = {"what": "the default target's head (embeddings tied with lm_head, final norm) in memory",
              "model": "Qwen2.5-Coder-1.5B-Instruct (q4k store)", "heads": heads,
              "int8_over_fp32_rss": round(heads["int8"]["rss_mb"] / heads["fp32"]["rss_mb"], 3),
              **run_metadata("head_memory", args)}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
