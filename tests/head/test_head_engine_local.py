"""The head engine's decoding loop against the whole model in-process: every greedy mode must
reproduce HF generate(do_sample=False) token for token, whatever the drafter proposes, with
chain windows and with token-tree windows (the local spans run trees and keep accepted paths)."""

from __future__ import annotations

import pytest
import torch
import trio
from support.models import hf_greedy, make_tiny_model, noisy_copy
from transformers import AutoModelForCausalLM

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter, NgramDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.window import WindowController
from dsd.shard_store import Store

PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 3, 3, 8, 9, 10, 11, 12], [7]]


def _reference(hf_dir, prompt: list[int], n: int) -> list[int]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval(), prompt, n)


def _drafter(kind: str, store: Store):
    greedy = SamplingParams()
    if kind == "self":
        return ModelDrafter(store.load_full(), greedy)
    if kind == "random":
        return ModelDrafter(make_tiny_model("qwen2", seed=1234, layers=2), greedy)
    if kind == "noisy":
        return ModelDrafter(noisy_copy(store.load_full(), 0.1), greedy)
    return NgramDrafter()


@pytest.mark.parametrize("mode", ["ar", "sd", "dsd", "dsd-adaptive"])
@pytest.mark.parametrize("drafter_kind", ["self", "random", "ngram"])
def test_greedy_modes_equal_hf_generate(tiny_qwen2_root, mode: str, drafter_kind: str) -> None:
    """Chain windows (tree_nodes=0): the behaviour from before trees, KV length included."""
    store = Store(tiny_qwen2_root / "store")
    n = 24
    for prompt in PROMPTS:
        expected = _reference(tiny_qwen2_root / "hf", prompt, n)
        backend = LocalBackend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
        drafter = None if mode == "ar" else _drafter(drafter_kind, store)
        cfg = GenerationConfig(mode=mode, max_new_tokens=n, tau_max=0.0, tree_nodes=0)
        result = trio.run(HeadEngine(backend, drafter, cfg).run, prompt)
        assert result.tokens == expected, (mode, drafter_kind, prompt)
        # The target's KV holds every committed token but the last, and no rejected or surplus draft.
        assert backend.length == len(prompt) + n - 1, (mode, drafter_kind, prompt, backend.length)
        if mode != "ar" and drafter_kind == "self":
            assert result.acceptance_rate == 1.0
            assert result.rounds < n
        if mode == "ar":
            assert result.rounds == n
        assert result.tree_windows == 0


class RecordingBackend(LocalBackend):
    """The local model, remembering every window's parents and keep as the engine sent them."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sent: list[tuple[int, int, list[int] | None, list[int] | None]] = []

    async def submit(self, tokens, *, start, commit, epoch, parents=None, keep=None) -> None:
        self.sent.append((start, len(tokens), None if parents is None else list(parents), None if keep is None else list(keep)))
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)


@pytest.mark.parametrize("mode", ["sd", "dsd", "dsd-adaptive"])
@pytest.mark.parametrize("drafter_kind", ["noisy", "random", "self"])
@pytest.mark.parametrize("tree_nodes", [None, 12], ids=["auto", "12"])
def test_greedy_trees_equal_hf_generate(tiny_qwen2_root, mode: str, drafter_kind: str, tree_nodes: int | None) -> None:
    """Token-tree windows through the local spans: the output is still the target's own greedy output,
    and every window after a tree keeps exactly a root-to-node path of it (the caches check it too)."""
    store = Store(tiny_qwen2_root / "store")
    n = 32
    trees = 0
    for prompt in PROMPTS:
        expected = _reference(tiny_qwen2_root / "hf", prompt, n)
        backend = RecordingBackend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
        cfg = GenerationConfig(mode=mode, max_new_tokens=n, tau_max=0.0, tree_nodes=tree_nodes)
        result = trio.run(HeadEngine(backend, _drafter(drafter_kind, store), cfg).run, prompt)
        assert result.tokens == expected, (mode, drafter_kind, tree_nodes, prompt)
        trees += result.tree_windows
        assert result.tree_windows == sum(1 for _, _, parents, _ in backend.sent if parents is not None)
        for (start, size, parents, _), (nxt, _, _, keep) in zip(backend.sent, backend.sent[1:], strict=False):
            if parents is None:
                assert keep is None
                continue
            assert len(parents) == size <= 64 and parents[0] == -1
            assert keep is not None and keep[0] == 0 and nxt == start + len(keep)
            assert all(parents[b] == a for a, b in zip(keep, keep[1:], strict=False))  # a root-to-node path
        if drafter_kind == "self":  # never corrected: every window adds its whole accepted path and a bonus
            assert result.rounds <= n // 2
            assert result.acceptance_rate == 1.0 or result.tree_windows > 0  # tree siblings are never kept
    if tree_nodes or drafter_kind == "noisy":
        assert trees > 0, (mode, drafter_kind, tree_nodes)
    if drafter_kind == "self" and tree_nodes is None:
        assert trees == 0  # a draft the target never corrects gives no reason to branch


def test_auto_trees_happen_and_zero_gives_chains(tiny_qwen2_root) -> None:
    """With a draft whose misses are often its 2nd or 3rd choice, the controller sends trees on its
    own (more drafted nodes per window than positions reached); tree_nodes=0 sends only chains."""
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[0]
    out = {}
    for tree_nodes in (None, 0):
        backend = RecordingBackend(store.load_head(), [store.load_span(0, 5)])
        cfg = GenerationConfig(mode="sd", max_new_tokens=48, tree_nodes=tree_nodes)
        out[tree_nodes] = trio.run(HeadEngine(backend, _drafter("noisy", store), cfg).run, prompt)
        if tree_nodes == 0:
            assert all(parents is None and keep is None for _, _, parents, keep in backend.sent)
    auto, chain = out[None].as_dict(), out[0].as_dict()
    assert auto["tokens"] == chain["tokens"] == _reference(tiny_qwen2_root / "hf", prompt, 48)
    assert auto["tree_windows"] > 0 and auto["mean_tree_nodes"] > auto["mean_window_depth"]
    assert chain["tree_windows"] == 0 and chain["mean_tree_nodes"] == chain["mean_window_depth"]


def test_tree_windows_need_a_model_drafter_and_a_tree_backend(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    backend = LocalBackend(store.load_head(), [store.load_span(0, 5)])
    with pytest.raises(ValueError, match="tree windows need a draft model"):
        HeadEngine(backend, NgramDrafter(), GenerationConfig(mode="sd", tree_nodes=8))
    HeadEngine(backend, NgramDrafter(), GenerationConfig(mode="sd"))  # auto: chains, no error
    with pytest.raises(ValueError, match="tree_nodes"):
        GenerationConfig(tree_nodes=64)


def test_random_draft_is_mostly_rejected_but_exact(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[0]
    backend = LocalBackend(store.load_head(), [store.load_span(0, 5)])
    cfg = GenerationConfig(mode="dsd", max_new_tokens=20, gamma=4)
    result = trio.run(HeadEngine(backend, _drafter("random", store), cfg).run, prompt)
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
    result = trio.run(HeadEngine(backend, _drafter("self", store), cfg).run, prompt)
    assert result.tokens == expected


def test_static_tree_values_are_best_first_products_of_rank_shares() -> None:
    """r = (0.5, 0.3): the best 5 nodes of depth <= 3 are 0.5, 0.3, 0.5², 0.5·0.3, 0.3·0.5 (shallower first)."""
    values = WindowController.tree_values([0.5, 0.3], nodes=5, depth=3)
    assert [round(v, 6) for v, _, _ in values] == [0.5, 0.3, 0.25, 0.15, 0.15]
    assert [d for _, d, _ in values] == [1, 1, 2, 2, 2]
    assert [chain for _, _, chain in values] == [True, False, True, False, False]
    assert WindowController.tree_values([0.5, 0.3], nodes=9, depth=1) == [(0.5, 1, True), (0.3, 1, False)]
    assert [v for v, _, _ in WindowController.tree_values([0.5, 0.3], nodes=9, depth=9, floor=0.2)] == [0.5, 0.3, 0.25]


def _seen(ranks: list[int | None], round_s_of) -> WindowController:
    """A controller after five chain rounds of varied size, each with these ranks of the target's tokens."""
    wc = WindowController(gamma_max=8)
    for g in (2, 4, 6, 3, 5):
        wc.observe(gamma=g, accepted=1, draft_s_per_token=0.001, round_s=round_s_of(g + 1), ranks=ranks)
    return wc


def test_the_controller_sends_a_tree_only_when_alternatives_pay_for_their_nodes() -> None:
    flat = _seen([1, 2], lambda tokens: 0.2)  # the target often takes the draft's 2nd choice; nodes cost nothing
    nodes, depth = flat.plan_tree(flat.next_gamma(), cap=63, depth_cap=8)
    assert nodes > flat.next_gamma() and 1 <= depth <= 8
    assert flat.plan_tree(flat.next_gamma(), cap=63, depth_cap=2)[1] == 2  # depth bounded by what is left
    steep = _seen([1, 2], lambda tokens: 0.05 * tokens)  # every window token costs a whole 50 ms
    assert steep.plan_tree(steep.next_gamma(), cap=63, depth_cap=8) == (0, 0)
    misses = _seen([1, None], lambda tokens: 0.2)  # the target's token is never among the draft's top choices
    assert misses.plan_tree(misses.next_gamma(), cap=63, depth_cap=8) == (0, 0)
    assert WindowController().plan_tree(4, cap=63, depth_cap=8) == (0, 0)  # nothing measured yet
    fixed = WindowController(gamma=4)
    fixed.observe(gamma=4, accepted=1, draft_s_per_token=0.001, round_s=0.2, ranks=[1, 2])
    assert fixed.plan_tree(4, cap=63, depth_cap=8) == (0, 0)  # a fixed γ means chains unless a budget is given
