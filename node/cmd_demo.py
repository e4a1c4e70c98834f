"""`dsd-node demo`: the main job end to end on one machine.

Prepare the default pair, measure t0, start a local testnet whose emulated WAN
sits in the DSD paper's regime (t1 = ratio·t0), complete a HumanEval prompt with
`ar` and with `dsd` over the same route, print both texts and the speedup, and
stop the testnet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prepare the default models, run a local WAN testnet, compare ar and dsd")
    p.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/dsd/models or $DSD_CACHE)")
    p.add_argument("--target", type=Path, default=None, help="target store (default: the prepared 1.5B)")
    p.add_argument("--draft", default=None, help="draft store or ngram (default: the prepared 0.5B)")
    p.add_argument("--peers", type=int, default=4, help="block peers (default 4)")
    p.add_argument("--ratio", type=float, default=5.0, help="t1/t0: one-way link latency in units of one peer's step (default 5)")
    p.add_argument("--problem", type=int, default=2, help="HumanEval problem index (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--state", type=Path, default=Path(".dsd/demo"), help="testnet state directory (default .dsd/demo)")
    p.add_argument("--modes", default="ar,dsd", help="comma-separated modes to compare (default ar,dsd)")
    p.add_argument("--json", action="store_true", help="also print the reports as one JSON object")
    p.set_defaults(func=cmd_demo)


def say(msg: str) -> None:
    print(msg, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    import torch
    import trio

    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths

    from .calibrate import measure_t0
    from .cmd_generate import eos_ids, load_head_setup
    from .cmd_models import cmd_prepare
    from .cmd_testnet import bring_up
    from .generate import generate_once
    from .head import GenerationConfig
    from .headnode import head_node
    from .sampling import SamplingParams
    from .shaper import LinkProfile
    from .testnet import stop_processes
    from .workload import humaneval_prompt

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.target is None:
        say("== 1. the default model pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft)")
        rc = cmd_prepare(argparse.Namespace(cache=args.cache, dtype="float32", keep_gguf=False))
        if rc:
            return rc
        paths = default_store_paths(args.cache)
        target, draft = paths["target"], args.draft or str(paths["draft"])
    else:
        target, draft = args.target, args.draft or "ngram"
    store = Store(target)
    layers = store.num_layers
    say(f"== 2. measuring t0 (one peer's decode step over {layers // args.peers} of {layers} layers, 1 thread)")
    t0 = measure_t0(store, max(1, layers // args.peers))
    latency_ms = args.ratio * t0 * 1000
    say(f"t0 = {t0 * 1000:.1f} ms -> emulated one-way latency t1 = {args.ratio:g}·t0 = {latency_ms:.0f} ms per link")

    say(f"== 3. starting a testnet: bootstrap + {args.peers} block peers on loopback, WAN {latency_ms:.0f} ms")
    up_args = argparse.Namespace(
        store=target, peers=args.peers, replicas=1, state=args.state, threads=1, codec="raw", record_ttl=30.0,
        timeout=300.0, wan_latency_ms=latency_ms, wan_jitter_ms=0.0, wan_mbit=None,
    )
    state = bring_up(up_args)
    say(f"testnet up in {state.up_seconds:.1f} s (logs in {args.state / 'logs'})")
    try:
        torch.set_num_threads(1)
        params = SamplingParams()
        setup, tokenizer = load_head_setup(target, draft, params, seed=0)
        task_id, prompt_text = humaneval_prompt(args.problem)
        prompt = list(tokenizer(prompt_text)["input_ids"])
        eos = eos_ids(tokenizer, store.manifest.config)
        say(f"== 4. completing {task_id} ({len(prompt)} prompt tokens, {args.max_new_tokens} new, greedy)")
        say(prompt_text.rstrip())
        reports: dict[str, dict] = {}

        async def main() -> None:
            async with head_node([state.bootstrap], LinkProfile.from_options(latency_ms)) as (node, legs):
                for mode in modes:
                    cfg = GenerationConfig(mode=mode, max_new_tokens=args.max_new_tokens, params=params, eos_ids=eos)
                    mode_setup = replace(setup, drafter=None) if mode == "ar" else setup
                    say(f"-- {mode} ...")
                    t = time.perf_counter()
                    report = await generate_once(node, legs, mode_setup, prompt, cfg)
                    report["text"] = tokenizer.decode(report["tokens"], skip_special_tokens=True)
                    report["wall_s"] = round(time.perf_counter() - t, 3)
                    reports[mode] = report
                    say(report["text"].rstrip())
                    say(f"   [{mode}] {report['new_tokens']} tokens in {report['elapsed_s']:.1f} s = "
                        f"{report['tokens_per_s']:.2f} tok/s, {report['rounds']} round trips, "
                        f"mean accepted {report['mean_accepted']:.2f}")

        trio.run(main)
    finally:
        say("== 5. stopping the testnet")
        stop_processes([p.pid for p in reversed(state.peers)])

    base = reports.get("ar")
    say("== result")
    for mode, r in reports.items():
        speed = f"  speedup vs ar {r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and mode != "ar" else ""
        same = ""
        if base and mode != "ar":
            same = "  identical text" if r["tokens"] == base["tokens"] else "  TEXT DIFFERS"
        say(f"{mode:13s} {r['tokens_per_s']:.2f} tok/s{speed}{same}")
    if args.json:
        say(json.dumps({"t0_s": t0, "latency_ms": latency_ms, "peers": args.peers, "reports": reports}))
    identical = all(r["tokens"] == base["tokens"] for r in reports.values()) if base else True
    if not identical:
        print("dsd-node demo: greedy outputs differ between modes: this is a bug", file=sys.stderr)
        return 1
    return 0
