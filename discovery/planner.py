"""Route planning over announced spans and measured RTTs (pure functions: no trio, no libp2p).

Round-time model for a window of `window_tokens` tokens over hops h1..hN (ring: the
head sends to h1, each hop forwards to the next, hN returns to the head):

  link head->h1 = rtt(h1)/2 and hN->head = rtt(hN)/2, measured by the head;
  link hi->hj is not measured: it is estimated as (rtt(hi) + rtt(hj)) / 4, the mean of
    the two peers' one-way latencies to the head (exact when every link costs the same,
    as in the emulated WAN, and between the bounds |d(H,i) - d(H,j)| and d(H,i) + d(H,j));
  compute at a hop serving b of its n announced blocks = window_tokens * b / (n * throughput)
    (throughput is tokens/s through the peer's whole span);
  + hop_overhead_s per hop, + a low-cache penalty growing linearly from 0 at
    `cache_headroom_tokens` free tokens to `low_cache_penalty_s` at none,
  + the wait for the work already on the peer (`PeerRecord.wait_s`, from the load it announces),
    so of two replicas the less loaded one is preferred.

A route holds one weight format (`PeerRecord.weight_format`: fp32, bf16, fp16, int8, int4), so its output is the
output of one model: `weights` names it, or (None) the format whose best route is cheapest is taken; "any" lets a
route mix formats, "float" the float ones (fp32, bf16, fp16: what an audit of a float route may compare with, at
its precision pair's tolerance).

Every term depends only on (peer, first block, last block) of a hop, so the cheapest
route is a shortest path over block boundaries 0..num_layers (Dijkstra, as Petals does);
a head that serves the first or the last layers itself (`generate --blocks A:B`) has only
the others routed: `blocks` = (start, end), and the ring leaves and reaches the head at
those boundaries (`remote_blocks` says which range that is);
a peer may serve any sub-range of its span. Ties (within 1 ns) go to fewer hops. A peer
can appear twice on a route only if it serves two disjoint sub-ranges and that is
strictly cheaper (each appearance is its own hop / session).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .records import FLOAT_FORMATS, PeerRecord

TIE_NS = 1.0  # costs equal within a nanosecond count as a tie


class NoRouteError(Exception):
    """No combination of eligible peers covers every block; `missing_blocks` lists the uncovered ones."""

    def __init__(self, missing_blocks: list[int], num_layers: int, excluded: Mapping[str, str] | None = None,
                 hint: str = "") -> None:
        self.missing_blocks = list(missing_blocks)
        self.num_layers = num_layers
        self.excluded = dict(excluded or {})
        self.hint = hint
        msg = f"no live peer serves blocks {format_blocks(self.missing_blocks)} (of {num_layers})"
        if self.excluded:
            msg += f"; {len(self.excluded)} peer(s) excluded: " + ", ".join(
                f"{pid[-8:]} ({why})" for pid, why in sorted(self.excluded.items())
            )
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)


def format_blocks(blocks: Iterable[int]) -> str:
    """Compact ranges: [1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    run: list[int] = []
    for b in sorted(set(blocks)):
        if run and b == run[-1] + 1:
            run.append(b)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [b]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


@dataclass(frozen=True)
class RouteHop:
    """One hop of a route: the peer, the sub-range [start, end) it serves, and its share of the cost."""

    record: PeerRecord
    start: int
    end: int
    link_in_s: float  # this hop's share of the link into it
    compute_s: float
    penalty_s: float  # hop overhead + low-cache penalty
    link_out_s: float  # this hop's share of the link out of it

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    @property
    def addrs(self) -> tuple[str, ...]:
        return self.record.addrs

    @property
    def cost_s(self) -> float:
        return self.link_in_s + self.compute_s + self.penalty_s + self.link_out_s

    def to_protocol(self) -> Any:
        """This hop as a `dsd.protocol.Hop` (what OpenSession routes carry)."""
        from dsd.protocol import Hop

        return Hop(self.peer_id, tuple(self.addrs), self.start, self.end)


@dataclass(frozen=True)
class RoutePlan:
    """The chosen route and why: its hops in order, the estimated round time and its breakdown."""

    hops: tuple[RouteHop, ...]
    est_round_s: float
    window_tokens: int
    num_layers: int
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def peers(self) -> list[str]:
        return [h.peer_id for h in self.hops]

    def breakdown(self) -> dict[str, float]:
        """Seconds spent on links, on compute, and on hop overheads plus low-cache penalties."""
        return {
            "links_s": sum(h.link_in_s + h.link_out_s for h in self.hops),
            "compute_s": sum(h.compute_s for h in self.hops),
            "overhead_and_penalty_s": sum(h.penalty_s for h in self.hops),  # hop overheads, low cache, load
        }

    def explain(self) -> str:
        """A human-readable account of the route."""
        lines = [f"route over {len(self.hops)} hop(s), est. round {self.est_round_s * 1000:.2f} ms "
                 f"for a {self.window_tokens}-token window"]
        for h in self.hops:
            lines.append(
                f"  {h.peer_id[-12:]} blocks {h.start}:{h.end}  in {h.link_in_s * 1000:.2f} ms  "
                f"compute {h.compute_s * 1000:.2f} ms  penalty {h.penalty_s * 1000:.2f} ms  "
                f"out {h.link_out_s * 1000:.2f} ms"
            )
        for pid, why in sorted(self.excluded.items()):
            lines.append(f"  excluded {pid[-12:]}: {why}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "hops": [
                {"peer_id": h.peer_id, "addrs": list(h.addrs), "start": h.start, "end": h.end,
                 "link_in_s": h.link_in_s, "compute_s": h.compute_s, "penalty_s": h.penalty_s,
                 "link_out_s": h.link_out_s}
                for h in self.hops
            ],
            "est_round_s": self.est_round_s,
            "window_tokens": self.window_tokens,
            "breakdown": self.breakdown(),
            "excluded": dict(self.excluded),
        }

    def protocol_hops(self) -> list[Any]:
        """The hops as `dsd.protocol.Hop`s, in route order."""
        return [h.to_protocol() for h in self.hops]


def remote_blocks(local: tuple[int, int], num_layers: int) -> tuple[int, int]:
    """The blocks [start, end) a route must cover when the head serves `local` = [a, b) itself.

    The head's span must be the model's first layers (a = 0: the route serves b..num_layers) or
    its last ones (b = num_layers: the route serves 0..a), and leave some layers to route.
    """
    a, b = local
    if not 0 <= a < b <= num_layers:
        raise ValueError(f"blocks {a}:{b}: need 0 <= START < END <= {num_layers} (the model has {num_layers} layers)")
    if (a, b) == (0, num_layers):
        raise ValueError(f"blocks {a}:{b} are every layer: nothing would be left to route over block peers")
    if a != 0 and b != num_layers:
        raise ValueError(f"blocks {a}:{b}: the head serves the first layers (0:B) or the last ones (A:{num_layers}), "
                         "not a span in the middle of the ring")
    return (b, num_layers) if a == 0 else (0, a)


def _check_blocks(blocks: tuple[int, int] | None, num_layers: int) -> tuple[int, int]:
    """`blocks` (default every layer) checked to be a non-empty range inside 0..num_layers."""
    start, end = (0, num_layers) if blocks is None else blocks
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"blocks must be a range inside 0..{num_layers}, got {start}:{end}")
    return start, end


def reasons(blacklist: Iterable[str] | Mapping[str, str]) -> Mapping[str, str]:
    """Peers to leave out, each with why: a mapping as it is, plain peers as "blacklisted"."""
    return blacklist if isinstance(blacklist, Mapping) else dict.fromkeys(blacklist, "blacklisted")


def _eligible(
    records: Iterable[PeerRecord],
    rtts: Mapping[str, float | None],
    blocks: tuple[int, int],
    blacklist: Iterable[str] | Mapping[str, str],
    min_cache_tokens: int,
    default_rtt_s: float | None,
) -> tuple[list[tuple[PeerRecord, float]], dict[str, str]]:
    """Peers that may serve some of `blocks` = [first, last) (with their RTTs), and why the others may not."""
    first, last = blocks
    banned = reasons(blacklist)
    out: list[tuple[PeerRecord, float]] = []
    excluded: dict[str, str] = {}
    for rec in records:
        if rec.role != "block" or rec.start >= last or rec.end <= first:
            continue
        if rec.peer_id in banned:
            excluded[rec.peer_id] = banned[rec.peer_id]
            continue
        rtt = rtts.get(rec.peer_id)
        if rtt is None:
            rtt = default_rtt_s
        if rtt is None or not math.isfinite(rtt) or rtt < 0:
            excluded[rec.peer_id] = "no RTT measured (unreachable)"
            continue
        if rec.cache_tokens_left < min_cache_tokens:
            excluded[rec.peer_id] = f"{rec.cache_tokens_left} free cache tokens < {min_cache_tokens}"
            continue
        out.append((rec, float(rtt)))
    return out, excluded


def plan_route(
    records: Iterable[PeerRecord],
    rtts: Mapping[str, float | None],
    num_layers: int,
    *,
    window_tokens: int = 8,
    blacklist: Iterable[str] | Mapping[str, str] = frozenset(),
    min_cache_tokens: int = 0,
    cache_headroom_tokens: int = 2048,
    low_cache_penalty_s: float = 0.05,
    hop_overhead_s: float = 0.0005,
    default_rtt_s: float | None = None,
    blocks: tuple[int, int] | None = None,
    weights: str | None = None,
) -> RoutePlan:
    """The lowest-estimated-round-time route covering blocks 0..num_layers-1 (see the module doc),
    or only `blocks` = (start, end) when the head serves the others itself, over peers of one weight format:
    `weights` (None: the cheapest format's route; "any": formats mixed; "float": fp32, bf16 and fp16 mixed).

    rtts maps peer id -> head's measured RTT in seconds (None or absent = unreachable, unless
    default_rtt_s is given). Peers that are blacklisted, unreachable or have fewer than
    `min_cache_tokens` free cache tokens are skipped. Raises NoRouteError naming uncovered blocks.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if window_tokens < 1:
        raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
    first, last = _check_blocks(blocks, num_layers)
    records = list(records)
    options = dict(window_tokens=window_tokens, blacklist=blacklist, min_cache_tokens=min_cache_tokens,
                   cache_headroom_tokens=cache_headroom_tokens, low_cache_penalty_s=low_cache_penalty_s,
                   hop_overhead_s=hop_overhead_s, default_rtt_s=default_rtt_s, blocks=blocks)
    if weights is None:
        formats = sorted({r.weight_format for r in records if r.role == "block"})
        if len(formats) > 1:
            return _cheapest_format(records, rtts, num_layers, formats, options)
    elif weights != "any":
        allowed = FLOAT_FORMATS if weights == "float" else (weights,)
        others = {r.peer_id: f"holds {r.weight_format} weights; this route uses {weights}" for r in records
                  if r.role == "block" and r.weight_format not in allowed}
        blacklist = {**others, **reasons(blacklist)}
    peers, excluded = _eligible(records, rtts, (first, last), blacklist, min_cache_tokens, default_rtt_s)

    covered = [False] * num_layers
    for rec, _ in peers:
        for b in range(max(rec.start, first), min(rec.end, last)):
            covered[b] = True
    missing = [b for b in range(first, last) if not covered[b]]
    if missing:
        raise NoRouteError(missing, num_layers, excluded)

    def hop(rec: PeerRecord, rtt: float, s: int, e: int) -> RouteHop:
        one_way = rtt / 2
        link_in = one_way if s == first else one_way / 2
        link_out = one_way if e == last else one_way / 2
        compute = window_tokens * (e - s) / (rec.num_blocks * rec.throughput)
        frac = max(0.0, 1.0 - rec.cache_tokens_left / cache_headroom_tokens) if cache_headroom_tokens > 0 else 0.0
        penalty = low_cache_penalty_s * frac + hop_overhead_s + rec.wait_s
        return RouteHop(rec, s, e, link_in, compute, penalty, link_out)

    # Dijkstra over block boundaries; label = (cost in ns, hops) compared with a tie tolerance.
    best: dict[int, tuple[float, int]] = {first: (0.0, 0)}
    back: dict[int, tuple[int, RouteHop]] = {}
    heap: list[tuple[float, int, int]] = [(0.0, 0, first)]
    done: set[int] = set()

    def better(a: tuple[float, int], b: tuple[float, int]) -> bool:
        if a[0] < b[0] - TIE_NS:
            return True
        return abs(a[0] - b[0]) <= TIE_NS and a[1] < b[1]

    while heap:
        cost, nhops, s = heapq.heappop(heap)
        if s in done or (cost, nhops) != best[s]:
            continue
        done.add(s)
        if s == last:
            break
        for rec, rtt in peers:
            if not rec.start <= s < rec.end:
                continue
            for e in range(s + 1, min(rec.end, last) + 1):
                h = hop(rec, rtt, s, e)
                label = (cost + h.cost_s * 1e9, nhops + 1)
                if e not in best or better(label, best[e]):
                    best[e] = label
                    back[e] = (s, h)
                    heapq.heappush(heap, (label[0], label[1], e))

    hops: list[RouteHop] = []
    b = last
    while b != first:
        s, h = back[b]
        hops.append(h)
        b = s
    hops.reverse()
    return RoutePlan(tuple(hops), best[last][0] / 1e9, window_tokens, num_layers, excluded)


def _cheapest_format(records: list[PeerRecord], rtts: Mapping[str, float | None], num_layers: int,
                     formats: list[str], options: dict[str, Any]) -> RoutePlan:
    """The best route of each weight format present, the cheapest of them; none complete: the error of the format
    that misses the fewest blocks, saying that no single format covers them (`--mix-weights` would mix them)."""
    plans: list[RoutePlan] = []
    errors: list[NoRouteError] = []
    for fmt in formats:
        try:
            plans.append(plan_route(records, rtts, num_layers, weights=fmt, **options))
        except NoRouteError as exc:
            errors.append(exc)
    if plans:
        return min(plans, key=lambda p: p.est_round_s)
    best = min(errors, key=lambda e: len(e.missing_blocks))
    raise NoRouteError(best.missing_blocks, num_layers, best.excluded,
                       f"no single weight format ({', '.join(formats)}) covers them: a route holds one unless mixing "
                       "is allowed (generate --mix-weights)")


def block_throughputs(records: Iterable[PeerRecord], num_layers: int, exclude_peer: str | None = None) -> list[float]:
    """Per block, the summed throughput (tokens/s) of the live block peers serving it."""
    per_block = [0.0] * num_layers
    for rec in records:
        if rec.role != "block" or rec.peer_id == exclude_peer:
            continue
        for b in range(rec.start, min(rec.end, num_layers)):
            per_block[b] += rec.throughput
    return per_block


def choose_blocks(
    records: Iterable[PeerRecord], num_layers: int, n_blocks: int, *, exclude_peer: str | None = None
) -> tuple[int, int]:
    """The span of `n_blocks` blocks this peer should serve: the least-served window (Petals' rule).

    Windows are compared by their sorted per-block throughputs, so the weakest block counts
    first, then the next weakest; ties go to the lowest start.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 1 <= n_blocks <= num_layers:
        raise ValueError(f"n_blocks must be in 1..{num_layers}, got {n_blocks}")
    per_block = block_throughputs(records, num_layers, exclude_peer)
    best = min(range(num_layers - n_blocks + 1), key=lambda i: (sorted(per_block[i : i + n_blocks]), i))
    return best, best + n_blocks
