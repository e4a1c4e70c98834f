"""The head engine's decoding loop against the whole model in-process: every greedy mode must
reproduce HF generate(do_sample=False) token for token, whatever the drafter proposes."""

from __future__ import annotations

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from conftest import make_tiny_model
from dsd.node.head.drafters import ModelDrafter, NgramDrafter
from dsd.node.head.engine import GenerationConfig, HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams
from dsd.shard_store import Store

PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 3, 3, 8, 9, 10, 11, 12], [7]]


def _reference(hf_dir, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt):].tolist()


def _drafter(kind: str, store: Store):
    greedy = SamplingParams()
    if kind == "self":
        return ModelDrafter(store.load_full(), greedy)
    if kind == "random":
        return ModelDrafter(make_tiny_model("qwen2", seed=1234, layers=2), greedy)
    return NgramDrafter()


@pytest.mark.parametrize("mode", ["ar", "sd", "dsd", "dsd-adaptive"])
@pytest.mark.parametrize("drafter_kind", ["self", "random", "ngram"])
def test_greedy_modes_equal_hf_generate(tiny_qwen2_root, mode: str, drafter_kind: str) -> None:
    store = Store(tiny_qwen2_root / "store")
    n = 24
    for prompt in PROMPTS:
        expected = _reference(tiny_qwen2_root / "hf", prompt, n)
        backend = LocalBackend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
        drafter = None if mode == "ar" else _drafter(drafter_kind, store)
        cfg = GenerationConfig(mode=mode, max_new_tokens=n, tau_max=0.0)
        result = trio.run(HeadEngine(backend, drafter, cfg).generate, prompt)
        assert result.tokens == expected, (mode, drafter_kind, prompt)
        # The target's KV holds every committed token but the last, and no rejected or surplus draft.
        assert backend.length == len(prompt) + n - 1, (mode, drafter_kind, prompt, backend.length)
        if mode != "ar" and drafter_kind == "self":
            assert result.acceptance_rate == 1.0
            assert result.rounds < n
        if mode == "ar":
            assert result.rounds == n


def test_random_draft_is_mostly_rejected_but_exact(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[0]
    backend = LocalBackend(store.load_head(), [store.load_span(0, 5)])
    cfg = GenerationConfig(mode="dsd", max_new_tokens=20, gamma=4)
    result = trio.run(HeadEngine(backend, _drafter("random", store), cfg).generate, prompt)
    assert result.tokens == _reference(tiny_qwen2_root / "hf", prompt, 20)
    assert result.acceptance_rate < 0.5


def test_eos_ends_generation_where_the_target_would(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[1]
    free = _reference(tiny_qwen2_root / "hf", prompt, 16)
    eos = free[5]
    expected = free[: free.index(eos) + 1]
    backend = LocalBackend(store.load_head(), [store.load_span(0, 5)])
    cfg = GenerationConfig(mode="dsd", max_new_tokens=16, eos_ids=frozenset({eos}), gamma=6)
    result = trio.run(HeadEngine(backend, _drafter("self", store), cfg).generate, prompt)
    assert result.tokens == expected
