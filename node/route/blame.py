"""Blame after a failed audit: which span lied, found by running the window span by span on both routes.

The two routes are cut at every boundary of either (`audit_rules.segments`). From the head's own input rows
(trusted: it embedded the tokens), each segment is run on the audited route's peer and the replica's peer, each in a
session of its own over just those layers (a peer serves any part of its span), on the same input rows: the whole
context and the window. Where they agree, the agreed rows feed the next segment; at the first segment where they
disagree, a third replica of those layers decides, and the peer it contradicts lied. A liar that lies only now and
then may answer these probes honestly: the walk is repeated a few times before the mismatch is called unattributed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.swarm import SwarmWatch
from dsd.protocol import Hop, WireFormat
from dsd.protocol.deadlines import RoundTimes
from dsd.protocol.route_state import short

from .audit_rules import Comparison, Segment, segments
from .errors import RouteError
from .legs import ReturnLegs
from .session import RouteSession, open_route_session

log = logging.getLogger(__name__)

Tolerance = Callable[[Hop, Hop], float]  # the tolerance between two peers' rows (by their precisions)

# Walks before a mismatch nobody repeats is called unattributed: a peer lying on a share F of windows answers a walk's
# two probes honestly with probability (1 - F)^2; six walks leave 0.7^12 = 1.4 % at F = 0.3 (three left 12 %).
BLAME_WALKS = 6
PROBE_TIMEOUT_S = 60.0  # a round's wait when no measured rounds bound it (`run_rows` without `rounds`)


@dataclass(frozen=True)
class Verdict:
    """What blame found: `lied` (the `liar`), `disputed` (two peers disagree and nothing decides between them),
    or `unattributed` (the mismatch did not repeat, or a probe failed); `silent` names peers that did not answer."""

    kind: str
    liar: str | None
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    silent: tuple[str, ...] = ()


async def run_rows(
    session: RouteSession, rows: np.ndarray, *, start: int, commit: int | None, parents: Sequence[int] | None = None,
    chunk: int = 128, rounds: RoundTimes | None = None, observe: bool = True,
) -> np.ndarray:
    """Rows through an open session at positions start..: a chain in chunks (each awaited), a tree whole; the output
    rows in order. Each round waits as the deadline rule of `rounds` says for its size (and is recorded there unless
    not `observe`), else `PROBE_TIMEOUT_S`; RouteError (code timeout) when it passes."""

    async def one(part: np.ndarray, at: int, since: int | None, tree: Sequence[int] | None) -> np.ndarray:
        t0 = trio.current_time()
        wait = PROBE_TIMEOUT_S if rounds is None else rounds.deadline_s(len(part))
        out = await session.forward(part, start=at, commit=since, parents=tree, timeout=wait)
        if rounds is not None and observe:
            rounds.observe(len(part), trio.current_time() - t0)
        return out

    if parents is not None:
        return await one(rows, start, commit, parents)
    outs = [await one(rows[at : at + chunk], start + at, commit if at == 0 else start + at, None)
            for at in range(0, len(rows), chunk)]
    return np.concatenate(outs) if outs else rows[:0]


class Prober:
    """Runs one span of layers on one peer, in a session of its own, over a context and a window; its opens and
    rounds wait as `rounds` (the audits' measured replica rounds, when there are any) say."""

    def __init__(self, node: P2PNode, legs: ReturnLegs, *, model: str, max_len: int, wire: WireFormat) -> None:
        self.node, self.legs, self.model, self.max_len, self.wire = node, legs, model, max_len, wire
        self.rounds: RoundTimes | None = None

    async def run(self, peer: Hop, start: int, end: int, rows: np.ndarray, context: int,
                  parents: Sequence[int] | None) -> np.ndarray:
        """Layers [start, end) of `peer` over `rows` (the first `context` a chain, the rest the window)."""
        hop = Hop(peer.peer_id, tuple(peer.addrs), start, end)
        rounds = self.rounds
        open_s = PROBE_TIMEOUT_S if rounds is None else rounds.deadline_s(1)
        async with open_route_session(self.node, self.legs, [hop], model=self.model, max_len=self.max_len,
                                      wire=self.wire, open_timeout_s=open_s) as session:
            head = (await run_rows(session, rows[:context], start=0, commit=0, rounds=rounds, observe=False)
                    if context else rows[:0])
            tail = await run_rows(session, rows[context:], start=context, commit=context, parents=parents,
                                  rounds=rounds, observe=False)
        return np.concatenate([head, tail])


async def _both(prober: Prober, peers: Sequence[Hop], seg: Segment, rows: np.ndarray, context: int,
                parents: Sequence[int] | None) -> list[np.ndarray | RouteError]:
    """The segment on each of `peers` at once; a peer that fails gives its RouteError instead of rows."""
    out: list[np.ndarray | RouteError] = [RouteError("no answer")] * len(peers)

    async def one(i: int, peer: Hop) -> None:
        try:
            out[i] = await prober.run(peer, seg.start, seg.end, rows, context, parents)
        except (RouteError, trio.TooSlowError) as exc:
            out[i] = exc if isinstance(exc, RouteError) else RouteError(f"no answer: {exc!r}", peer=peer.peer_id)

    async with trio.open_nursery() as nursery:
        for i, peer in enumerate(peers):
            nursery.start_soon(one, i, peer)
    return out


async def third_replicas(swarm: SwarmWatch, seg: Segment, involved: set[str], *, asked: Set[str] = frozenset(),
                         last_resort: bool = False) -> list[Hop]:
    """Peers that serve the segment's layers besides its two candidates (and the banned, the blacklisted and those in
    `asked`): those on neither route first, then those the routes use for other layers; nearest first in each group.
    The survey's records and the peers this process saw alive lately both count: a survey on a loaded swarm can miss
    a record for a moment. As a `last_resort` the view is surveyed afresh and blacklisted peers are asked too (a
    peer late once on a loaded machine is not thereby wrong)."""
    view = await swarm.refresh(max_age_s=0.0 if last_resort else 30.0)
    avoided = (set(swarm.bans.active()) if last_resort else swarm.avoided()) | {seg.route.peer_id, seg.replica.peer_id}
    avoided |= asked
    known = {r.peer_id: r for r, _ in swarm.last_alive.values()} | {r.peer_id: r for r in view.records}
    found = [r for r in known.values() if r.role == "block" and r.start <= seg.start and seg.end <= r.end
             and r.peer_id not in avoided]
    found.sort(key=lambda r: (r.peer_id in involved, view.rtts.get(r.peer_id) or float("inf")))
    return [Hop(r.peer_id, tuple(r.addrs), r.start, r.end) for r in found]


async def locate_liar(
    prober: Prober, swarm: SwarmWatch, route: Sequence[Hop], replica: Sequence[Hop], rows: np.ndarray, *,
    context: int, parents: Sequence[int] | None, tolerance: Tolerance, walks: int = BLAME_WALKS,
) -> Verdict:
    """Walk the segments of `route` and `replica` from the head's input `rows` (see the module doc); two peers' rows
    are compared at `tolerance(one, other)` (their precisions' pair)."""
    involved = {h.peer_id for h in route} | {h.peer_id for h in replica}
    for walk in range(walks):
        x = rows
        for seg in segments(route, replica):
            mine, theirs = await _both(prober, [seg.route, seg.replica], seg, x, context, parents)
            silent = tuple(h.peer_id for h, o in ((seg.route, mine), (seg.replica, theirs)) if isinstance(o, RouteError))
            if silent:
                return Verdict("unattributed", None, f"{', '.join(short(p) for p in silent)} did not answer a blame "
                               f"probe of layers {seg.start}:{seg.end}", {"blocks": f"{seg.start}:{seg.end}"}, silent)
            assert isinstance(mine, np.ndarray) and isinstance(theirs, np.ndarray)
            pair = Comparison.of(mine, theirs, tolerance(seg.route, seg.replica))
            if pair.agree:
                x = theirs
                continue
            evidence = {"blocks": f"{seg.start}:{seg.end}", "route_peer": seg.route.peer_id,
                        "replica_peer": seg.replica.peer_id, "route_vs_replica": pair.evidence(), "walk": walk + 1}
            log.warning("blame: layers %d:%d differ between %s and %s (max %.3f); asking a third replica",
                        seg.start, seg.end, short(seg.route.peer_id), short(seg.replica.peer_id), pair.largest)
            verdict = await _third_opinion(prober, swarm, seg, x, context, parents, mine, theirs, tolerance,
                                           involved, evidence)
            if verdict is not None:
                return verdict
            break  # the third agreed with neither (or did not answer): walk again
    return Verdict("unattributed", None, f"the mismatch did not repeat in {walks} span-by-span walks "
                   "(a peer that lies now and then, or a fault of the audit's own route)")


async def _third_opinion(
    prober: Prober, swarm: SwarmWatch, seg: Segment, x: np.ndarray, context: int, parents: Sequence[int] | None,
    mine: np.ndarray, theirs: np.ndarray, tolerance: Tolerance, involved: set[str], evidence: dict[str, Any],
) -> Verdict | None:
    """Ask third replicas of the segment, nearest first, until one answers: the peer it contradicts lied. None when
    it agrees with neither; `disputed` when no third replica exists."""
    asked: set[str] = set()
    async for third in _thirds(swarm, seg, involved, asked):
        asked.add(third.peer_id)
        (out,) = await _both(prober, [third], seg, x, context, parents)
        if isinstance(out, RouteError):
            log.info("blame: third replica %s did not answer: %s", short(third.peer_id), out)
            continue
        with_route = Comparison.of(out, mine, tolerance(third, seg.route))
        with_replica = Comparison.of(out, theirs, tolerance(third, seg.replica))
        evidence = {**evidence, "third": third.peer_id, "third_vs_route": with_route.evidence(),
                    "third_vs_replica": with_replica.evidence()}
        if with_replica.agree and not with_route.agree:
            return Verdict("lied", seg.route.peer_id, f"{short(seg.route.peer_id)} returned wrong hidden states for "
                           f"layers {seg.start}:{seg.end} (max distance {with_route.largest:.3f}, tolerance "
                           f"{with_route.tolerance})", evidence)
        if with_route.agree and not with_replica.agree:
            return Verdict("lied", seg.replica.peer_id, f"{short(seg.replica.peer_id)} returned wrong hidden states "
                           f"for layers {seg.start}:{seg.end} (max distance {with_replica.largest:.3f}, tolerance "
                           f"{with_replica.tolerance})", evidence)
        log.warning("blame: the third replica %s agrees with neither (%.3f, %.3f)", short(third.peer_id),
                    with_route.largest, with_replica.largest)
        return None
    return Verdict("disputed", None, f"{short(seg.route.peer_id)} and {short(seg.replica.peer_id)} disagree on "
                   f"layers {seg.start}:{seg.end} and no third replica of them answered to decide"
                   f"{' (asked ' + ', '.join(short(p) for p in sorted(asked)) + ')' if asked else ''}", evidence)


async def _thirds(swarm: SwarmWatch, seg: Segment, involved: set[str], asked: set[str]) -> AsyncIterator[Hop]:
    """Third replicas to ask, in order: those of `third_replicas`, then (when none of them answered, or there were
    none) its last resort's that were not asked yet."""
    for third in await third_replicas(swarm, seg, involved):
        yield third
    for third in await third_replicas(swarm, seg, involved, asked=asked, last_resort=True):
        yield third
