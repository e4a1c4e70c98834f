"""Federated mode without a network: the DraftWindow `rows` field, the worker's window computation
against the whole model, the aggregation-bias bound on real model distributions, the backend's
refusals, and the head engine verifying against probabilities instead of logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from support.heads import ProbsBackend
from support.models import make_tiny_model

from dsd.node.federated.backend import FederatedBackend
from dsd.node.federated.pool import FederatedError, WorkerInfo
from dsd.node.federated.worker import window_topk
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams, coupled_token, gumbel, warp
from dsd.protocol import DraftWindow, FrameDecoder, ProtocolError, aggregate, encode, reconstruct
from dsd.shard_store import Store

V = 300


def test_draft_window_rows_round_trip_and_default() -> None:
    msg = DraftWindow("s", 3, 10, 10, (5, 6, 7), 8, 0.8, 0.9, rows=2)
    back = FrameDecoder().feed(encode(msg))[0]
    assert back == msg and back.rows == 2
    old = DraftWindow("s", 0, 0, None, (1, 2), 4, 0.0)
    wire = old.to_wire()
    del wire["rows"]  # an older peer sends no rows: every position is answered
    assert DraftWindow.from_wire(wire).rows is None


def test_draft_window_rows_refusals_name_the_field() -> None:
    with pytest.raises(ProtocolError, match=r"DraftWindow\.rows.*3 rows of a 2-token window"):
        DraftWindow("s", 0, 0, None, (1, 2), 4, 0.0, rows=3)
    with pytest.raises(ProtocolError, match=r"DraftWindow\.rows"):
        DraftWindow("s", 0, 0, None, (1, 2), 4, 0.0, rows=0)


@pytest.fixture(scope="module")
def whole(tiny_qwen2_store):
    store = Store(tiny_qwen2_store)
    return store, store.load_head(), store.load_span(0, store.num_layers), store.load_full()


def test_window_topk_equals_the_whole_models_distribution(whole) -> None:
    store, head, span, full = whole
    seq = [1, 17, 42, 99, 5, 17, 42, 99, 3, 8]
    cache = span.new_cache()
    # prefill: only the last row; then a window of 4 with K = V at temperature 0.7 and top-p 0.9
    ids, p, eps = window_topk(head, span, cache, seq[:6], 0, rows=1, top_k=V, temperature=0.0)
    with torch.no_grad():
        logits = full(input_ids=torch.tensor([seq])).logits[0]
    want = torch.softmax(logits[5], -1).numpy()  # temperature 0 travels as the temperature-1 softmax
    got = np.zeros(V)
    got[ids[0]] = p[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert abs(eps) < 1e-5
    ids, p, eps = window_topk(head, span, cache, seq[6:], 6, rows=4, top_k=7, temperature=0.7, top_p=0.9)
    assert cache.length == len(seq) and ids.shape == (4, 7)
    warped = warp(logits[6:], SamplingParams(temperature=0.7, top_p=0.9)).numpy()
    for r in range(4):
        order = np.argsort(-warped[r], kind="stable")[:7]
        assert set(ids[r].tolist()) == set(order.tolist())
        np.testing.assert_allclose(p[r], warped[r][ids[r]], atol=1e-5)
    assert eps == pytest.approx(float(np.mean(1 - np.sort(warped, axis=1)[:, -7:].sum(axis=1))), abs=1e-5)
    # rollback: truncate and recompute gives the same rows
    cache.truncate(6)
    ids2, p2, _ = window_topk(head, span, cache, seq[6:], 6, rows=4, top_k=7, temperature=0.7, top_p=0.9)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_allclose(p2, p, atol=1e-6)


@pytest.fixture(scope="module")
def two_worker_dists(whole):
    """Full warped distributions of two different tiny models (same vocabulary) at a few temperatures."""
    _, head, span, _ = whole
    other = make_tiny_model("qwen2", seed=3, layers=2)
    seq = torch.tensor([[1, 17, 42, 99, 5, 250, 3, 3, 8, 9, 10, 11]])
    with torch.no_grad():
        logits_a = head.logits(span(head.embed(seq), 0, span.new_cache()))[0]
        logits_b = other(input_ids=seq).logits[0]
    out = {}
    for t in (0.5, 1.0, 1.5):
        ps = [warp(lg, SamplingParams(temperature=t)).double().numpy() for lg in (logits_a, logits_b)]
        out[t] = [p / p.sum(axis=1, keepdims=True) for p in ps]  # float32 rows sum to 1 only within 1e-7
    return out


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, V), t=st.sampled_from([0.5, 1.0, 1.5]), w=st.floats(0.05, 0.95))
def test_aggregation_bias_is_within_two_mean_eps_and_residual_beats_renormalize(two_worker_dists, k: int, t: float, w: float) -> None:
    """On real model distributions: ||p_hat - p||_1 <= 2 * weighted mean eps, per position, for both
    reconstructions, and per worker residual redistribution is never worse than renormalisation.
    (After averaging, the renormalised errors of different workers can partly cancel, so the
    aggregate's residual bias is not always the lower one: bench/federated.py measures both.)"""
    dists = two_worker_dists[t]
    weights = [w, 1 - w]
    exact = aggregate(dists, weights)
    eps_bar = np.zeros(exact.shape[0])
    rebuilt = {"renormalize": [], "residual": []}
    for wi, d in zip(weights, dists, strict=True):
        ids = np.argsort(-d, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(d, ids, axis=1)
        eps = 1 - top.sum(axis=1)
        eps_bar += wi * eps
        for method in rebuilt:
            rebuilt[method].append(reconstruct(ids, top, V, method))
        local = {m: np.abs(r[-1] - d).sum(axis=1) for m, r in rebuilt.items()}
        np.testing.assert_allclose(local["renormalize"], 2 * eps, atol=1e-9)
        assert np.all(local["residual"] <= local["renormalize"] + 1e-12)
    bias = {m: np.abs(aggregate(r, weights) - exact).sum(axis=1) for m, r in rebuilt.items()}
    for m in bias:
        assert np.all(bias[m] <= 2 * eps_bar + 1e-9), m


def _info(peer: str, vocab: int = V) -> WorkerInfo:
    return WorkerInfo(peer, ("/ip4/127.0.0.1/tcp/1",), 5, vocab, vocab, model="m")


def test_backend_refuses_bad_configurations() -> None:
    kw = dict(vocab_size=V, params=SamplingParams(), max_len=64)
    with pytest.raises(FederatedError, match=r"worker b \(m\) has a vocabulary of 200 tokens, the server's has 300"):
        FederatedBackend(None, [_info("a"), _info("b", 200)], **kw)  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match="2 weights for 1 workers"):
        FederatedBackend(None, [_info("a")], weights=[1, 2], **kw)  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match="weights must be finite"):
        FederatedBackend(None, [_info("a"), _info("b")], weights=[0, 0], **kw)  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match="--reconstruct must be one of"):
        FederatedBackend(None, [_info("a")], method="mean", **kw)  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match=r"--topk must be in \[1, 300\]"):
        FederatedBackend(None, [_info("a")], top_k=301, **kw)  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match="at least one worker"):
        FederatedBackend(None, [], **kw)  # type: ignore[arg-type]
    with pytest.raises(FederatedError, match="listed twice"):
        FederatedBackend(None, [_info("a"), _info("a")], **kw)  # type: ignore[arg-type]


def test_engine_verifies_greedy_against_probabilities(whole, tiny_qwen2_dir) -> None:
    """A probability backend at temperature 0: the engine's output is the model's greedy output."""
    from transformers import AutoModelForCausalLM

    store, _, _, _ = whole
    prompt = [1, 17, 42, 99, 5, 17, 42]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    backend = ProbsBackend(store.load_head(), [store.load_span(0, store.num_layers)], 0.0)
    drafter = ModelDrafter(make_tiny_model("qwen2", seed=9, layers=2), SamplingParams())
    result = trio.run(HeadEngine(backend, drafter, GenerationConfig(mode="dsd", max_new_tokens=16)).run, prompt)
    assert result.tokens == want[0, len(prompt):].tolist()
    assert result.drafted > result.accepted  # the random drafter was corrected


def test_engine_with_self_draft_accepts_everything_when_sampling_from_probabilities(whole) -> None:
    """Sampling at temperature 0.8: the target's probabilities arrive already warped and the engine
    verifies at temperature 1; a drafter equal to the target (same warp) is then always accepted.
    Verifying a second time at 0.8 would sharpen p and reject drafts."""
    store, _, _, full = whole
    params = SamplingParams(temperature=0.8)
    backend = ProbsBackend(store.load_head(), [store.load_span(0, store.num_layers)], 0.8)
    drafter = ModelDrafter(full, params)
    cfg = GenerationConfig(mode="sd", max_new_tokens=24, params=params, gamma=4, seed=2)
    result = trio.run(HeadEngine(backend, drafter, cfg).run, [1, 17, 42, 99])
    assert len(result.tokens) == 24
    assert result.drafted > 0 and result.acceptance_rate > 0.97


def test_a_seed_fixes_the_text_over_probability_rows_too(whole) -> None:
    """Probability rows go through the same Gumbel-max rule on their log: `ar`, `sd` with chains and `dsd` with
    trees (an unrelated random draft) give, for one seed, the target's own draws from its probabilities."""
    store, _, _, full = whole
    params = SamplingParams(temperature=0.8)
    prompt, n, seed = [1, 17, 42, 99], 16, 5
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            probs = warp(full(torch.tensor([seq])).logits[0, -1].float(), params)  # as a worker sends them
            seq.append(coupled_token(torch.log(probs), SamplingParams(temperature=1.0), gumbel(seed, len(seq), V)))
    draft = make_tiny_model("qwen2", seed=9, layers=2)
    for mode, tree_nodes in (("ar", 0), ("sd", 0), ("dsd", 8)):
        backend = ProbsBackend(store.load_head(), [store.load_span(0, store.num_layers)], 0.8)
        drafter = None if mode == "ar" else ModelDrafter(draft, params)
        cfg = GenerationConfig(mode=mode, max_new_tokens=n, params=params, seed=seed, tree_nodes=tree_nodes)
        result = trio.run(HeadEngine(backend, drafter, cfg).run, prompt)
        assert result.tokens == seq[len(prompt):], mode
        assert (result.tree_windows > 0) == bool(tree_nodes)


def test_top_p_applies_to_the_aggregate_after_the_workers_temperature(whole) -> None:
    """Workers send temperature-only distributions; the engine applies top-p to the aggregate: every
    sampled token lies in the aggregate's nucleus (ignoring top-p would sample outside it)."""
    store, _, _, _ = whole
    prompt = [1, 17, 42, 99]
    params = SamplingParams(temperature=1.5, top_p=0.3)
    backend = ProbsBackend(store.load_head(), [store.load_span(0, store.num_layers)], 1.5)
    with torch.inference_mode():
        logits = backend.head.logits(backend._run(prompt, 0, 0)[-1:].unsqueeze(0))[0, -1]
    nucleus = set(torch.nonzero(warp(logits, params) > 0).flatten().tolist())
    assert 1 <= len(nucleus) < 50  # a real cut of the 300-token vocabulary
    seen = set()
    for seed in range(40):
        backend = ProbsBackend(store.load_head(), [store.load_span(0, store.num_layers)], 1.5)
        cfg = GenerationConfig(mode="ar", max_new_tokens=1, params=params, seed=seed)
        seen.add(trio.run(HeadEngine(backend, None, cfg).run, prompt).tokens[0])
    assert seen <= nucleus, sorted(seen - nucleus)
