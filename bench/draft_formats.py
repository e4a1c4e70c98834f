"""The draft model's format: today's int8 draft (the float32 store, torch dynamic int8, `--draft-quant int8`) against
q4k (the draft GGUF's own blocks on the packed kernels the peers run, `dsd-node models prepare`'s draft store as it
is held) and int8-q4k (that q4k store's weights dequantized and quantized again by torch's dynamic int8:
`--draft-quant int8` on the q4k store).

For each of 10 fixed HumanEval prompts the target (the default q4k target, whole, in-process) first decodes its greedy
continuation. Each draft format then
- walks that continuation teacher-forced, one `propose(context, 1)` per token, as the head drafts in `dsd` mode: each
  call is one one-row step (embeddings, 24 layers, lm_head, argmax), and its token counts as accepted when it equals
  the target's;
- drafts a window greedily after the prompt: `propose(prompt, 1)` (the prefill) then `propose(…, --window)` (the
  window, a drafting run of that many one-row steps from a warm cache).
Formats are visited in turn, the order alternating per repetition, so a busy moment falls on both. The threads are
the demo head's (1, `run_demo`) unless `--threads` says otherwise; the CPU model and its flags are recorded
(the harness's machine header). Drafters
are built as the head builds them (`load_drafter`).

    python bench/draft_formats.py                  # the default pair: int8, q4k, int8-q4k (prepares what is missing)
    python bench/draft_formats.py --formats fp32,int8,q4k --threads 2
    python bench/draft_formats.py --target T --draft-float D32 --draft-q4k D4 --out OUT   # other stores (a check)
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

from draft_quant import PROBLEMS, log, prompt_ids, spread, target_continuations, walk
from harness import RESULTS_DIR, comma_list, run_metadata, today, write_json

FORMATS = {"int8": ("fp32", "int8"), "q4k": ("q4k", "none"), "int8-q4k": ("q4k", "int8"), "fp32": ("fp32", "none")}
"""Each format's draft store (the default pair's kind) and `--draft-quant`."""
def stores(args: argparse.Namespace) -> tuple[Path, dict[str, Path]]:
    """(the target store, each format's draft store): the ones given, else the default pair's, preparing what is
    missing with `models prepare`'s code (the q4k target, the q4k draft, the fp32 draft that int8 quantizes)."""
    from dsd.shard_store.default_models import DRAFT, TARGET, prepare_model

    given = {"fp32": args.draft_float, "q4k": args.draft_q4k}
    drafts = {}
    for f in args.formats:
        kind = FORMATS[f][0]
        drafts[f] = given[kind] or prepare_model(DRAFT, weights=kind).store
    return args.target or prepare_model(TARGET, weights="q4k").store, drafts


def load_draft(fmt: str, store: Path, target: Any) -> Any:
    """The drafter the head builds for `fmt` (`load_drafter` with the format's `--draft-quant`)."""
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import load_drafter

    return load_drafter(str(store), SamplingParams(), 0, vocab_size=int(target.manifest.vocab_size),
                        tokenizer=target.load_tokenizer(), quant=FORMATS[fmt][1])


def window_run(drafter: Any, prompt: list[int], window: int) -> tuple[float, float, list[int]]:
    """A greedy drafting run after `prompt` from a cold cache: (prefill seconds, window seconds, its tokens)."""
    drafter.reset()
    t = time.perf_counter()
    first, _ = drafter.propose(prompt, 1)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    rest, _ = drafter.propose(prompt + first, window)
    return prefill, time.perf_counter() - t, first + rest


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two formats' token lists agree."""
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return round(same / max(1, sum(len(r) for r in a)), 4)


def run(args: argparse.Namespace, target: Path, drafts: dict[str, Path]) -> dict[str, Any]:
    import torch

    from dsd.node.head.setup import eos_ids
    from dsd.shard_store import Store

    problems = args.problems
    tstore = Store(target)
    tokenizer = tstore.load_tokenizer()
    prompts = prompt_ids(tokenizer, problems)
    log(f"target {tstore.manifest.model_id} ({tstore.manifest.weights or tstore.manifest.dtype}): greedy "
        f"continuations of {len(prompts)} prompts")
    conts = target_continuations(target, prompts, args.tokens, eos_ids(tokenizer, tstore.manifest))
    formats = list(drafts)
    drafters = {f: load_draft(f, drafts[f], tstore) for f in formats}
    steps: dict[str, list[list[float]]] = {f: [[] for _ in prompts] for f in formats}
    prefill: dict[str, list[float]] = {f: [] for f in formats}
    windows: dict[str, list[float]] = {f: [] for f in formats}
    walked: dict[str, list[list[int]]] = {f: [[] for _ in prompts] for f in formats}
    drafted: dict[str, list[list[int]]] = {f: [[] for _ in prompts] for f in formats}
    with torch.inference_mode():
        for rep in range(args.reps):
            order = formats if rep % 2 == 0 else formats[::-1]
            for p, (ids, cont) in enumerate(zip(prompts, conts, strict=True)):
                for f in order:
                    _, st, toks = walk(drafters[f], ids, cont)
                    steps[f][p].extend(st)
                    walked[f][p] = toks
                    pre, win, toks = window_run(drafters[f], ids, args.window)
                    prefill[f].append(pre)
                    windows[f].append(win)
                    drafted[f][p] = toks
            log(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
                f"{f} {statistics.median(s for per in steps[f] for s in per) * 1000:.2f} ms/step" for f in formats))
    out: dict[str, Any] = {}
    for f in formats:
        hits = [sum(a == b for a, b in zip(d, c, strict=True)) for d, c in zip(walked[f], conts, strict=True)]
        out[f] = {
            "draft_store": Store(drafts[f]).summary()["weights"],
            "draft_quant": FORMATS[f][1],
            "step": spread([s for per in steps[f] for s in per]),
            "step_median_ms_per_prompt": [round(statistics.median(per) * 1000, 3) if per else None for per in steps[f]],
            "window": spread(windows[f]),
            "window_ms_per_token": round(statistics.median(windows[f]) * 1000 / args.window, 3),
            "prefill": spread(prefill[f]),
            "acceptance": round(sum(hits) / max(1, sum(len(c) for c in conts)), 4),
            "acceptance_per_prompt": [round(h / len(c), 4) if c else None for h, c in zip(hits, conts, strict=True)],
        }
    pairs = {f"{a}_vs_{b}": {"walked": agreement(walked[a], walked[b]), "window": agreement(drafted[a], drafted[b])}
             for i, a in enumerate(formats) for b in formats[i + 1:]}
    base = "int8" if "int8" in formats else formats[0]
    return {
        "models": "given" if args.target else "real",
        "target": f"{tstore.manifest.model_id} ({tstore.manifest.weights or tstore.manifest.dtype})",
        "draft": Store(drafts[formats[0]]).manifest.model_id,
        "threads": torch.get_num_threads(),
        "problems": problems,
        "prompt_tokens": [len(p) for p in prompts],
        "tokens_per_prompt": [len(c) for c in conts],
        "formats": out,
        "agreement": pairs,
        "step_speedup_vs_" + base: {f: round(out[base]["step"]["median_ms"] / out[f]["step"]["median_ms"], 3)
                                    for f in formats if out[f]["step"]["median_ms"] > 0},
        "window_speedup_vs_" + base: {f: round(out[base]["window"]["median_ms"] / out[f]["window"]["median_ms"], 3)
                                      for f in formats if out[f]["window"]["median_ms"] > 0},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=None, help="target store (default: the default q4k target)")
    p.add_argument("--draft-float", type=Path, default=None, help="float draft store of int8 and fp32 (default: the default fp32 draft)")
    p.add_argument("--draft-q4k", type=Path, default=None, help="q4k draft store of q4k and int8-q4k (default: the default q4k draft)")
    p.add_argument("--formats", default="int8,q4k,int8-q4k", help=f"draft formats, in visiting order (of {', '.join(FORMATS)}; default int8,q4k,int8-q4k)")
    p.add_argument("--problems", default=PROBLEMS, help=f"HumanEval problem indices (default {PROBLEMS})")
    p.add_argument("--tokens", type=int, default=32, help="target tokens per prompt, walked by each draft (default 32)")
    p.add_argument("--window", type=int, default=16, help="tokens of the greedy drafting run after each prompt (default 16)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every (prompt, format) timing (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: what the demo's head drafts with)")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/draft_formats-<date>.json)")
    args = p.parse_args(argv)
    args.formats = comma_list(p, "--formats", args.formats, str)
    args.problems = comma_list(p, "--problems", args.problems, int)
    if not args.formats or any(f not in FORMATS for f in args.formats) or len(set(args.formats)) != len(args.formats):
        p.error(f"--formats takes distinct formats of {', '.join(FORMATS)}")
    if args.tokens < 2 or args.reps < 1 or args.window < 1 or args.threads < 1:
        p.error("--tokens must be >= 2, --reps, --window and --threads >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, drafts = stores(args)
    gc.collect()
    results = {**run_metadata("draft_formats", args), **run(args, target, drafts)}
    out = args.out or RESULTS_DIR / f"draft_formats-{today()}.json"
    write_json(out, results)
    print(json.dumps(results, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
