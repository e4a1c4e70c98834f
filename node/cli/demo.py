"""`dsd-node demo`: the main job end to end on one machine (prepare the pair, WAN testnet, ar vs dsd)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .models import prepare_with_progress
from .options import WEIGHT_FORMATS, add_device_options, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prepare the default models, run a local WAN testnet, compare ar and dsd")
    p.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/dsd/models or $DSD_CACHE)")
    p.add_argument("--target", type=Path, default=None, help="target store (default: the prepared 1.5B in --weights)")
    p.add_argument("--draft", default=None, help="draft store or ngram (default: the prepared 0.5B in --weights)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="the format the peers serve, t0 is measured in and the head computes beside (bf16 for a "
                        "quantized one), and of the default pair's stores (prepared if missing; stores of other "
                        "formats are kept): default q4k on the CPU (the GGUFs' own 4-bit blocks, 0.17x fp32's "
                        "bytes), the --dtype's float format elsewhere (the packed kernels are CPU-only); with "
                        "--target, that store's own (auto); fp32: the float32 stores, bit-exact against "
                        "transformers' float32 model")
    p.add_argument("--peers", type=int, default=4, help="block peers (default 4)")
    p.add_argument("--ratio", type=float, default=5.0, help="t1/t0: one-way link latency in units of one peer's step (default 5)")
    p.add_argument("--problem", type=int, default=0, help="HumanEval problem index (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens; HumanEval's stop strings end it earlier")
    p.add_argument("--state", type=Path, default=Path(".dsd/demo"), help="testnet state directory (default .dsd/demo)")
    p.add_argument("--modes", default="ar,dsd", help="comma-separated modes to compare (default ar,dsd)")
    p.add_argument("--draft-quant", choices=("none", "int8"), default=None, help="the draft's quantization (default: int8 on the CPU, none on a GPU, where int8 does not run): int8 = torch dynamic int8 of the draft store's weights (a q4k store's dequantized first), its one-row step 1.8x faster than the q4k draft on the packed kernels and 4.4x faster than fp32, same acceptance (bench/draft_formats.py); none = the store as it is (q4k: the packed kernels)")
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

    started = time.perf_counter()
    prepare_s = None
    try:
        place = resolve_placement(args.device, args.dtype)
        weights = args.weights or ("auto" if args.target or place.device.type != "cpu" else "q4k")
        resolve_placement(args.device, args.dtype, weights)  # a format this device cannot run: one line, no load
    except (StoreError, ValueError) as exc:
        return fail(str(exc))
    if args.target is None:
        kind = place.dtype_name if weights == "auto" else weights  # auto: the store in the compute dtype, no cast
        say(f"== the default model pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft), stored as {kind}")
        rc = prepare_with_progress(args.cache, kind)
        if rc:
            return rc
        prepare_s = time.perf_counter() - started
        paths = default_store_paths(args.cache, kind)
        target, draft = paths["target"], args.draft or str(paths["draft"])
    else:
        target, draft = args.target, args.draft or "ngram"
    try:
        quant = args.draft_quant or ("int8" if place.device.type == "cpu" and draft != "ngram" else "none")
        check_quant_device(quant, place.device)
    except ValueError as exc:
        return fail(str(exc))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    spec = DemoSpec(target=target, draft=draft, state=args.state, peers=args.peers, ratio=args.ratio,
                    problem=args.problem, max_new_tokens=args.max_new_tokens, modes=modes, draft_quant=quant,
                    device=args.device, dtype=args.dtype, weights=weights)
    result = run_demo(spec, say)
    out = args.results or Path("bench/results") / f"demo-{time.strftime('%Y-%m-%d')}.json"
    result.save(out, spec, prepare_s=prepare_s, command_s=time.perf_counter() - started)
    say(f"result written to {out}")
    base = result.reports.get("ar")
    say(f"== result ({result.weights} weights, draft {result.draft_weights})")
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
