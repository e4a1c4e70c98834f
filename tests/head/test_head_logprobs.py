"""Logprobs of every emitted token are the target's own: the log-softmax of the whole model's logits at that
position (transformers, in-process), for accepted drafts, corrections and bonus tokens alike; in chains and trees,
greedy and sampled; and the `top` alternatives are the target's likeliest tokens in order."""

from __future__ import annotations

import pytest
import torch
import trio
from support.models import noisy_copy
from transformers import AutoModelForCausalLM

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.logprobs import emitted_rows
from dsd.node.head.sampling import SamplingParams
from dsd.shard_store import Store

PROMPT = [1, 17, 42, 99, 5, 17, 42]
N = 24
TOP = 3


def reference_logprobs(hf_dir, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the whole model's logits after each prefix of `tokens` (row i predicts tokens[i + 1])."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_rows_follow_the_accepted_path() -> None:
    assert emitted_rows([], 1) == [0]  # no draft kept: the correction, from the root's row
    assert emitted_rows([0, 1, 2], 4) == [0, 1, 2, 3]  # a chain fully accepted, then the bonus
    assert emitted_rows([2, 5], 3) == [0, 3, 6]  # a tree: node 2 then its child 5, then the correction
    assert emitted_rows([2, 5], 2) == [0, 3]  # cut by a stop or the token budget


@pytest.mark.parametrize("tree_nodes", [0, 12], ids=["chains", "trees"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_logprobs_are_the_targets_log_softmax(tiny_qwen2_root, tree_nodes: int, temperature: float) -> None:
    store = Store(tiny_qwen2_root / "store")
    params = SamplingParams(temperature=temperature)
    backend = LocalBackend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
    drafter = ModelDrafter(noisy_copy(store.load_full(), 0.1), params)  # accepts often, not always
    cfg = GenerationConfig(mode="dsd", max_new_tokens=N, params=params, tree_nodes=tree_nodes, logprobs=TOP, seed=3)
    result = trio.run(HeadEngine(backend, drafter, cfg).run, PROMPT)
    assert 0 < result.accepted < result.drafted  # accepted drafts and corrections both occur
    assert (result.tree_windows > 0) == bool(tree_nodes)
    assert [lp.token for lp in result.logprobs] == result.tokens
    ref = reference_logprobs(tiny_qwen2_root / "hf", PROMPT + result.tokens)
    for i, lp in enumerate(result.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-4), i
        values, ids = torch.topk(row, TOP)
        assert [t for t, _ in lp.top] == ids.tolist(), i
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    backend = LocalBackend(store.load_head(), [store.load_span(0, 5)])
    result = trio.run(HeadEngine(backend, None, GenerationConfig(mode="ar", max_new_tokens=4)).run, PROMPT)
    assert result.logprobs == [] and len(result.tokens) == 4
