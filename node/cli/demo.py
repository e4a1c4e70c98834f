"""`dsd-node demo`: the main job end to end on one machine (prepare the pair, WAN testnet, ar vs dsd)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .models import prepare_with_progress
from .options import add_device_options, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prepare the default models, run a local WAN testnet, compare ar and dsd")
    p.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/dsd/models or $DSD_CACHE)")
    p.add_argument("--target", type=Path, default=None, help="target store (default: the prepared 1.5B)")
    p.add_argument("--draft", default=None, help="draft store or ngram (default: the prepared 0.5B)")
    p.add_argument("--peers", type=int, default=4, help="block peers (default 4)")
    p.add_argument("--ratio", type=float, default=5.0, help="t1/t0: one-way link latency in units of one peer's step (default 5)")
    p.add_argument("--problem", type=int, default=0, help="HumanEval problem index (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens; HumanEval's stop strings end it earlier")
    p.add_argument("--state", type=Path, default=Path(".dsd/demo"), help="testnet state directory (default .dsd/demo)")
    p.add_argument("--modes", default="ar,dsd", help="comma-separated modes to compare (default ar,dsd)")
    p.add_argument("--draft-quant", choices=("none", "int8"), default=None, help="the draft's quantization (default: int8 on the CPU, 4.9x faster steps, same acceptance in bench/draft_quant.py; none on a GPU, where int8 does not run)")
    p.add_argument("--results", type=Path, default=None, help="where to write the result JSON (default bench/results/demo-DATE.json)")
    p.add_argument("--json", action="store_true", help="also print the reports as one JSON object")
    add_device_options(p)
    p.set_defaults(func=cmd_demo)


def say(msg: str) -> None:
    print(msg, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from dsd.node.head.drafters import check_quant_device
    from dsd.node.testnet.demo import DemoSpec, run_demo
    from dsd.shard_store import StoreError
    from dsd.shard_store.default_models import default_store_paths
    from dsd.shard_store.devices import resolve_placement

    try:
        place = resolve_placement(args.device, args.dtype)
        quant = args.draft_quant or ("int8" if place.device.type == "cpu" else "none")
        check_quant_device(quant, place.device)
    except (StoreError, ValueError) as exc:
        return fail(str(exc))
    if args.target is None:
        say(f"== the default model pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft), stored in {place.dtype_name}")
        rc = prepare_with_progress(args.cache, place.dtype_name)  # the store in the compute dtype: no cast at load
        if rc:
            return rc
        paths = default_store_paths(args.cache, place.dtype_name)
        target, draft = paths["target"], args.draft or str(paths["draft"])
    else:
        target, draft = args.target, args.draft or "ngram"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    spec = DemoSpec(target=target, draft=draft, state=args.state, peers=args.peers, ratio=args.ratio,
                    problem=args.problem, max_new_tokens=args.max_new_tokens, modes=modes, draft_quant=quant,
                    device=args.device, dtype=args.dtype)
    result = run_demo(spec, say)
    out = args.results or Path("bench/results") / f"demo-{time.strftime('%Y-%m-%d')}.json"
    result.save(out, spec)
    say(f"result written to {out}")
    base = result.reports.get("ar")
    say("== result")
    for mode, r in result.reports.items():
        speed = f"  speedup vs ar {r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and mode != "ar" else ""
        same = ""
        if base and mode != "ar":
            same = "  identical text" if r["tokens"] == base["tokens"] else "  TEXT DIFFERS"
        say(f"{mode:13s} {r['tokens_per_s']:.2f} tok/s{speed}{same}")
    if args.json:
        say(json.dumps(result.as_dict()))
    if not result.identical():
        print("dsd-node demo: greedy outputs differ between modes: this is a bug", file=sys.stderr)
        return 1
    return 0
