"""Top-K distributions: selection, id packing, reconstruction error (2 eps) and weighted aggregation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsd.protocol import (
    FrameDecoder,
    ProtocolError,
    TopKResult,
    aggregate,
    decode_ids,
    encode,
    encode_ids,
    reconstruct,
    topk_from_probs,
)

SETTINGS = settings(max_examples=200, deadline=None)


@st.composite
def distributions(draw: st.DrawFn) -> np.ndarray:
    """Random float64 distributions [n, V], from flat to very peaked, some with exact zeros."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, vocab = draw(st.integers(1, 5)), draw(st.integers(1, 400))
    logits = rng.standard_normal((n, vocab)) * draw(st.sampled_from([0.1, 1.0, 3.0, 8.0]))
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    if draw(st.booleans()):
        p[rng.random(p.shape) < 0.3] = 0.0
        p[:, 0] += 1e-3
    return p / p.sum(axis=1, keepdims=True)


@SETTINGS
@given(p=distributions(), data=st.data())
def test_topk_picks_the_largest_sorted_desc(p: np.ndarray, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, p.shape[1]))
    ids, q = topk_from_probs(p, k)
    assert ids.shape == q.shape == (p.shape[0], k) and ids.dtype == np.int64 and q.dtype == np.float32
    for row in range(p.shape[0]):
        assert len(set(ids[row].tolist())) == k
        np.testing.assert_array_equal(q[row], p[row, ids[row]].astype(np.float32))
        assert np.all(np.diff(p[row, ids[row]]) <= 0)
        # nothing left out beats the smallest kept
        rest = np.delete(p[row], ids[row])
        assert rest.size == 0 or rest.max() <= p[row, ids[row][-1]]


@SETTINGS
@given(p=distributions(), data=st.data())
def test_renormalize_l1_is_exactly_two_eps(p: np.ndarray, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, p.shape[1]))
    ids, _ = topk_from_probs(p, k)
    top = np.take_along_axis(p, ids, axis=1)
    eps = 1.0 - top.sum(axis=1)
    q = reconstruct(ids, top, p.shape[1], "renormalize")
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(np.abs(q - p).sum(axis=1), 2 * eps, rtol=0, atol=1e-9)


@SETTINGS
@given(p=distributions(), data=st.data())
def test_residual_l1_at_most_two_eps(p: np.ndarray, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, p.shape[1]))
    ids, _ = topk_from_probs(p, k)
    top = np.take_along_axis(p, ids, axis=1)
    eps = np.clip(1.0 - top.sum(axis=1), 0, None)
    q = reconstruct(ids, top, p.shape[1], "residual")
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-12)
    l1 = np.abs(q - p).sum(axis=1)
    assert np.all(l1 <= 2 * eps + 1e-12)
    # the kept probabilities are untouched, the rest share eps evenly
    np.testing.assert_array_equal(np.take_along_axis(q, ids, axis=1), top)
    if k < p.shape[1]:
        others = np.ones_like(q, dtype=bool)
        np.put_along_axis(others, ids, False, axis=1)
        rest = q[others].reshape(len(q), -1)
        np.testing.assert_allclose(rest, np.broadcast_to((eps / (p.shape[1] - k))[:, None], rest.shape), rtol=1e-12)
    # residual is never further from the truth than renormalisation (SpecFed)
    assert np.all(l1 <= np.abs(reconstruct(ids, top, p.shape[1], "renormalize") - p).sum(axis=1) + 1e-12)


@SETTINGS
@given(p=distributions())
def test_k_equal_v_reproduces_the_distribution(p: np.ndarray) -> None:
    vocab = p.shape[1]
    ids, _ = topk_from_probs(p, vocab)
    top = np.take_along_axis(p, ids, axis=1)
    np.testing.assert_array_equal(reconstruct(ids, top, vocab, "residual"), p)
    np.testing.assert_allclose(reconstruct(ids, top, vocab, "renormalize"), p, rtol=1e-12, atol=0)


@SETTINGS
@given(ps=st.lists(distributions(), min_size=1, max_size=4), data=st.data())
def test_aggregate_weights_and_bias_bound(ps: list[np.ndarray], data: st.DataObject) -> None:
    n, vocab = ps[0].shape
    ps = [p[:n, :vocab] / p[:n, :vocab].sum(axis=1, keepdims=True) for p in ps if p.shape[0] >= n and p.shape[1] >= vocab]
    ws = data.draw(st.lists(st.floats(0.01, 10), min_size=len(ps), max_size=len(ps)))
    rebuilt, eps = [], []
    for p in ps:
        k = data.draw(st.integers(1, vocab))
        ids, _ = topk_from_probs(p, k)
        top = np.take_along_axis(p, ids, axis=1)
        rebuilt.append(reconstruct(ids, top, vocab, "residual"))
        eps.append(np.clip(1 - top.sum(axis=1), 0, None))
    w = np.array(ws) / sum(ws)
    agg = aggregate(rebuilt, ws)
    np.testing.assert_allclose(agg, sum(wi * r for wi, r in zip(w, rebuilt, strict=True)), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(agg.sum(axis=1), 1.0, atol=1e-12)
    truth = aggregate(ps, ws)
    bound = 2 * sum(wi * e for wi, e in zip(w, eps, strict=True))
    assert np.all(np.abs(agg - truth).sum(axis=1) <= bound + 1e-12)


def test_aggregate_refuses_bad_weights_and_shapes() -> None:
    a = np.full((1, 4), 0.25)
    with pytest.raises(ValueError, match="weights"):
        aggregate([a, a], [1.0])
    with pytest.raises(ValueError, match="weights"):
        aggregate([a, a], [0.0, 0.0])
    with pytest.raises(ValueError, match="weights"):
        aggregate([a], [-1.0])
    with pytest.raises(ValueError, match="shape"):
        aggregate([a, np.full((1, 5), 0.2)], [1, 1])
    np.testing.assert_array_equal(aggregate([a, np.eye(4)[:1]], [3, 1]), [[0.25 * 0.75 + 0.25, 0.1875, 0.1875, 0.1875]])


def test_reconstruct_refuses_bad_input() -> None:
    with pytest.raises(ProtocolError) as ei:
        reconstruct(np.array([[0, 10]]), np.array([[0.5, 0.2]]), 10, "residual")
    assert ei.value.field == "ids"
    with pytest.raises(ProtocolError, match="repeats"):
        reconstruct(np.array([[3, 3]]), np.array([[0.5, 0.2]]), 10, "residual")
    with pytest.raises(ProtocolError) as ei:
        reconstruct(np.array([[0, 1]]), np.array([[0.5, np.nan]]), 10, "residual")
    assert ei.value.field == "probs"
    with pytest.raises(ProtocolError, match="zero"):
        reconstruct(np.array([[0, 1]]), np.array([[0.0, 0.0]]), 10, "renormalize")
    with pytest.raises(ValueError, match="method"):
        reconstruct(np.array([[0]]), np.array([[1.0]]), 10, "average")  # type: ignore[arg-type]


def test_residual_scales_down_a_rounded_mass_above_one() -> None:
    q = reconstruct(np.array([[0, 1]]), np.array([[0.7, 0.31]]), 4, "residual")
    np.testing.assert_allclose(q, [[0.7 / 1.01, 0.31 / 1.01, 0, 0]], rtol=1e-12)


@SETTINGS
@given(data=st.data(), codec=st.sampled_from(["varint", "uint32", "dense"]))
def test_id_codecs_round_trip(data: st.DataObject, codec: str) -> None:
    vocab = data.draw(st.sampled_from([5, 300, 151_936, 2**31]))
    n = data.draw(st.integers(1, 4))
    k = data.draw(st.integers(1, min(vocab, 60)))
    if codec == "dense":
        rows = [list(range(k))] * n
    else:
        rows = [sorted(data.draw(st.sets(st.integers(0, vocab - 1), min_size=k, max_size=k))) for _ in range(n)]
    ids = np.array(rows, dtype=np.int64)
    blob = encode_ids(ids, codec)
    np.testing.assert_array_equal(decode_ids(blob, n, k, codec), ids)
    assert len(blob) == {"uint32": 4 * n * k, "dense": 0}.get(codec, len(blob))


def test_dense_ids_cost_nothing_and_must_be_a_full_range() -> None:
    assert encode_ids(np.tile(np.arange(5), (3, 1)), "dense") == b""
    np.testing.assert_array_equal(decode_ids(b"", 3, 5, "dense"), np.tile(np.arange(5), (3, 1)))
    with pytest.raises(ProtocolError, match="dense"):
        encode_ids(np.array([[0, 2]]), "dense")
    with pytest.raises(ProtocolError, match="no bytes"):
        decode_ids(b"\x00", 1, 1, "dense")
    p = np.full((2, 6), 1 / 6)
    msg = TopKResult.build("s", 0, 0, *topk_from_probs(p, 6))
    assert msg.id_codec == "dense" and msg.ids == b""
    skewed = np.array([[0.05, 0.25, 0.2, 0.2, 0.15, 0.15]])
    assert TopKResult.build("s", 0, 0, *topk_from_probs(skewed, 5)).id_codec == "varint"  # ids 1..5
    assert TopKResult.build("s", 0, 0, *topk_from_probs(p, 5)).id_codec == "dense"  # ties by id: 0..4
    (got,) = FrameDecoder().feed(encode(msg))
    assert sorted(got.arrays()[0][0].tolist()) == list(range(6))
    with pytest.raises(ProtocolError, match="TopKResult.ids"):
        TopKResult("s", 0, 0, 6, b"\x01", msg.probs, "dense")


def test_varint_size_follows_gaps() -> None:
    assert len(encode_ids(np.arange(151_936)[None, :], "varint")) == 151_936  # K = V: every gap is 0
    assert encode_ids(np.array([[0, 127, 128 + 127 + 1]]), "varint") == bytes([0, 126, 0x80, 0x01])


@pytest.mark.parametrize(
    ("blob", "n", "k", "match"),
    [
        (bytes([0x80, 0x00]), 1, 1, "longer than needed"),  # non-minimal varint
        (bytes([0x80]), 1, 1, "exactly 1"),  # unterminated
        (bytes([1, 2, 3]), 1, 2, "exactly 2"),  # too many
        (bytes([0xFF] * 5 + [0x0F]), 1, 1, "longer than needed|cannot hold"),
        (bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F]), 1, 1, "token ids"),  # 2**32 - 1 > 2**31 - 1
        (b"", 1, 1, "cannot hold"),
    ],
)
def test_varint_decoder_refuses_malformed(blob: bytes, n: int, k: int, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_ids(blob, n, k, "varint")


def test_uint32_ids_must_ascend() -> None:
    with pytest.raises(ProtocolError, match="ascend"):
        decode_ids(np.array([5, 5], "<u4").tobytes(), 1, 2, "uint32")
    with pytest.raises(ProtocolError, match="ascend"):
        encode_ids(np.array([[7, 3]]), "uint32")


@pytest.mark.parametrize("prob_codec", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("id_codec", ["varint", "uint32"])
def test_topk_result_round_trip_through_frames(prob_codec: str, id_codec: str) -> None:
    rng = np.random.default_rng(1)
    logits = rng.gumbel(size=(6, 5000)) * 3
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids, top = topk_from_probs(p, 50)
    msg = TopKResult.build("s", 2, 40, ids, top, id_codec=id_codec, prob_codec=prob_codec, zstd=True)
    (got,) = FrameDecoder().feed(encode(msg))
    assert got == msg and got.positions == 6 and got.k == 50
    gids, gp = got.arrays()
    tol = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}[prob_codec]
    np.testing.assert_allclose(gp, top, rtol=tol, atol=2.0**-25 if tol else 0)
    # ids come back by probability desc; with exact probs the order is the sender's
    if prob_codec == "fp32":
        np.testing.assert_array_equal(gids, ids)
    else:
        assert [set(r) for r in gids.tolist()] == [set(r) for r in ids.tolist()]
        assert np.all(np.diff(gp, axis=1) <= 0)
