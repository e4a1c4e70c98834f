"""The audit's pure rules: how far two runs of one window are apart, what tokens a route's peers hold before each
window (its context, which an audit replays elsewhere), and where two routes' spans can be compared."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsd.protocol import Hop

# Honest replicas differ by their precision (and by how their windows were batched) only, so the tolerance of an
# audit is that of the pair of precisions the two routes run in: the largest per-position distance two honest routes
# of that pair showed on the real target, times `TOLERANCE_MARGIN`, and never below `TOLERANCE_FLOOR`
# (bench/results/audit-calibration-2026-12-06.json, `python bench/integrity.py calibrate`; a test checks this table
# against that file). A route's precision is its least precise hop's (compute dtype, or the codec its rows leave in);
# "+int8" marks a pair where either route carries rows in the lossy int8 wire codec.
TOLERANCE_MARGIN = 1.75  # as the single tolerance before it had over the worst honest row (0.06 over 0.034)
TOLERANCE_FLOOR = 0.01  # fp32 kernels differ across CPUs and GPUs (TF32) beyond one machine; 4x below a 0.04 liar
AUDIT_TOLERANCES: dict[str, float] = {  # the calibration's tolerances, rounded up to 3 decimals
    "fp32/fp32": 0.01, "fp16/fp32": 0.01, "fp16/fp16": 0.01, "bf16/fp32": 0.063, "bf16/fp16": 0.064,
    "bf16/bf16": 0.051, "fp32/fp32+int8": 0.062, "fp16/fp32+int8": 0.062, "fp16/fp16+int8": 0.06,
    "bf16/fp32+int8": 0.087, "bf16/fp16+int8": 0.092, "bf16/bf16+int8": 0.088,
}
PRECISIONS = ("bf16", "fp16", "fp32")  # least precise first
_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_OF_CODEC = {"bf16": "bf16", "fp16": "fp16"}  # raw keeps the dtype's precision; int8 is lossy (the "+int8" pairs)


@dataclass(frozen=True)
class Precision:
    """How precisely a route computes and carries its rows: its least precise hop, and whether any hop puts them on
    the wire in the lossy int8 codec."""

    name: str
    lossy: bool = False

    @classmethod
    def of_route(cls, hops: Sequence[tuple[str, str]]) -> Precision:
        """From each hop's (compute dtype, wire codec; "" unknown: its dtype's exact codec). The head's own codec
        does not count: both routes of an audit get the same input rows. An unknown dtype counts as the least
        precise (an honest peer is never judged by too tight a tolerance)."""
        names = [_OF_DTYPE.get(dtype, PRECISIONS[0]) for dtype, _ in hops]
        names += [_OF_CODEC[codec] for _, codec in hops if codec in _OF_CODEC]
        return cls(min(names or ["fp32"], key=PRECISIONS.index), any(codec == "int8" for _, codec in hops))


def precision_pair(a: Precision, b: Precision) -> str:
    """The calibration's key of two routes' precisions: "bf16/fp32", "fp32/fp32+int8", …"""
    low, high = sorted((a.name, b.name), key=PRECISIONS.index)
    return f"{low}/{high}" + ("+int8" if a.lossy or b.lossy else "")


# Position 0 (the attention sink: a few huge activations) is not compared: honest bfloat16 moves its final row by up
# to 0.116 on the real target, and that row feeds no logit a generation uses (it predicts the prompt's second
# token); a lie there that changes what later positions attend to shows in their rows.
SINK = 1

# One window in ten: a peer that lies on every window is caught within 44 windows with probability 0.99
# ((1 - 0.1) ** 44 < 0.01) — a few hundred tokens — while the replicas recompute each token once plus a tenth of
# the windows (bench/integrity.py measures what that costs).
DEFAULT_AUDIT_RATE = 0.1


def row_gaps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per position (row): ||a − b|| / max(||a||, ||b||) — symmetric (neither run is the reference), in [0, 2]."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare rows of shape {list(a.shape)} with {list(b.shape)}")
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.maximum(np.linalg.norm(a64, axis=-1), np.linalg.norm(b64, axis=-1))
    return np.linalg.norm(a64 - b64, axis=-1) / np.maximum(scale, 1e-12)


@dataclass(frozen=True)
class Comparison:
    """Two runs of the same rows, position by position, against a tolerance."""

    gaps: np.ndarray
    tolerance: float

    offset: int = 0  # the absolute position of the first row compared

    @classmethod
    def of(cls, a: np.ndarray, b: np.ndarray, tolerance: float, start: int = 0) -> Comparison:
        """Rows `a` and `b` at absolute positions start.., the first `SINK` positions of a sequence left out."""
        skip = max(0, SINK - start)
        return cls(row_gaps(a[skip:], b[skip:]), tolerance, start + skip)

    @property
    def agree(self) -> bool:
        return bool((self.gaps <= self.tolerance).all())

    @property
    def largest(self) -> float:
        return float(self.gaps.max()) if self.gaps.size else 0.0

    def evidence(self) -> dict[str, Any]:
        """The positions beyond the tolerance (absolute) and their distances, for logs and `--json`."""
        over = np.flatnonzero(self.gaps > self.tolerance)
        return {"positions": [int(self.offset + i) for i in over[:32]], "distances": [round(float(self.gaps[i]), 4)
                for i in over[:32]], "positions_over": int(over.size), "positions_compared": int(self.gaps.size),
                "max_distance": round(self.largest, 4), "tolerance": self.tolerance}


class HeldTokens:
    """The tokens a route's peers hold, position by position, as windows are sent: each window first commits
    (truncates to `commit`, or keeps the path `keep` of the last tree window), then appends its own rows. What
    lies before a window's start is its context: what an audit must replay before running the window elsewhere."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._tree: list[int] | None = None  # the nodes of the last window, when it was a tree

    def context(self, start: int, commit: int | None, keep: Sequence[int] | None = None) -> list[int]:
        """The tokens at positions 0..start-1 once a window at `start` has committed (`commit`, or `keep`)."""
        if keep:
            if self._tree is None or commit is None:
                raise ValueError("keep names the path of a tree window, and none was sent")
            held = self.tokens[:commit] + [self._tree[i] for i in keep]
        else:
            held = self.tokens if commit is None else self.tokens[:commit]
        if start > len(held):
            raise ValueError(f"a window at position {start}, but the peers hold {len(held)} tokens")
        return held[:start]

    def sent(
        self, tokens: Sequence[int], start: int, commit: int | None, parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> list[int]:
        """Note a window sent at `start`; returns its context (`context`)."""
        context = self.context(start, commit, keep)
        self.tokens = context + list(tokens)
        self._tree = list(tokens) if parents is not None else None
        return context


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class Segment:
    """Layers [start, end) that one hop of each route serves: where the two routes can be compared."""

    start: int
    end: int
    route: Hop  # the audited route's hop serving these layers
    replica: Hop  # the replica route's hop serving them


def segments(route: Sequence[Hop], replica: Sequence[Hop]) -> list[Segment]:
    """The two routes cut at every boundary of either, in layer order (both must cover the same layers)."""
    if (route[0].start, route[-1].end) != (replica[0].start, replica[-1].end):
        raise ValueError(f"the routes cover {route[0].start}:{route[-1].end} and {replica[0].start}:{replica[-1].end}")
    cuts = sorted({h.start for h in route} | {h.end for h in route} | {h.start for h in replica} | {h.end for h in replica})

    def serving(hops: Sequence[Hop], a: int) -> Hop:
        return next(h for h in hops if h.start <= a < h.end)

    return [Segment(a, b, serving(route, a), serving(replica, a)) for a, b in zip(cuts, cuts[1:], strict=False)]


def replicas_announced(records: Sequence[Any], avoid: set[str], blocks: tuple[int, int], num_layers: int) -> bool:
    """Do block records of peers outside `avoid` cover every layer of `blocks`? Only then is a replica route worth
    waiting for (records and probes can lag); a swarm with one peer per span is told at once that there is none."""
    covered = [False] * num_layers
    for r in records:
        if r.role == "block" and r.peer_id not in avoid:
            for layer in range(max(0, r.start), min(num_layers, r.end)):
                covered[layer] = True
    return all(covered[blocks[0] : blocks[1]])
