"""SpecFed's messages: a draft window broadcast to federated workers and their top-K answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from .checks import check_bytes, check_float, check_int, check_opt_int
from .errors import BAD_TENSOR, LIMIT, ProtocolError
from .fields import _check_tree, _epoch, _Field, _opt_pos, _pos, _session, _tokens, _tree_fields
from .limits import DEFAULT_LIMITS, Limits
from .messages import Message, _seq_field, _tensor_field
from .tensors import WireTensor, decode_tensor, encode_tensor
from .topk import ID_CODECS, decode_ids, encode_ids, is_dense, sort_by_prob


def _temperature(v: Any, f: str, lim: Limits) -> float:
    return float(check_float(v, f, 0.0, 1e4))


def _top_p(v: Any, f: str, lim: Limits) -> float:
    value = float(check_float(v, f, 0.0, 1.0))
    if value <= 0.0:
        raise ProtocolError(f"must be in (0, 1], got {value}", f)
    return value


def _top_k(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 1, lim.max_topk)


def _opt_rows(v: Any, f: str, lim: Limits) -> int | None:
    return check_opt_int(v, f, 1, lim.max_tokens_per_window)


@dataclass(frozen=True)
class DraftWindow(Message):
    """Federated mode: the server's drafted tokens at positions start..; workers answer with a TopKResult."""

    TYPE: ClassVar[str] = "draft_window"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _Field("commit", _opt_pos),
        _seq_field("tokens", _tokens),
        _Field("top_k", _top_k),
        _Field("temperature", _temperature),
        _Field("top_p", _top_p, optional=True),
        _Field("rows", _opt_rows, optional=True),
        *_tree_fields(),
    )
    session: str
    epoch: int
    start: int
    commit: int | None
    tokens: tuple[int, ...]
    top_k: int
    temperature: float
    top_p: float = 1.0
    rows: int | None = None  # answer only the last `rows` positions (a prefill needs one); None = all
    parents: tuple[int, ...] | None = None  # a token tree, as in Forward; rows then count nodes
    keep: tuple[int, ...] | None = None  # the accepted path of the previous window, as in Forward

    def _check_more(self, limits: Limits, prefix: str) -> None:
        if self.rows is not None and self.rows > len(self.tokens):
            raise ProtocolError(f"asks for {self.rows} rows of a {len(self.tokens)}-token window", f"{prefix}.rows")
        _check_tree(self.parents, self.keep, self.commit, len(self.tokens), "tokens", prefix)


def _id_codec(v: Any, f: str, lim: Limits) -> str:
    if v not in ID_CODECS:
        raise ProtocolError(f"must be one of {ID_CODECS}, got {v!r}", f)
    return v


def _ids_blob(v: Any, f: str, lim: Limits) -> bytes:
    if isinstance(v, bytearray | memoryview):
        v = bytes(v)
    return check_bytes(v, f, lim.max_frame_bytes)


PROB_CODECS = {"fp32": "raw", "fp16": "fp16", "bf16": "bf16"}


@dataclass(frozen=True)
class TopKResult(Message):
    """Federated mode: per position the K most likely token ids and their probabilities.

    `ids` is the packed id blob (see `topk.encode_ids`: ascending per position), `probs`
    a float tensor [positions, k] aligned with it. Build with `TopKResult.build`, read with `.arrays()`.
    """

    TYPE: ClassVar[str] = "topk_result"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _Field("k", _top_k),
        _Field("ids", _ids_blob),
        _tensor_field("probs"),
        _Field("id_codec", _id_codec, optional=True),
    )
    session: str
    epoch: int
    start: int
    k: int
    ids: bytes
    probs: WireTensor
    id_codec: str = "varint"

    def _check_more(self, limits: Limits, prefix: str) -> None:
        shape = self.probs.shape
        if len(shape) != 2 or shape[1] != self.k:
            raise ProtocolError(f"must have shape [positions, k={self.k}], got {list(shape)}", f"{prefix}.probs")
        if self.probs.dtype not in ("float16", "float32", "float64"):
            raise ProtocolError(f"must be a float tensor, got {self.probs.dtype}", f"{prefix}.probs.dtype")
        if not 1 <= shape[0] <= limits.max_tokens_per_window:
            raise ProtocolError(
                f"{shape[0]} positions (allowed 1..{limits.max_tokens_per_window})", f"{prefix}.probs", LIMIT
            )
        if self.id_codec == "dense":  # nothing to unpack; don't materialise n x k ids just to check
            if self.ids:
                raise ProtocolError(f"dense ids carry no bytes, got {len(self.ids)}", f"{prefix}.ids")
        else:
            decode_ids(self.ids, shape[0], self.k, self.id_codec, f"{prefix}.ids")

    @property
    def positions(self) -> int:
        """Number of positions (rows) this result covers."""
        return self.probs.shape[0]

    @classmethod
    def build(
        cls,
        session: str,
        epoch: int,
        start: int,
        ids: np.ndarray,
        probs: np.ndarray,
        *,
        id_codec: str = "auto",
        prob_codec: str = "fp16",
        zstd: bool = False,
    ) -> Self:
        """Pack top-K `ids` [n, k] and `probs` [n, k] (any order per row).

        id_codec 'varint', 'uint32', 'dense' or 'auto' (dense when the ids are all of 0..k-1, else
        varint); prob_codec 'fp16', 'bf16' or 'fp32'; `zstd` compresses the probabilities.
        """
        ids = np.asarray(ids)
        probs = np.asarray(probs)
        if ids.ndim != 2 or probs.shape != ids.shape:
            raise ProtocolError(f"ids {ids.shape} and probs {probs.shape} must both be [positions, k]", "ids")
        if not isinstance(prob_codec, str) or prob_codec not in PROB_CODECS:
            raise ProtocolError(f"must be one of {tuple(PROB_CODECS)}, got {prob_codec!r}", "prob_codec")
        order = np.argsort(ids, axis=1, kind="stable")
        sorted_ids = np.take_along_axis(ids, order, axis=1)
        sorted_p = np.take_along_axis(probs, order, axis=1).astype(np.float32)
        if id_codec == "auto":
            id_codec = "dense" if is_dense(sorted_ids) else "varint"
        wire_p = encode_tensor(sorted_p, PROB_CODECS[prob_codec], zstd)
        return cls(session, epoch, start, int(ids.shape[1]), encode_ids(sorted_ids, id_codec), wire_p, id_codec)

    def arrays(self, limits: Limits = DEFAULT_LIMITS) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [n, k], probs float32 [n, k]) sorted by probability desc; probs must lie in [0, 1]."""
        n = self.positions
        ids = decode_ids(self.ids, n, self.k, self.id_codec, "TopKResult.ids")
        p = decode_tensor(self.probs, limits).astype(np.float32)
        if np.any(p < 0) or np.any(p > 1):
            raise ProtocolError("probabilities must be in [0, 1]", "TopKResult.probs", BAD_TENSOR)
        return sort_by_prob(ids, p)
