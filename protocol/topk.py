"""Top-K distributions (SpecFed): pick the K most likely tokens, pack their ids, rebuild and average.

On the wire the ids of each position are sorted ascending and sent either as uint32,
as varint gaps (first id, then id[i] - id[i-1] - 1), which costs about log128(V/K)
bytes per id, or not at all (`dense`: the ids are exactly 0..K-1, the K = V case);
the probabilities travel as a WireTensor aligned with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from .errors import LIMIT, ProtocolError
from .limits import MAX_POSITION

ID_CODECS = ("varint", "uint32", "dense")
RECONSTRUCT_METHODS = ("renormalize", "residual")
# Rounding (fp16 probabilities) may push a top-K mass a little above 1; beyond this it is renormalised.
MASS_TOLERANCE = 1e-9


def topk_from_probs(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `probs` [n, V], the `k` most likely ids (int64, by probability desc, ties by id) and their probs (float32)."""
    p = np.asarray(probs)
    if p.ndim != 2 or p.dtype.kind != "f":
        raise ValueError(f"probs must be a float array [positions, vocab], got {p.dtype} of shape {p.shape}")
    n, vocab = p.shape
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int in [1, {vocab}], got {k!r}")
    k = int(k)
    if k == vocab:
        cand = np.broadcast_to(np.arange(vocab), (n, vocab))
    else:
        cand = np.argpartition(-p, k - 1, axis=1)[:, :k]
    cp = np.take_along_axis(p, cand, axis=1)
    order = np.lexsort((cand, -cp), axis=-1)
    ids = np.take_along_axis(cand, order, axis=1).astype(np.int64)
    return ids, np.take_along_axis(cp, order, axis=1).astype(np.float32)


def sort_by_prob(ids: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder each row by probability descending, ties by id ascending."""
    order = np.lexsort((ids, -probs), axis=-1)
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(probs, order, axis=1)


def is_dense(ids: np.ndarray) -> bool:
    """True when every row of `ids` [n, k] is exactly 0..k-1 (the K = V case)."""
    a = np.asarray(ids)
    return a.ndim == 2 and bool(np.all(a == np.arange(a.shape[1])))


def encode_ids(ids: np.ndarray, codec: str = "varint") -> bytes:
    """Pack ids [n, k] that ascend strictly within each row, as `varint` gaps, `uint32` or `dense` (0..k-1)."""
    a = np.asarray(ids)
    if a.ndim != 2 or a.dtype.kind not in "iu":
        raise ProtocolError(f"must be an int array [positions, k], got {a.dtype} of shape {a.shape}", "ids")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() > MAX_POSITION):
        raise ProtocolError(f"token ids must be in [0, {MAX_POSITION}]", "ids")
    if a.shape[1] > 1 and np.any(np.diff(a, axis=1) <= 0):
        raise ProtocolError("ids must ascend strictly within each position", "ids")
    if codec == "uint32":
        return a.astype("<u4").tobytes()
    if codec == "dense":
        if not is_dense(a):
            raise ProtocolError("the dense id codec needs every position's ids to be exactly 0..k-1", "ids")
        return b""
    if codec != "varint":
        raise ProtocolError(f"unknown id codec {codec!r} (known: {', '.join(ID_CODECS)})", "id_codec")
    gaps = a.copy()
    gaps[:, 1:] = np.diff(a, axis=1) - 1
    v = gaps.reshape(-1).astype(np.uint64)
    lens = np.ones(v.size, dtype=np.int64)
    for bits in (7, 14, 21, 28):
        lens += v >= np.uint64(1 << bits)
    offsets = np.cumsum(lens) - lens
    out = np.zeros(int(lens.sum()), dtype=np.uint8)
    for j in range(5):
        m = lens > j
        if not m.any():
            break
        byte = (v[m] >> np.uint64(7 * j)) & np.uint64(0x7F)
        cont = (lens[m] > j + 1).astype(np.uint64) << np.uint64(7)
        out[offsets[m] + j] = (byte | cont).astype(np.uint8)
    return out.tobytes()


def decode_ids(data: bytes, n: int, k: int, codec: str, field: str = "ids") -> np.ndarray:
    """Unpack `n` x `k` ids written by `encode_ids`; anything malformed is a ProtocolError naming `field`."""
    count = n * k
    if codec == "dense":
        if data:
            raise ProtocolError(f"dense ids carry no bytes, got {len(data)}", field)
        return np.tile(np.arange(k, dtype=np.int64), (n, 1))
    if codec == "uint32":
        if len(data) != 4 * count:
            raise ProtocolError(f"{len(data)} bytes, expected {4 * count} for {n}x{k} uint32 ids", field)
        ids = np.frombuffer(data, dtype="<u4", count=count).astype(np.int64).reshape(n, k)
        if ids.size and ids.max() > MAX_POSITION:
            raise ProtocolError(f"token ids must be in [0, {MAX_POSITION}]", field)
        if k > 1 and np.any(np.diff(ids, axis=1) <= 0):
            raise ProtocolError("ids must ascend strictly within each position", field)
        return ids
    if codec != "varint":
        raise ProtocolError(f"unknown id codec {codec!r} (known: {', '.join(ID_CODECS)})", "id_codec")
    if not count <= len(data) <= 5 * count:
        raise ProtocolError(f"{len(data)} bytes cannot hold {count} varints", field, LIMIT)
    b = np.frombuffer(data, dtype=np.uint8)
    last = (b & 0x80) == 0
    ends = np.flatnonzero(last)
    if ends.size != count or (b.size and not last[-1]):
        raise ProtocolError(f"expected exactly {count} varints", field)
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts + 1
    if lens.size and (lens.max() > 5 or np.any((lens > 1) & (b[ends] == 0))):
        raise ProtocolError("varint longer than needed", field)
    v = np.zeros(count, dtype=np.int64)
    for j in range(5):
        m = lens > j
        if not m.any():
            break
        v[m] |= (b[starts[m] + j] & 0x7F).astype(np.int64) << (7 * j)
    ids = np.cumsum(v.reshape(n, k) + 1, axis=1) - 1
    if ids.size and ids.max() > MAX_POSITION:
        raise ProtocolError(f"token ids must be in [0, {MAX_POSITION}]", field)
    return ids


def _check_topk(ids: np.ndarray, p: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids)
    p = np.asarray(p)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ProtocolError(f"must be an int array [positions, k], got {ids.dtype} of shape {ids.shape}", "ids")
    if p.shape != ids.shape or p.dtype.kind != "f":
        raise ProtocolError(f"must be a float array of the ids' shape {ids.shape}, got {p.dtype} {p.shape}", "probs")
    if ids.shape[1] > vocab_size:
        raise ProtocolError(f"k = {ids.shape[1]} exceeds the vocabulary size {vocab_size}", "ids")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ProtocolError(f"token ids must be in [0, {vocab_size})", "ids")
    if ids.shape[1] > 1 and np.any(np.diff(np.sort(ids, axis=1), axis=1) == 0):
        raise ProtocolError("a position repeats a token id", "ids")
    p = p.astype(np.float64)
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ProtocolError("probabilities must be finite and in [0, 1]", "probs")
    return ids.astype(np.int64), p


def reconstruct(
    ids: np.ndarray,
    p: np.ndarray,
    vocab_size: int,
    method: Literal["renormalize", "residual"] = "residual",
) -> np.ndarray:
    """Rebuild full distributions [n, vocab_size] (float64, rows sum to 1) from top-K ids and probs.

    `renormalize` scales the K probabilities to sum to 1 (l1 error exactly 2 eps);
    `residual` keeps them and spreads the missing mass eps evenly over the other V - K
    tokens (l1 error <= 2 eps). A top-K mass off by more than MASS_TOLERANCE in the
    impossible direction (above 1, or below 1 when K == V: rounding) is renormalised.
    """
    if method not in RECONSTRUCT_METHODS:
        raise ValueError(f"method must be one of {RECONSTRUCT_METHODS}, got {method!r}")
    ids, p = _check_topk(ids, p, vocab_size)
    n, k = ids.shape
    mass = p.sum(axis=1)
    out = np.zeros((n, int(vocab_size)), dtype=np.float64)
    if method == "renormalize" or k == vocab_size:
        if np.any(mass <= 0):
            raise ProtocolError("a position's top-K mass is zero; cannot renormalize", "probs")
    if method == "renormalize":
        np.put_along_axis(out, ids, p / mass[:, None], axis=1)
        return out
    # With K == V there is nowhere to put a missing mass, so rounding is renormalised both ways.
    off = np.abs(mass - 1.0) > MASS_TOLERANCE if k == vocab_size else mass > 1.0 + MASS_TOLERANCE
    if off.any():
        p = np.where(off[:, None], p / mass[:, None], p)
        mass = np.where(off, 1.0, mass)
    if k < vocab_size:
        out += (np.clip(1.0 - mass, 0.0, None) / (vocab_size - k))[:, None]
    np.put_along_axis(out, ids, p, axis=1)
    return out


def aggregate(dists: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Weighted average of distributions of equal shape [n, V]; weights are renormalised to sum to 1."""
    if len(dists) == 0:
        raise ValueError("aggregate needs at least one distribution")
    if len(weights) != len(dists):
        raise ValueError(f"got {len(dists)} distributions but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {list(weights)}")
    shape = np.shape(dists[0])
    out = np.zeros(shape, dtype=np.float64)
    for i, (d, wi) in enumerate(zip(dists, w / w.sum(), strict=True)):
        if np.shape(d) != shape:
            raise ValueError(f"distribution {i} has shape {np.shape(d)}, expected {shape}")
        out += wi * np.asarray(d, dtype=np.float64)
    return out
