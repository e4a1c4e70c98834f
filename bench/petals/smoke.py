"""Smoke check of the Petals venv: a Petals swarm on loopback serves a Llama and its client's greedy tokens equal
transformers' on the same checkpoint.

Run with the Petals venv's python (bench/petals/setup.py builds it); it re-runs itself in a network namespace that
has only loopback (root, or unprivileged user namespaces). Without --model it serves a tiny random Llama:

    ~/.cache/dsd/petals-venv/bin/python bench/petals/smoke.py
    ~/.cache/dsd/petals-venv/bin/python bench/petals/smoke.py --model DIR --tokens 4   # a Llama folder

Prints one JSON line; exit code 0 when the tokens are equal.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from swarm import PetalsSwarm, bring_up_loopback, isolated_argv, run_isolated, split_blocks

PROMPT = [1, 17, 42, 99, 7, 250, 3]  # ids valid in the tiny vocabulary (and any real one)


def tiny_llama(folder: Path, layers: int = 4, seed: int = 0) -> Path:
    """A tiny random Llama (GQA, init range 0.2 so greedy tokens vary) saved as safetensors in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.2,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens of transformers' LlamaForCausalLM after `prompt` (no EOS stop): the reference."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32, low_cpu_mem_usage=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def step_times(model: Any, steps: int) -> list[float]:
    """Seconds of each of `steps` one-token steps in one inference session after a PROMPT prefill (the per-token
    cost of Petals' route: link crossings plus compute)."""
    import torch

    times = []
    with torch.no_grad(), model.inference_session(max_length=len(PROMPT) + steps + 1) as session:
        model.generate(torch.tensor([PROMPT]), max_new_tokens=1, session=session, do_sample=False)
        for _ in range(steps):
            t0 = time.perf_counter()
            model.generate(None, max_new_tokens=1, session=session, do_sample=False)
            times.append(time.perf_counter() - t0)
    return times


def smoke(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The reference tokens, then the swarm's: both greedy after PROMPT; timings in seconds."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(args.threads)
    model_dir = args.model or tiny_llama(work / "tiny-llama")
    layers = AutoConfig.from_pretrained(str(model_dir)).num_hidden_layers
    t0 = time.monotonic()
    reference = hf_greedy(model_dir, PROMPT, args.tokens)
    t1 = time.monotonic()
    spans = split_blocks(layers, args.servers)
    with PetalsSwarm(model_dir, spans, work / "logs", threads=args.threads, delay_ms=args.delay_ms,
                     push_fix=args.push_fix) as swarm:
        t2 = time.monotonic()
        model = swarm.client()
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=args.tokens, do_sample=False)
        petals = out[0, len(PROMPT):].tolist()
        t3 = time.monotonic()
        steps = sorted(step_times(model, args.steps)) if args.steps else []
    return {"ok": petals == reference, "model": "tiny-random-llama" if args.model is None else args.model.name,
            "spans": spans, "delay_ms": args.delay_ms, "push_fix": args.push_fix, "tokens_transformers": reference, "tokens_petals": petals,
            "equal": f"{sum(a == b for a, b in zip(petals, reference, strict=False))}/{len(reference)}",
            "seconds": {"reference": round(t1 - t0, 1), "swarm_up": round(t2 - t1, 1),
                        "petals_generate": round(t3 - t2, 1)},
            "step_ms": {"n": len(steps), "median": round(steps[len(steps) // 2] * 1000, 1),
                        "min": round(steps[0] * 1000, 1), "max": round(steps[-1] * 1000, 1)} if steps else None}


def main(argv: list[str] | None = None) -> int:
    """Re-run inside an isolated namespace, or (inside) run the check and print its JSON."""
    inside, argv = isolated_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a Llama folder (default: a tiny random Llama)")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens to compare")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--steps", type=int, default=0, help="then time this many one-token steps in one session")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way latency on every client-server link (a delay proxy per server)")
    p.add_argument("--push-fix", action="store_true",
                   help="servers push to the next server as on Petals' main branch (bench/petals/push_fix.py)")
    args = p.parse_args(argv)
    if args.model is not None:
        args.model = args.model.expanduser().absolute()
    if not inside:
        return run_isolated(__file__, argv)
    bring_up_loopback()
    with tempfile.TemporaryDirectory(prefix="dsd-petals-smoke-") as tmp:
        try:
            result = smoke(args, Path(tmp))
        except Exception as exc:  # a server that died or never came up: say so in the JSON line
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
