"""Drafters: n-gram lookup cases; the model drafter's cached drafts equal a fresh model's, rollback included;
an int8-quantized draft keeps its embedding and, through the engine, the target's exact output."""

from __future__ import annotations

import pytest
import torch
import trio
from support.models import make_tiny_model
from transformers import AutoModelForCausalLM

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import (
    ModelDrafter,
    NgramDrafter,
    check_vocab_compatible,
    quantize_draft_model,
)
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import GumbelNoise, SamplingParams, gumbel, softmax, warp
from dsd.node.head.setup import load_head_setup
from dsd.node.head.verify import verify_window
from dsd.shard_store import Store

torch.set_num_threads(1)
VOCAB = 64


def tiny_model(kind: str, seed: int, vocab: int = VOCAB) -> torch.nn.Module:
    """An even smaller variant of the shared tiny models (2 layers, hidden 32, `vocab` tokens)."""
    return make_tiny_model(kind, seed=seed, layers=2, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                           max_position_embeddings=256)


@torch.inference_mode()
def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Next-token logits after `ids`, recomputed from scratch (no cache)."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


# --- n-gram ----------------------------------------------------------------------------------


def test_ngram_copies_what_followed_the_tail() -> None:
    d = NgramDrafter(max_ngram=3)
    assert d.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == ([4, 5, 9], None)


def test_ngram_prefers_the_longest_then_latest_match() -> None:
    d = NgramDrafter(max_ngram=2)
    # Tail bigram (7, 8) occurred once, followed by 1; unigram 8 occurred later, followed by 5.
    assert d.propose([7, 8, 1, 3, 8, 5, 0, 7, 8], 1)[0] == [1]
    # Only unigram matches: the latest earlier occurrence of 4 wins.
    assert d.propose([4, 1, 4, 2, 6, 4], 1)[0] == [2]


def test_ngram_extends_short_continuations_and_handles_no_match() -> None:
    d = NgramDrafter()
    # Repetitive text: the lookup chains through its own drafts.
    assert d.propose([5, 6, 5, 6], 5)[0] == [5, 6, 5, 6, 5]
    assert d.propose([1, 2, 3], 4) == ([], None)
    assert d.propose([1], 4) == ([], None)
    assert d.propose([1, 1, 1], 0) == ([], None)


def test_ngram_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="gamma"):
        NgramDrafter().propose([1, 2], -1)


# --- model drafter ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_drafts_equal_the_models_own_greedy_continuation(kind: str) -> None:
    model = tiny_model(kind, seed=1)
    d = ModelDrafter(model, SamplingParams())
    ctx = [3, 17, 42, 5, 9, 11]
    drafts, q = d.propose(ctx, 6)
    assert drafts == hf_greedy(model, ctx, 6)
    assert q.shape == (6, VOCAB)
    # Greedy q rows are the untempered draft distributions at each drafted position.
    for i in range(6):
        assert torch.allclose(q[i], softmax(full_logits(model, ctx + drafts[:i])), atol=1e-5)
    assert d.cached_tokens == ctx + drafts[:-1]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rollback_gives_the_drafts_of_a_fresh_drafter(kind: str) -> None:
    model = tiny_model(kind, seed=2)
    d = ModelDrafter(model, SamplingParams())
    ctx = [1, 2, 3, 4, 5, 6, 7, 8]
    first, _ = d.propose(ctx, 5)
    # Draft ahead past unverified tokens, then roll back to a shorter, different context.
    d.propose(ctx + first + [9], 4)
    for rolled in (ctx[:5] + [30, 31], ctx[:1] + [40], [50], ctx + first[:2] + [60]):
        got, _ = d.propose(rolled, 4)
        assert got == ModelDrafter(model, SamplingParams()).propose(rolled, 4)[0], rolled
        assert got == hf_greedy(model, rolled, 4)


def test_drafting_ahead_reuses_the_cache() -> None:
    model = tiny_model("llama", seed=3)
    fed: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: fed.append(args[0].shape[1]))
    d = ModelDrafter(model, SamplingParams())
    ctx = list(range(10, 30))
    drafts, _ = d.propose(ctx, 4)
    assert fed == [20, 1, 1, 1]
    fed.clear()
    # Pipelined DSD: the next call extends the context by the whole unverified window.
    d.propose(ctx + drafts + [drafts[-1]], 3)
    assert fed == [2, 1, 1]
    fed.clear()
    # Rejection after 2 drafts: crop to the common prefix and feed only the correction.
    d.propose(ctx + drafts[:2] + [7], 2)
    assert fed == [1, 1]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sampled_drafts_are_gumbel_max_draws_with_the_given_noise(kind: str) -> None:
    """The draft at position pos is argmax(log q + G_pos): after a rollback, as a fresh drafter with the same
    noise would draft, one token at a time (step_many) or a window at a time; another seed, other drafts."""
    model = tiny_model(kind, seed=4)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    d = ModelDrafter(model, params, GumbelNoise(5))
    ctx = [2, 4, 6, 8, 10]
    d.propose(ctx, 5)
    rolled = ctx[:3] + [33]
    got, q = d.propose(rolled, 5)
    fresh, q_fresh = ModelDrafter(model, params, GumbelNoise(5)).propose(rolled, 5)
    assert got == fresh
    assert torch.allclose(q, q_fresh, atol=1e-5)
    for i in range(5):
        expected = warp(full_logits(model, rolled + got[:i]), params)
        assert torch.allclose(q[i], expected, atol=1e-5)
        assert got[i] == int(torch.argmax(torch.log(expected) + gumbel(5, len(rolled) + i, VOCAB)))
    assert [tok for tok, _ in d.step_many([rolled + got[:i] for i in range(5)])] == got
    d.use_noise(GumbelNoise(6))
    assert d.propose(rolled, 5)[0] != got


def test_mismatched_vocabulary_is_refused_with_a_clear_message() -> None:
    d = ModelDrafter(tiny_model("llama", seed=5), SamplingParams())
    assert d.vocab_size == VOCAB
    d.check_compatible(VOCAB)
    with pytest.raises(ValueError, match=r"vocabulary \(64 logits\) differs from the target's \(80\)"):
        d.check_compatible(80)

    class Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return dict(self.vocab)

    same = {"a": 0, "b": 1, "c": 2}
    d.check_compatible(VOCAB, Tok(same), Tok(dict(same)))
    with pytest.raises(ValueError, match="different ids"):
        d.check_compatible(VOCAB, Tok(same), Tok({"a": 0, "b": 2, "c": 1}))
    with pytest.raises(ValueError, match="only in the target"):
        check_vocab_compatible(3, 3, Tok(same), Tok({"a": 0, "b": 1, "z": 2}))


def test_model_drafter_refuses_bad_input() -> None:
    d = ModelDrafter(tiny_model("llama", seed=6), SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        d.propose([], 3)
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        d.propose([1, VOCAB], 3)
    drafts, q = d.propose([1, 2], 0)
    assert drafts == [] and q.shape == (0, VOCAB)


# --- the pieces together: greedy speculative decoding reproduces the target --------------------


@pytest.mark.parametrize("drafter_kind", ["self", "unrelated", "ngram"])
def test_greedy_speculative_loop_equals_target_greedy(drafter_kind: str) -> None:
    target = tiny_model("qwen2", seed=7)
    if drafter_kind == "ngram":
        drafter = NgramDrafter()
    else:
        draft_model = target if drafter_kind == "self" else tiny_model("qwen2", seed=8)
        drafter = ModelDrafter(draft_model, SamplingParams())
    for prompt, n in (([5, 9, 5, 9, 5], 12), ([1, 2, 3, 4], 9)):
        out: list[int] = []
        while len(out) < n:
            ctx = prompt + out
            drafts, q = drafter.propose(ctx, 4)
            with torch.inference_mode():
                logits = target(input_ids=torch.tensor([ctx + drafts])).logits[0, len(ctx) - 1 :].float()
            out.extend(verify_window(logits, drafts, q, SamplingParams(), None).tokens)
        assert out[:n] == hf_greedy(target, prompt, n)


# --- int8 draft: a faster draft model, the same output ------------------------------------------


def _dynamic_int8_linear() -> type:
    from torch.ao.nn.quantized.dynamic import Linear

    return Linear


@pytest.mark.parametrize(("kind", "tied"), [("qwen2", True), ("llama", False)])
def test_int8_quantizes_every_linear_and_keeps_the_embedding(kind: str, tied: bool) -> None:
    model = tiny_model(kind, seed=9)
    embedding = model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is embedding) == tied
    before = embedding.detach().clone()
    ctx = [3, 17, 42, 5, 9, 11, 20, 30]
    fp32 = full_logits(model, ctx)
    assert quantize_draft_model(model, "int8") is model
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), _dynamic_int8_linear())
    assert isinstance(model.model.layers[0].mlp.down_proj, _dynamic_int8_linear())
    # The (tied) embedding is untouched: same parameter, float32, same values.
    assert model.get_input_embeddings().weight is embedding
    assert embedding.dtype == torch.float32 and torch.equal(embedding.detach(), before)
    int8 = full_logits(model, ctx)
    assert not torch.equal(int8, fp32)
    assert float(torch.nn.functional.cosine_similarity(int8, fp32, dim=0)) > 0.99
    # The drafter runs on the quantized model. Dynamic int8 scales activations per forward, so logits
    # depend slightly on how the context was fed (not compared with a from-scratch recompute here).
    d = ModelDrafter(model, SamplingParams())
    assert d.vocab_size == VOCAB
    drafts, q = d.propose(ctx, 5)
    assert q.shape == (5, VOCAB) and drafts == q.argmax(dim=1).tolist()
    assert drafts == ModelDrafter(model, SamplingParams()).propose(ctx, 5)[0]


def test_quantize_refuses_an_unknown_mode_and_none_is_a_no_op() -> None:
    model = tiny_model("qwen2", seed=10)
    assert quantize_draft_model(model, "none") is model
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    with pytest.raises(ValueError, match="int4"):
        quantize_draft_model(model, "int4")


def _hf_reference(hf_dir, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["sd", "dsd"])
def test_int8_draft_keeps_the_targets_greedy_output(tiny_qwen2_root, mode: str) -> None:
    store = Store(tiny_qwen2_root / "store")
    params = SamplingParams()
    setup, _tok = load_head_setup(tiny_qwen2_root / "store", str(tiny_qwen2_root / "store"), params, 0, quant="int8")
    drafter = setup.drafter
    assert isinstance(drafter, ModelDrafter)
    assert isinstance(drafter.model.get_output_embeddings(), _dynamic_int8_linear())
    n = 24
    for prompt in ([1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 3, 3, 8, 9, 10, 11, 12]):
        drafter.reset()
        backend = LocalBackend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
        result = trio.run(HeadEngine(backend, drafter, GenerationConfig(mode=mode, max_new_tokens=n)).run, prompt)
        assert result.tokens == _hf_reference(tiny_qwen2_root / "hf", prompt, n), (mode, prompt)
        assert result.drafted > 0 and result.accepted > 0


def test_draft_quant_needs_a_draft_model(tiny_qwen2_root) -> None:
    with pytest.raises(ValueError, match="needs a draft model store"):
        load_head_setup(tiny_qwen2_root / "store", "ngram", SamplingParams(), 0, quant="int8")
    with pytest.raises(ValueError, match="unknown draft quantization"):
        load_head_setup(tiny_qwen2_root / "store", "ngram", SamplingParams(), 0, quant="fp8")


def test_a_q4k_draft_store_drafts_on_the_packed_kernels_as_it_is_held(tiny_qwen2_root, tmp_path) -> None:
    """A draft store converted with `--weights q4k` (the draft GGUF's own blocks, what `models prepare` makes) loads
    whole as it is held: its layers' linears on the packed kernels, bf16 whatever the head computes in, the same
    model its spans compute; with --draft-quant int8 it is the float model those blocks stand for, quantized again.
    The target's greedy output stays exact through either."""
    from support.gguf_files import write_q4k_gguf

    from dsd.node.head.setup import draft_model
    from dsd.shard_store import convert
    from dsd.shard_store.quant import Int4Linear, Int8Linear

    draft = tmp_path / "draft-q4k"
    convert(write_q4k_gguf(tmp_path / "draft.gguf", layers=2), draft, weights="q4k")
    target = tiny_qwen2_root / "store"
    setup, _tok = load_head_setup(target, str(draft), SamplingParams(), 0, dtype=torch.float32)
    model = draft_model(setup.drafter)
    assert model is not None and model.dtype == torch.bfloat16
    kinds = {name: type(m) for layer in model.model.layers for name, m in layer.named_modules()}
    assert kinds["self_attn.q_proj"] is kinds["mlp.up_proj"] is Int4Linear and kinds["self_attn.v_proj"] is Int8Linear
    assert [n for n, kind in kinds.items() if kind is torch.nn.Linear] == ["self_attn.o_proj"]  # F32 in the file
    span, ids = Store(draft).load_span(0, 2), torch.tensor([[1, 17, 42, 99, 5, 17, 42]])
    with torch.inference_mode():  # the layers in order, as the spans hold them (bf16 attention aside)
        whole = model(input_ids=ids, output_hidden_states=True).hidden_states[-1].float()
        spans = model.model.norm(span(model.model.embed_tokens(ids), 0, span.new_cache())).float()
    assert ((whole - spans).norm() / spans.norm()).item() < 0.02
    floats = Store(draft).load_full(dtype=torch.float32, dequantize=True)
    assert floats.dtype == torch.float32 and type(floats.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.inference_mode():  # the values and scales the packed kernels compute with, as float weights
        dense = floats(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert ((dense - whole).norm() / whole.norm()).item() < 0.02
    int8, _tok = load_head_setup(target, str(draft), SamplingParams(), 0, quant="int8")
    assert isinstance(draft_model(int8.drafter).get_output_embeddings(), _dynamic_int8_linear())
    prompt, n = [1, 17, 42, 99, 5, 17, 42], 16
    for drafter in (setup.drafter, int8.drafter):
        backend = LocalBackend(Store(target).load_head(), [Store(target).load_span(0, 5)])
        result = trio.run(HeadEngine(backend, drafter, GenerationConfig(mode="dsd", max_new_tokens=n)).run, prompt)
        assert result.tokens == _hf_reference(tiny_qwen2_root / "hf", prompt, n) and result.drafted > 0
