"""Every supported family, each from a tiny random checkpoint with its quirks switched on (see
`support.models.FAMILY_QUIRKS`), saved with save_pretrained and converted: the store verifies; split over
two spans it equals the whole transformers model (prefill, chain windows, truncation back); a token tree
equals its paths run as chains (trees deeper than the sliding window); greedy `ar`, `sd` and tree-window
`dsd` equal transformers' own `generate` token for token; half precision runs close to transformers' own
model in that dtype; a draft with another vocabulary is refused naming both sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trio
from support.models import (
    FAMILY_QUIRKS,
    family_of,
    hf_greedy,
    make_tiny_model,
    noisy_copy,
    tiny_tokenizer,
)
from support.trees import leaves, path_to

from dsd.node.head.config import GenerationConfig
from dsd.node.head.draft_cache import DraftCache
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import load_drafter
from dsd.shard_store import HeadModule, SpanModule, SpanWindow, Store, StoreError, convert

SPANS = [(0, 2), (2, 5)]
FP32_TOL = 1e-4  # a window vs the whole sequence in float32 (see test_store_spans.py)
EXACT = 1e-5  # float64: a wrong mask, position or rotation is O(0.1)
PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 3, 3, 8, 9, 10, 11, 12]]
MIXTURES_OF_EXPERTS = {"mixtral", "qwen3_moe"}
NEW = 20  # prompt + NEW passes the sliding windows (6) and Llama 3's original context (16)


@dataclass
class Family:
    """A test family's transformers model, its HF folder and its converted store."""

    name: str
    model: torch.nn.Module
    hf: Path
    store: Path

    def expected(self, prompt: list[int]) -> list[int]:
        """transformers' own greedy generation: the reference every mode must reproduce."""
        return hf_greedy(self.model, prompt, NEW)


@pytest.fixture(scope="module", params=sorted(FAMILY_QUIRKS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp(f"family_{request.param}")
    model = make_tiny_model(request.param)
    model.save_pretrained(root / "hf")
    tiny_tokenizer().save_pretrained(root / "hf")
    convert(root / "hf", root / "store", model_id=f"tiny-{request.param}")
    return Family(request.param, model, root / "hf", root / "store")


class Pipeline:
    """The head and the spans in route order, each span with its own cache (what a route computes)."""

    def __init__(self, head: HeadModule, spans: list[SpanModule]) -> None:
        self.head, self.spans = head, spans
        self.caches = [s.new_cache() for s in spans]

    @classmethod
    def of(cls, store: Store, dtype: torch.dtype | None = None) -> Pipeline:
        return cls(store.load_head(dtype=dtype), [store.load_span(s, e, dtype=dtype) for s, e in SPANS])

    def step(self, ids: torch.Tensor, parents: list[int] | None = None) -> torch.Tensor:
        pos = self.caches[0].length
        hidden = self.head.embed(ids)
        for span, cache in zip(self.spans, self.caches, strict=True):
            hidden = span(hidden, pos, cache, parents)
        return self.head.logits(hidden)

    def truncate(self, n: int) -> None:
        for cache in self.caches:
            cache.truncate(n)


def _whole(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_store_verifies_and_records_the_family(family: Family) -> None:
    store = Store(family.store, verify=True)
    assert store.verify() == []
    assert store.manifest.family == family_of(family.name) == family.model.config.model_type
    assert store.manifest.tied_embeddings is bool(family.model.config.tie_word_embeddings)


def test_a_sharded_checkpoint_converts_to_the_same_store(family: Family, tmp_path: Path) -> None:
    """save_pretrained in shards of 200 KB writes the checkpoint format (Mixtral's and Qwen3-MoE's experts one
    tensor each, as published checkpoints hold them); converting it gives the same files as the single file."""
    family.model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    sharded = convert(tmp_path / "hf", tmp_path / "store", model_id=f"tiny-{family.name}").files
    single = Store(family.store).manifest.files
    assert {k: v["sha256"] for k, v in sharded.items()} == {k: v["sha256"] for k, v in single.items() if k in sharded}
    assert set(single) - set(sharded) == {f for f in single if f.startswith("tokenizer/")}


def test_split_windows_and_truncation_equal_the_whole_model(family: Family) -> None:
    """Prefill, then windows of 5, 1 and 6 tokens; then back to 12 positions and a different continuation."""
    store = Store(family.store)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 300, (1, 22), generator=gen)
    pipe = Pipeline.of(store)
    got = torch.cat([pipe.step(ids[:, a:b]) for a, b in [(0, 10), (10, 15), (15, 16), (16, 22)]], dim=1)
    want = _whole(family.model, ids)
    assert (got - want).abs().max().item() <= FP32_TOL
    assert (_whole(store.load_full(), ids) - want).abs().max().item() <= FP32_TOL

    other = torch.cat([ids[:, :12], torch.randint(3, 300, (1, 9), generator=gen)], dim=1)
    pipe.truncate(12)
    got = pipe.step(other[:, 12:])
    assert (got - _whole(family.model, other)[:, 12:]).abs().max().item() <= FP32_TOL




def step_together(span, windows: list[SpanWindow]) -> list[torch.Tensor]:
    """Commit every window's cache, then one joint step (`forward_many`, without `step_each`'s one-by-one fallback,
    which would hide a joint step that went wrong)."""
    with torch.inference_mode():
        for w in windows:
            w.commit_cache()
        return span.forward_many(windows)


def test_sessions_stepped_together_equal_each_stepped_alone(family: Family) -> None:
    """In float64: three sessions at different lengths (past the sliding window of 6, and not) step together —
    a 1-token chain, a 4-token chain and a tree, then a kept path, a truncation and fresh windows — and every
    output row and the caches after equal each session stepped alone (`SpanModule.forward_many`, issue 54)."""
    store = Store(family.store)
    span = store.load_span(0, 5, dtype=torch.float64)
    head = store.load_head(dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> torch.Tensor:
        return head.embed(torch.randint(3, 300, (1, n), generator=gen))

    prefixes = [ids(9), ids(3), ids(14)]
    alone = [span.new_cache() for _ in prefixes]
    joint = [span.new_cache() for _ in prefixes]
    for x, a, j in zip(prefixes, alone, joint, strict=True):
        span.step(x, 0, a)
        span.step(x, 0, j)
    tree = [-1, 0, 0, 1, 2]
    rounds = [  # per session: (rows, commit, parents, keep) of its window in this step
        [(ids(1), None, None, None), (ids(4), None, None, None), (ids(5), None, tree, None)],
        [(ids(2), 9, None, None), (ids(1), 5, None, None), (ids(1), 14, None, [0, 2, 4])],  # truncate, keep a path
    ]
    worst = 0.0
    for windows in rounds:
        starts = [c.length if commit is None else commit + len(keep or []) for (_, commit, _, keep), c
                  in zip(windows, alone, strict=True)]
        want = [span.step(rows, at, c, commit=commit, parents=parents, keep=keep) for (rows, commit, parents, keep),
                at, c in zip(windows, starts, alone, strict=True)]
        got = step_together(span, [SpanWindow(rows, at, c, commit, parents, keep) for (rows, commit, parents, keep),
                                   at, c in zip(windows, starts, joint, strict=True)])
        assert [g.shape for g in got] == [w.shape for w in want]
        worst = max([worst] + [(g - w).abs().max().item() for g, w in zip(got, want, strict=True)])
        assert [c.length for c in joint] == [c.length for c in alone]
    for a, j in zip(alone, joint, strict=True):  # the caches hold the same keys and values
        nxt = ids(1)
        worst = max(worst, (span.step(nxt, a.length, a) - span.step(nxt, j.length, j)).abs().max().item())
    assert worst <= EXACT


def test_stepping_sessions_together_refuses_bad_windows_before_touching_a_cache(family: Family) -> None:
    store = Store(family.store)
    span = store.load_span(0, 5)
    head = store.load_head()
    x = head.embed(torch.tensor([[5, 6, 7]]))
    a, b = span.new_cache(), span.new_cache()
    span.step(x, 0, a)
    with pytest.raises(StoreError, match="start_pos 2 != cache length 0"):
        step_together(span, [SpanWindow(x[:, :1], 3, a), SpanWindow(x[:, :1], 2, b)])
    with pytest.raises(StoreError, match="two windows of one cache"):
        step_together(span, [SpanWindow(x[:, :1], 3, a), SpanWindow(x[:, :1], 3, a)])
    assert (a.length, b.length) == (3, 0)


def test_tree_window_equals_its_paths_as_chains(family: Family) -> None:
    """In float64: every node of a tree 8 deep (past the sliding window of 6) equals its path run as a chain."""
    store = Store(family.store)
    pipe = Pipeline.of(store, torch.float64)
    gen = torch.Generator().manual_seed(3)
    prefix = 9
    pipe.step(torch.randint(3, 300, (1, prefix), generator=gen))
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 1, 8, 9, -1, 11, 12]
    tokens = torch.randint(3, 300, (1, len(parents)), generator=gen)
    tree = pipe.step(tokens, parents)
    worst = 0.0
    for leaf in leaves(parents):
        path = path_to(parents, leaf)
        pipe.truncate(prefix)
        worst = max(worst, (tree[0, path] - pipe.step(tokens[:, path])[0]).abs().max().item())
    assert worst <= EXACT


def _generate(family: Family, mode: str, drafter: ModelDrafter | None, prompt: list[int], tree_nodes: int):
    store = Store(family.store)
    backend = LocalBackend(store.load_head(), [store.load_span(s, e) for s, e in SPANS])
    cfg = GenerationConfig(mode=mode, max_new_tokens=NEW, tau_max=0.0, tree_nodes=tree_nodes)
    return trio.run(HeadEngine(backend, drafter, cfg).run, prompt), backend


@pytest.mark.parametrize(("mode", "tree_nodes"), [("ar", 0), ("sd", 0), ("dsd", 12)], ids=["ar", "sd", "dsd-trees"])
def test_greedy_generation_equals_transformers_generate(family: Family, mode: str, tree_nodes: int) -> None:
    """A noisy copy drafts (it often disagrees, so windows are cut and the KV truncated or a tree path kept)."""
    drafter_model = noisy_copy(Store(family.store).load_full(), 0.1)
    for prompt in PROMPTS:
        drafter = None if mode == "ar" else ModelDrafter(drafter_model, SamplingParams())
        result, backend = _generate(family, mode, drafter, prompt, tree_nodes)
        assert result.tokens == family.expected(prompt), (family.name, mode, prompt)
        if mode != "dsd":  # dsd may hold drafts sent ahead of the last verification
            assert backend.length == len(prompt) + NEW - 1
        if mode == "ar":
            assert result.rounds == NEW
        else:
            assert 0 < result.acceptance_rate < 1.0  # rejections happened: truncation and trees were exercised
        if tree_nodes:
            assert result.tree_windows > 0


def test_the_model_drafting_for_itself_is_always_accepted(family: Family) -> None:
    """The drafter's own cache and masks (sliding windows, soft caps) reproduce the target exactly: every
    chain draft is accepted, and with trees the output is still the target's."""
    store = Store(family.store)
    result, _ = _generate(family, "sd", ModelDrafter(store.load_full(), SamplingParams()), PROMPTS[1], 0)
    assert result.tokens == family.expected(PROMPTS[1])
    assert result.acceptance_rate == 1.0
    result, _ = _generate(family, "sd", ModelDrafter(store.load_full(), SamplingParams()), PROMPTS[1], 12)
    assert result.tokens == family.expected(PROMPTS[1]) and result.tree_windows > 0


def test_draft_cache_branches_equal_each_context_run_alone(family: Family) -> None:
    """The drafter's token-tree cache: branching contexts deeper than the sliding window, fed in one forward,
    give each context's own next-token logits (its masks carry the window per layer kind, and the soft cap)."""
    model = Store(family.store).load_full()
    cache = DraftCache(model)
    gen = torch.Generator().manual_seed(11)
    base = torch.randint(3, 300, (10,), generator=gen).tolist()
    a, b = torch.randint(3, 300, (8,), generator=gen).tolist(), torch.randint(3, 300, (3,), generator=gen).tolist()
    contexts = [base + a, base + a[:2] + b, base + a[:7]]
    cache.extend([base])
    got = cache.extend(contexts)
    want = torch.stack([_whole(family.model, torch.tensor([ctx]))[0, -1] for ctx in contexts])
    assert (got - want).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_tracks_transformers_in_that_dtype(family: Family, dtype: torch.dtype) -> None:
    """The fp32 store computed in half precision, windowed, against transformers' whole model cast to it."""
    ids = torch.randint(3, 300, (1, 14), generator=torch.Generator().manual_seed(8))
    pipe = Pipeline.of(Store(family.store), dtype)
    got = torch.cat([pipe.step(ids[:, :9]), pipe.step(ids[:, 9:11]), pipe.step(ids[:, 11:])], dim=1).float()
    assert got.dtype == torch.float32 and pipe.head.dtype == dtype and pipe.spans[0].dtype == dtype
    want = _whole(make_tiny_model(family.name).to(dtype), ids).float()
    fp32 = _whole(family.model, ids)
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs()[0] / scale  # [positions, vocab]
    assert err.median().item() <= 0.01
    # Dense families stay within 5 % at every position; a mixture of experts may route one position to another
    # expert in half precision (a near tie of the router), which moves that position's logits further.
    close = err.max(-1).values.le(0.05).float().mean().item()
    assert close >= (0.8 if family.name in MIXTURES_OF_EXPERTS else 1.0)
    assert got.argmax(-1).eq(fp32.argmax(-1)).float().mean().item() >= 0.85


def test_a_draft_with_another_vocabulary_is_refused(family: Family, tmp_path: Path) -> None:
    """`generate --draft` loads the draft through load_drafter: a smaller model of the family with another
    vocabulary is refused naming both sizes; with the target's vocabulary and tokenizer it is accepted."""
    for vocab in (256, 300):
        hf = tmp_path / f"hf{vocab}"
        make_tiny_model(family.name, seed=1, layers=1, vocab_size=vocab).save_pretrained(hf)
        tiny_tokenizer().save_pretrained(hf)
        convert(hf, tmp_path / f"draft{vocab}")
    tok = Store(family.store).load_tokenizer()
    with pytest.raises(ValueError, match=r"vocabulary \(256 logits\) differs from the target's \(300\)"):
        load_drafter(str(tmp_path / "draft256"), SamplingParams(), 0, vocab_size=300, tokenizer=tok)
    assert isinstance(load_drafter(str(tmp_path / "draft300"), SamplingParams(), 0, vocab_size=300, tokenizer=tok), ModelDrafter)
