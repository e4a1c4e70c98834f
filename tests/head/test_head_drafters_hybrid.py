"""The hybrid drafter (prompt lookup when the tail repeats, the draft model otherwise): which source
answers, a model cache that stays right across sources, q that verifies like q=None, exact greedy
output through the engine, and `--draft` parsing."""

from __future__ import annotations

import pytest
import torch
import trio
from support.models import make_tiny_model
from transformers import AutoModelForCausalLM

from dsd.node.head.adaptive import AdaptiveVerifier
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import load_head_setup, parse_draft
from dsd.node.head.verify import verify_window
from dsd.shard_store import Store

VOCAB = 64
REPEATED = [1, 17, 42, 99, 5, 60, 3, 17, 42, 99]  # the tail (17, 42, 99) occurred before, followed by 5
NO_REPEAT = [1, 250, 3, 8, 9, 10, 11, 12, 13, 14]
# "17 42" repeats, and the tiny target's greedy continuation falls into a loop (136 136 136 ...).
LOOPING = [1, 17, 42, 99, 5, 17, 42]


def tiny_model(seed: int) -> torch.nn.Module:
    return make_tiny_model("qwen2", seed=seed, layers=2, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           max_position_embeddings=256)


def fresh(model: torch.nn.Module, ctx: list[int], gamma: int) -> tuple[list[int], torch.Tensor]:
    return ModelDrafter(model, SamplingParams()).propose(ctx, gamma)


def test_each_call_takes_one_source_and_is_counted() -> None:
    model = tiny_model(seed=1)
    h = HybridDrafter(ModelDrafter(model, SamplingParams()))
    assert (h.ngram.min_ngram, h.ngram.max_ngram) == (3, 4)
    # The tail trigram repeats: the lookup's continuation, with one-hot q rows.
    toks, q = h.propose([10, 11, 12, 13, 14, 10, 11, 12], 3)
    assert toks == [13, 14, 10]
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor(toks), VOCAB).float())
    assert h.source_counts() == {"ngram_proposals": 1, "model_proposals": 0, "ngram_tokens": 3, "model_tokens": 0}
    assert h.cached_tokens == []  # the model was not run
    # Only a bigram repeats (shorter than min_ngram): the model answers, as a lone model drafter would.
    ctx = [10, 11, 20, 21, 22, 10, 11]
    toks, q = h.propose(ctx, 4)
    want, want_q = fresh(model, ctx, 4)
    assert toks == want and torch.allclose(q, want_q, atol=1e-6)
    assert h.source_counts() == {"ngram_proposals": 1, "model_proposals": 1, "ngram_tokens": 3, "model_tokens": 4}
    # gamma 0 asks nothing of either source.
    assert h.propose(ctx, 0)[0] == []
    assert h.model_proposals == 1 and h.ngram_proposals == 1


def test_model_cache_stays_consistent_when_sources_alternate() -> None:
    model = tiny_model(seed=2)
    fed: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: fed.append(args[0].shape[1]))
    h = HybridDrafter(ModelDrafter(model, SamplingParams()))
    base = [30, 31, 32, 33, 34, 35]
    toks, _ = h.propose(base, 3)  # model: prefill 6, then 2 steps
    assert h.model_proposals == 1 and fed == [6, 1, 1]
    ctx = base + toks + [30, 31, 32]  # the tail repeats the start: lookup, the model is not run
    fed.clear()
    copied, _ = h.propose(ctx, 3)
    assert copied == [33, 34, 35] and h.ngram_proposals == 1 and fed == []
    # Lookup drafts accepted, then a new token: the model catches up on everything it missed in one forward.
    ctx = ctx + copied + [7]
    fed.clear()
    first_toks = toks
    toks, _ = h.propose(ctx, 2)
    assert ctx[:8] == base + first_toks[:2] and h.model_proposals == 2
    assert fed == [len(ctx) - 8, 1]  # the cache kept base + the 2 model drafts it had fed
    assert toks == fresh(model, ctx, 2)[0]
    assert h.cached_tokens == ctx + toks[:-1]
    # Roll back to a shorter, different context (a rejection): still the fresh drafter's answer.
    for rolled in (base[:3] + [50, 51], [40], ctx[:9] + [2]):
        got, _ = h.propose(rolled, 3)
        assert got == fresh(model, rolled, 3)[0], rolled
        assert h.cached_tokens == rolled + got[:-1]
    h.reset()
    assert h.cached_tokens == []


def test_one_hot_rows_verify_exactly_like_no_q() -> None:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.8, top_k=20)
    adaptive = AdaptiveVerifier(tau_max=0.3, params=params)
    for seed in range(40):
        logits = torch.randn(5, VOCAB, generator=gen) * 2
        drafts = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
        if seed % 2:
            drafts[:2] = logits[:2].argmax(dim=1).tolist()  # some accepted, some not
        one_hot = torch.nn.functional.one_hot(torch.tensor(drafts), VOCAB).float()
        a = verify_window(logits, drafts, one_hot, params, torch.Generator().manual_seed(seed))
        b = verify_window(logits, drafts, None, params, torch.Generator().manual_seed(seed))
        assert a == b
        assert torch.equal(adaptive.taus(logits, one_hot, drafts), adaptive.taus(logits, None, drafts))


def _reference(hf_dir, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(store: Store, drafter, prompt: list[int], cfg: GenerationConfig):
    backend = LocalBackend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
    return trio.run(HeadEngine(backend, drafter, cfg).run, prompt)


@pytest.mark.parametrize("mode", ["sd", "dsd"])
def test_hybrid_greedy_output_equals_the_targets(tiny_qwen2_root, mode: str) -> None:
    store = Store(tiny_qwen2_root / "store")
    n = 24
    draft_model = make_tiny_model("qwen2", seed=1234, layers=2)  # an unrelated draft: many rejections
    for prompt, source in ((LOOPING, "ngram_proposals"), (NO_REPEAT, "model_proposals")):
        h = HybridDrafter(ModelDrafter(draft_model, SamplingParams()))
        result = _run(store, h, prompt, GenerationConfig(mode=mode, max_new_tokens=n))
        assert result.tokens == _reference(tiny_qwen2_root / "hf", prompt, n), (mode, prompt)
        assert getattr(h, source) > 0, h.source_counts()
        assert h.ngram_tokens + h.model_tokens >= result.drafted


def test_hybrid_sampling_mixes_sources_in_one_window(tiny_qwen2_root) -> None:
    """Sampling with windows drafted one token at a time from either source (dsd): q rows always stack."""
    store = Store(tiny_qwen2_root / "store")
    h = HybridDrafter(ModelDrafter(store.load_full(), SamplingParams(temperature=0.8)))
    cfg = GenerationConfig(mode="dsd", max_new_tokens=30, params=SamplingParams(temperature=0.8), gamma=4, seed=3)
    result = _run(store, h, REPEATED + REPEATED[1:], cfg)
    assert len(result.tokens) == 30
    assert h.ngram_proposals > 0 and h.model_proposals > 0, h.source_counts()
    assert result.accepted > 0


def test_parse_draft_accepts_the_four_forms_and_refuses_the_rest(tmp_path) -> None:
    assert parse_draft("ngram") == (None, True)
    assert parse_draft("some/store") == ("some/store", False)
    assert parse_draft("some/store+ngram") == ("some/store", True)
    assert parse_draft("ngram+some/store") == ("some/store", True)
    plus = tmp_path / "a+b"
    plus.mkdir()
    assert parse_draft(str(plus)) == (str(plus), False)  # an existing store whose name holds a '+'
    for bad in ("+ngram", "ngram+", "ngram+ngram", "ngram+x+ngram", "a+b"):
        with pytest.raises(ValueError, match="--draft must be one of"):
            parse_draft(bad)


def test_load_head_setup_builds_a_hybrid_in_either_order(tiny_qwen2_root) -> None:
    store = tiny_qwen2_root / "store"
    for spec in (f"{store}+ngram", f"ngram+{store}"):
        setup, _tok = load_head_setup(store, spec, SamplingParams(), 0)
        assert isinstance(setup.drafter, HybridDrafter)
        assert isinstance(setup.drafter.ngram, NgramDrafter)
    setup, _tok = load_head_setup(store, f"{store}+ngram", SamplingParams(), 0, quant="int8")
    assert type(setup.drafter.model.model.get_output_embeddings()) is not torch.nn.Linear
    assert isinstance(load_head_setup(store, str(store), SamplingParams(), 0)[0].drafter, ModelDrafter)
