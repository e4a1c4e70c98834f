"""Draft quantization: the draft model's per-token step time in float32 and int8 (torch dynamic
quantization, `dsd-node generate --draft-quant int8`), and how often each one's draft token equals
the target's greedy choice.

For every HumanEval prompt the target (in-process, whole model) first decodes its greedy
continuation (`--tokens` tokens, cut after an EOS). Each draft then walks that continuation teacher
forced, one `propose(context, 1)` per token, exactly as the head drafts in `dsd` mode: the time of
each call is one draft step, and its token counts as accepted when it equals the target's. The
variants are interleaved (order alternating per repetition) so a busy machine affects both alike.

    python bench/draft_quant.py            # the default pair in float32 (needs `dsd-node models prepare --weights fp32`)
    python bench/draft_quant.py --tiny     # a tiny random target drafting for itself: checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    byte_ids,
    real_tokenizer_store,
    run_metadata,
    today,
    write_json,
)

PROBLEMS = ",".join(str(i) for i in range(0, 160, 16))  # 0,16,...,144: spread over the 164 problems
VARIANTS = ("fp32", "int8")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (10th/90th percentile, min, max) of `values`, in milliseconds."""
    ms = sorted(v * 1000 for v in values)
    deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    return {"median_ms": round(statistics.median(ms), 3), "p10_ms": round(deciles[0], 3),
            "p90_ms": round(deciles[-1], 3), "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3), "n": len(ms)}


def stores(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(target store, draft store); None when the real pair is not prepared."""
    from dsd.shard_store.default_models import default_store_paths, prepared

    paths = default_store_paths(weights="fp32")
    if args.tiny:
        tok = real_tokenizer_store()
        target = build_tiny_store(args.work / "draft_quant-tiny", tokenizer_store=tok, layers=4, hidden=64)
        return target, target
    if not prepared(weights="fp32"):
        return None
    return paths["target"], paths["draft"]


def prompt_ids(tokenizer: Any, problems: Sequence[int]) -> list[list[int]]:
    from dsd.node.testnet.workload import humaneval_problems

    all_problems = humaneval_problems()
    out = []
    for i in problems:
        if not 0 <= i < len(all_problems):
            raise SystemExit(f"HumanEval has problems 0..{len(all_problems) - 1}, not {i}")
        text = all_problems[i]["prompt"]
        out.append(byte_ids(text) if tokenizer is None else list(tokenizer(text)["input_ids"]))
    return out


def target_continuations(target: Path, prompts: list[list[int]], tokens: int, eos: frozenset[int]) -> list[list[int]]:
    """The target's greedy continuation of every prompt (at most `tokens`, up to and including an EOS)."""
    from dsd.node.head.drafters import ModelDrafter
    from dsd.node.head.sampling import SamplingParams
    from dsd.shard_store import Store

    model = ModelDrafter(Store(target).load_full(), SamplingParams())
    out = []
    for ids in prompts:
        model.reset()
        cont, _ = model.propose(ids, tokens)
        cut = next((i + 1 for i, t in enumerate(cont) if t in eos), len(cont))
        out.append(cont[:cut])
    del model
    gc.collect()
    return out


def walk(drafter: Any, prompt: list[int], cont: list[int]) -> tuple[float, list[float], list[int]]:
    """Teacher-forced drafting along `cont`: (prefill seconds, per-step seconds, the drafted tokens)."""
    drafter.reset()
    t = time.perf_counter()
    first, _ = drafter.propose(prompt, 1)
    prefill = time.perf_counter() - t
    drafted, steps = [first[0]], []
    for i in range(1, len(cont)):
        t = time.perf_counter()
        tok, _ = drafter.propose(prompt + cont[:i], 1)
        steps.append(time.perf_counter() - t)
        drafted.append(tok[0])
    return prefill, steps, drafted


def run(args: argparse.Namespace, target: Path, draft: Path) -> dict[str, Any]:
    import torch

    from dsd.node.head.drafters import ModelDrafter, quantize_draft_model
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import eos_ids
    from dsd.shard_store import Store

    problems = [int(x) for x in args.problems.split(",") if x.strip()]
    tstore, dstore = Store(target), Store(draft)
    tokenizer = tstore.load_tokenizer()
    prompts = prompt_ids(tokenizer, problems)
    log(f"target {tstore.manifest.model_id}: greedy continuations of {len(prompts)} prompts")
    conts = target_continuations(target, prompts, args.tokens, eos_ids(tokenizer, tstore.manifest))
    drafters = {v: ModelDrafter(quantize_draft_model(dstore.load_full(), "int8" if v == "int8" else "none"),
                                SamplingParams()) for v in VARIANTS}
    steps: dict[str, list[list[float]]] = {v: [[] for _ in prompts] for v in VARIANTS}
    prefill: dict[str, list[float]] = {v: [] for v in VARIANTS}
    drafted: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for rep in range(args.reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for p, (ids, cont) in enumerate(zip(prompts, conts, strict=True)):
                for v in order:
                    pre, st, toks = walk(drafters[v], ids, cont)
                    prefill[v].append(pre)
                    steps[v][p].extend(st)
                    drafted.setdefault(v, [[] for _ in prompts])[p] = toks
            log(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
                f"{v} {statistics.median(s for per in steps[v] for s in per) * 1000:.2f} ms/token" for v in VARIANTS))
    variants: dict[str, Any] = {}
    for v in VARIANTS:
        hits = [sum(a == b for a, b in zip(d, c, strict=True)) for d, c in zip(drafted[v], conts, strict=True)]
        variants[v] = {
            "step": spread([s for per in steps[v] for s in per]),
            "step_median_ms_per_prompt": [round(statistics.median(per) * 1000, 3) if per else None for per in steps[v]],
            "prefill": spread(prefill[v]),
            "acceptance": round(sum(hits) / max(1, sum(len(c) for c in conts)), 4),
            "acceptance_per_prompt": [round(h / len(c), 4) if c else None for h, c in zip(hits, conts, strict=True)],
        }
    same = sum(a == b for d8, d32 in zip(drafted["int8"], drafted["fp32"], strict=True)
               for a, b in zip(d8, d32, strict=True))
    fp32_ms, int8_ms = variants["fp32"]["step"]["median_ms"], variants["int8"]["step"]["median_ms"]
    return {
        "models": "tiny" if args.tiny else "real",
        "target": tstore.manifest.model_id,
        "draft": dstore.manifest.model_id,
        "problems": problems,
        "tokens_per_prompt": [len(c) for c in conts],
        "variants": variants,
        "step_speedup_int8": round(fp32_ms / int8_ms, 3) if int8_ms > 0 else None,
        "int8_agrees_with_fp32": round(same / max(1, sum(len(c) for c in conts)), 4),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random target drafting for itself instead of the default pair")
    p.add_argument("--problems", default=PROBLEMS, help=f"HumanEval problem indices (default {PROBLEMS})")
    p.add_argument("--tokens", type=int, default=32, help="target tokens per prompt, walked by each draft (default 32)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every (prompt, variant) timing (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--work", type=Path, default=Path(".dsd/bench"), help="where the tiny store is built")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default bench/results/draft_quant[-tiny]-<date>.json)")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.reps < 1:
        p.error("--tokens must be >= 2 and --reps >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = stores(args)
    if pair is None:
        msg = "the default pair is not prepared in float32 (run `dsd-node models prepare --weights fp32`); skipped. Use --tiny to check the script."
        log(msg)
        print(json.dumps({"skipped": msg}))
        return 0
    results = {**run_metadata("draft_quant", args), **run(args, *pair)}
    out = args.out or RESULTS_DIR / f"draft_quant{'-tiny' if args.tiny else ''}-{today()}.json"
    write_json(out, results)
    print(json.dumps(results, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
