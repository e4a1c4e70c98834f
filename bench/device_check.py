"""GPU check: exactness and speed of the swarm on an accelerator. Prints JSON (also saved under results/).

Where CUDA (or `--device mps`) is available, in the compute dtype (default bfloat16):
1. exactness — the target split into `--peers` spans plus the head's ends against the whole model
   loaded by the same store on the same device: logits of a prompt (max |diff|, argmax agreement) and
   greedy decoding in-process (ar and dsd with the draft) against transformers' generate;
2. speed — a `--peers`-peer testnet on this one GPU, its links emulating t1 = `--ratio`·t0 (t0 = one
   peer's decode step measured on the GPU), one HumanEval prompt completed in ar and in dsd over the
   same route: tokens/s, speedup, identical text.

Models: the default pair when `dsd-node models prepare` has made it (its bfloat16 stores if present,
else float32, cast at load), else `--target`/`--draft`, else a tiny random target drafting for itself.
On a machine without such a device it prints `{"skipped": true, "reason": ...}` and exits 0.
Runs in a few minutes on one GPU (1.5B target, 64 new tokens per mode).

    python bench/device_check.py
    python bench/device_check.py --peers 4 --ratio 5 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    byte_ids,
    plan_once,
    run_generation,
    run_metadata,
    swarm,
    today,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or mps (default cuda)")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--target", type=Path, default=None, help="target store (default: the prepared default target)")
    p.add_argument("--draft", type=Path, default=None, help="draft store (default: the prepared default draft)")
    p.add_argument("--cache", type=Path, default=None, help="model cache of `dsd-node models prepare`")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--ratio", type=float, default=5.0, help="t1/t0 of the emulated links (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--exact-tokens", type=int, default=32, help="greedy tokens compared with transformers")
    p.add_argument("--problem", type=int, default=0, help="HumanEval problem index")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/device_check-DATE.json)")
    return p.parse_args()


def skipped(reason: str) -> int:
    print(json.dumps({"name": "device_check", "skipped": True, "reason": reason}))
    return 0


def pick_stores(args: argparse.Namespace, work: Path) -> tuple[Path, Path | None, str]:
    """(target, draft or None = the target drafts for itself, which models)."""
    from dsd.shard_store.default_models import default_store_paths, store_complete

    if args.target is not None:
        return args.target, args.draft, "given"
    for dtype in ("bfloat16", "float32"):
        paths = default_store_paths(args.cache, dtype)
        if all(store_complete(p) for p in paths.values()):
            return paths["target"], paths["draft"], f"default pair ({dtype} stores)"
    return build_tiny_store(work / "tiny"), None, "tiny random target (default pair not prepared)"


def prompt_ids(store: Any, problem: int) -> tuple[list[int], Any]:
    """A HumanEval prompt in the store's tokenizer, or its UTF-8 bytes for a tokenizer-less tiny model."""
    from dsd.node.testnet.workload import humaneval_prompt

    tokenizer = store.load_tokenizer()
    _, text = humaneval_prompt(problem)
    if tokenizer is None:
        return byte_ids(text), None
    return list(tokenizer(text)["input_ids"]), tokenizer


def exactness(target: Path, draft: Path | None, place: Any, prompt: list[int], peers: int, n: int) -> dict[str, Any]:
    """Spans + head against the whole model on the device: prompt logits and greedy tokens (ar, dsd)."""
    import torch
    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import ModelDrafter
    from dsd.node.head.generation import generate
    from dsd.node.head.local import LocalBackend
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.testnet.processes import even_spans
    from dsd.shard_store import Store

    store = Store(target)
    dev, dt = place.device, place.dtype
    whole = store.load_full(device=dev, dtype=dt)
    head = store.load_head(device=dev, dtype=dt)
    parts = even_spans(store.num_layers, min(peers, store.num_layers))
    spans = [store.load_span(a, b, device=dev, dtype=dt) for a, b in parts]
    ids = torch.tensor([prompt], device=dev)
    with torch.inference_mode():
        want = whole(input_ids=ids).logits[0].float()
        hidden = head.embed(ids)
        for span in spans:
            hidden = span(hidden, 0, span.new_cache())
        got = head.logits(hidden)[0].float()
        reference = whole.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference_tokens = reference[0, len(prompt):].tolist()
    out: dict[str, Any] = {
        "spans": parts,
        "prompt_tokens": len(prompt),
        "logits_bit_equal": bool(torch.equal(got, want)),
        "logits_max_abs_diff": float((got - want).abs().max()),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "greedy": {},
    }
    drafter_model = Store(draft).load_full(device=dev, dtype=dt) if draft else whole
    for mode in ("ar", "dsd"):
        backend = LocalBackend(head, spans)
        drafter = None if mode == "ar" else ModelDrafter(drafter_model, SamplingParams())
        cfg = GenerationConfig(mode=mode, max_new_tokens=n, tau_max=0.0)
        tokens = trio.run(functools.partial(generate, backend, drafter, cfg, prompt)).tokens
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens, strict=False)) if a != b), len(tokens))
        out["greedy"][mode] = {"tokens_equal_to_transformers": same, "of": n}
    return out


def speed(target: Path, draft: Path | None, place: Any, prompt: list[int], tokenizer: Any,
          args: argparse.Namespace, state: Path) -> dict[str, Any]:
    """A testnet of `--peers` peers on this device with emulated latency: ar vs dsd over one route."""
    import dataclasses

    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import load_head_setup
    from dsd.node.peer.generation import swarm_watch
    from dsd.node.peer.host import head_node
    from dsd.node.peer.shaper import LinkProfile
    from dsd.node.testnet.calibrate import measure_t0
    from dsd.node.testnet.swarm import SwarmSpec
    from dsd.node.testnet.workload import HUMANEVAL_STOPS
    from dsd.shard_store import Store

    store = Store(target)
    layers = max(1, store.num_layers // args.peers)
    t0 = measure_t0(store, layers, device=place.device, dtype=place.dtype)
    latency_ms = args.ratio * t0 * 1000
    link = LinkProfile.from_options(latency_ms)
    spec = SwarmSpec(state=state, store=target, peers=args.peers, timeout_s=300.0, link=link,
                     device=str(place.device), dtype=place.dtype_name)
    params = SamplingParams()
    setup, _ = load_head_setup(target, str(draft or target), params, 0, device=place.device, dtype=place.dtype)
    reports: dict[str, dict[str, Any]] = {}
    with swarm(spec) as testnet:

        async def main() -> None:
            async with head_node([testnet.bootstrap], link) as (node, legs):
                hops = await plan_once(node, store.manifest.model_id, store.num_layers)
                swarm = swarm_watch(node, setup)
                for mode in ("ar", "dsd"):
                    cfg = GenerationConfig(mode=mode, max_new_tokens=args.max_new_tokens, params=params,
                                           stop_strings=HUMANEVAL_STOPS if tokenizer is not None else ())
                    mode_setup = dataclasses.replace(setup, drafter=None) if mode == "ar" else setup
                    report = await run_generation(swarm, legs, mode_setup, prompt, cfg, hops, tokenizer)
                    reports[mode] = report.as_dict()

        trio.run(main)
    ar, dsd = reports["ar"], reports["dsd"]
    keys = ("new_tokens", "tokens_per_s", "rounds", "mean_accepted", "bytes_sent", "bytes_received")
    return {
        "t0_ms": round(t0 * 1000, 3),
        "latency_ms": round(latency_ms, 3),
        "peers": args.peers,
        "ar": {k: ar[k] for k in keys},
        "dsd": {k: dsd[k] for k in keys},
        "speedup": round(dsd["tokens_per_s"] / ar["tokens_per_s"], 3) if ar["tokens_per_s"] else None,
        "identical_tokens": ar["tokens"] == dsd["tokens"],
    }


def main() -> int:
    args = parse_args()
    import torch

    from dsd.shard_store import Store, StoreError
    from dsd.shard_store.devices import resolve_placement

    try:
        place = resolve_placement(args.device, args.dtype)
    except StoreError as exc:
        return skipped(f"{exc} (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    if place.device.type == "cpu":
        return skipped("the device resolved to the CPU; this check is for GPUs")
    started = time.perf_counter()
    result: dict[str, Any] = {**run_metadata("device_check", args), "device": str(place.device), "dtype": place.dtype_name}
    if place.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(place.device)
    with tempfile.TemporaryDirectory(prefix="dsd-device-check-") as tmp:
        work = Path(tmp)
        target, draft, which = pick_stores(args, work)
        result["models"] = which
        prompt, tokenizer = prompt_ids(Store(target), args.problem)
        print(f"exactness on {place} ({which}) ...", file=sys.stderr, flush=True)
        result["exactness"] = exactness(target, draft, place, prompt, args.peers, args.exact_tokens)
        if place.device.type == "cuda":
            torch.cuda.empty_cache()  # the exactness models are gone; the testnet's peers need the memory
        print(f"speed: {args.peers}-peer testnet on {place.device} ...", file=sys.stderr, flush=True)
        result["speed"] = speed(target, draft, place, prompt, tokenizer, args, work / "testnet")
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = args.out or RESULTS_DIR / f"device_check-{today()}.json"
    write_json(out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
