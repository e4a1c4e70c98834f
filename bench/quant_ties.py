"""Where `dsd` and `ar` part ways over a quantized route: the model's top two logits at that position.

Reads a `dsd_sweep.py` result of a quantized route (e.g. `bench/quant.py`'s pinned cell with int4 spans) and, for
every prompt whose `dsd` tokens differ from its `ar` tokens, takes the first position where they differ and runs
the same quantized model whole in one process (the head in bf16, every layer in the route's format) over the prompt
and `ar`'s tokens before it, twice: as `ar` computes it (the prompt in one pass, then one row per token) and as a
window does (everything in one pass). Reported per divergence: the two likeliest tokens and their logits in each
computation, and the tokens `ar` and `dsd` took. Equal top logits there mean the model itself cannot tell the two
tokens apart at bf16's precision, and the rounding of a one-row step and of a window's step picks differently.

    python bench/quant_ties.py bench/results/quant-2026-12-06-cell-int4.json --weights int4
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, run_metadata, shown_path, write_json


def top2(logits: Any) -> dict[str, Any]:
    import torch

    top = torch.topk(logits.float(), 2)
    return {"tokens": top.indices.tolist(), "logits": [round(v, 5) for v in top.values.tolist()]}


def divergences(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per prompt whose dsd tokens differ from ar's: the task, the first differing position and both tokens."""
    out = []
    for cell in result["settings_runs"]:
        by: dict[str, dict[str, Any]] = {}
        for run in cell["runs"]:
            by.setdefault(f"{run['task_id']}#{run['rep']}", {})[run["mode"]] = run
        for _, modes in sorted(by.items()):
            if "ar" not in modes or "dsd" not in modes:
                continue
            ar, dsd = modes["ar"]["tokens"], modes["dsd"]["tokens"]
            if ar == dsd:
                continue
            at = next((i for i, (a, b) in enumerate(zip(ar, dsd, strict=False)) if a != b), min(len(ar), len(dsd)))
            out.append({"task_id": modes["ar"]["task_id"], "rep": modes["ar"]["rep"], "position": at,
                        "ar_tokens": ar, "ar_token": ar[at] if at < len(ar) else None,
                        "dsd_token": dsd[at] if at < len(dsd) else None})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from dsd.node.testnet.workload import humaneval_problems
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path, help="a dsd_sweep.py result file of a quantized route (real pair)")
    p.add_argument("--weights", default="int4", help="the route's weight format (default int4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="result file (default results/<sweep>-ties.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    found = divergences(json.loads(args.sweep.read_text()))
    store = Store(default_store_paths(weights="fp32")["target"])
    tokenizer = store.load_tokenizer()
    head = store.load_head(dtype=torch.bfloat16)
    span = store.load_span(0, store.num_layers, weights=args.weights)
    prompts = {p["task_id"]: p["prompt"] for p in humaneval_problems()}
    rows = []
    with torch.inference_mode():
        for d in found:
            prompt = list(tokenizer(prompts[d["task_id"]])["input_ids"])
            before = d.pop("ar_tokens")[: d["position"]]
            cache = span.new_cache()
            hidden = span(head.embed(torch.tensor([prompt])), 0, cache)
            for i, token in enumerate(before):
                hidden = span(head.embed(torch.tensor([[token]])), len(prompt) + i, cache)
            one_row = head.logits(hidden)[0, -1]
            ctx = prompt + before
            window = head.logits(span(head.embed(torch.tensor([ctx])), 0, span.new_cache()))[0, -1]
            rows.append({**d, "one_row_steps": top2(one_row), "one_pass": top2(window)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = args.out or RESULTS_DIR / f"{args.sweep.stem}-ties.json"
    result = {**run_metadata("quant_ties", args), "sweep": shown_path(args.sweep), "weights": args.weights,
              "divergences": rows}
    write_json(out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
