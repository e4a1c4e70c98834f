"""Audits: the head re-runs a random share of a route's windows on a disjoint set of replicas and compares the final
hidden states position by position; on a mismatch, blame finds the liar, who is banned, and the generation is
regenerated from the first window the liar computed (`LieCaught`, repaired by `dsd.node.peer.generation`): a
window that passed an audit proves its own rows, not the tokens before it, which unaudited lies may have chosen.

Which windows are audited is drawn with the operating system's randomness after each result came back, so no peer
can know whether a window it computes will be checked. Audits run in the auditor's own task, off the critical path:
the replica route (planned without the audited route's peers) keeps a session whose KV cache follows the audited
windows' contexts, so an audit sends only the tokens committed since the last one and the window itself.

An audit never holds a generation up: the replica route's opens and rounds wait as the generation's own deadline rule
(`dsd.protocol.deadlines`) says for that route (its planner's estimate, then its measured rounds); one that misses its
deadline or fails is skipped, its peers are pinged and the silent ones blacklisted, as a route's silent hops are.
The end of a generation (`settle`) waits for the audits in flight at most one deadline of its own route's rounds
(one more round, were it to send one), and not at all once a replica route went silent or late (until another
opens); the audits still running then are dropped and counted skipped. Only an audit that found a mismatch is waited for to the end of its blame: its verdict decides whether the text is redone.

Each comparison uses the tolerance of the two routes' precision pair (`audit_rules.AUDIT_TOLERANCES`, from the peers'
records: compute dtype and wire codec), unless the user gave one tolerance for all.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.records import FLOAT_FORMATS
from dsd.discovery.swarm import SwarmWatch
from dsd.discovery.tasks import owned_nursery
from dsd.node.head.backend import BackendError
from dsd.protocol import Hop, WireFormat
from dsd.protocol.deadlines import DeadlineRule, RoundTimes
from dsd.protocol.route_state import RouteState, short
from dsd.shard_store import HeadModule, SpanModule

from .audit_rules import (
    AUDIT_TOLERANCES,
    DEFAULT_AUDIT_RATE,
    Comparison,
    Precision,
    common_prefix,
    precision_pair,
    replicas_announced,
)
from .blame import Prober, Verdict, locate_liar, run_rows
from .client import plan_prior
from .ends import rows_into_route
from .errors import RouteError
from .legs import ReturnLegs
from .probes import ping_hops
from .session import RouteSession

log = logging.getLogger(__name__)

QUEUE = 64  # audits waiting for the auditor; beyond that a chosen window is skipped (counted)
PLAN_WAIT_S = 5.0  # a replica route not found at once is surveyed for again this long (records and probes lag)
REPLAN_S = 10.0  # after finding none, audits are skipped this long before the swarm is surveyed again
CLOSE_AT_END_S = 1.0  # the replica session's close at the generation's end waits this long (its peers may be frozen)
ENDED = "the generation ended before its audit finished"


@dataclass(frozen=True)
class AuditOptions:
    """How a head audits: the share of windows, the tolerance per position (None: by the routes' precision pair, from
    `tolerances`), and a seed (tests only: None draws from the operating system, which the peers cannot predict)."""

    rate: float = DEFAULT_AUDIT_RATE
    tolerance: float | None = None
    seed: int | None = None
    tolerances: Mapping[str, float] = field(default_factory=lambda: dict(AUDIT_TOLERANCES))

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"--audit-rate must be in [0, 1], got {self.rate}")
        if self.tolerance is not None and not self.tolerance > 0.0:
            raise ValueError(f"--audit-tolerance must be positive, got {self.tolerance}")

    def tolerance_for(self, pair: str) -> float:
        """The tolerance of two routes of precision pair `pair` (the loosest known when the pair is not listed)."""
        if self.tolerance is not None:
            return self.tolerance
        return self.tolerances.get(pair, max(self.tolerances.values()))


@dataclass
class AuditLedger:
    """What the audits of one generation did (across its regenerations): `generate --json`'s `audits` and `banned`."""

    options: AuditOptions = field(default_factory=AuditOptions)
    windows: int = 0  # windows whose results came back (the audit's population)
    audited: int = 0
    passed: int = 0
    failed: int = 0
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # per failed audit: its window, what blame found
    closest: float = 0.0  # the largest distance an audit that passed saw (how near honest replicas come)
    pairs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per precision pair: tolerance, audited, closest
    skipped: dict[str, int] = field(default_factory=dict)  # why chosen windows were not audited
    banned: list[dict[str, Any]] = field(default_factory=list)
    repairs: list[dict[str, Any]] = field(default_factory=list)  # regenerations: from which token, why
    shown_wrong_from: int | None = None  # streamed text was wrong from this token on (see docs/integrity.md)

    def skip(self, reason: str, count: int = 1) -> None:
        """Count `count` chosen windows not audited, for `reason` (logged the first time)."""
        if reason not in self.skipped:
            log.warning("audit skipped: %s", reason)
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def compared(self, pair: str, tolerance: float, distance: float, agree: bool) -> None:
        """Count one comparison of two routes of precision `pair` at `tolerance`."""
        seen = self.pairs.setdefault(pair, {"tolerance": tolerance, "audited": 0, "closest": 0.0})
        seen["audited"] += 1
        if agree:
            seen["closest"] = round(max(seen["closest"], distance), 6)
            self.closest = max(self.closest, distance)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.options.rate, "tolerance": self.options.tolerance or "by precision pair",
                "windows": self.windows, "audited": self.audited, "passed": self.passed, "failed": self.failed,
                "verdicts": list(self.verdicts), "closest": round(self.closest, 4), "pairs": dict(self.pairs),
                "skipped": dict(self.skipped), "repairs": list(self.repairs), "shown_wrong_from": self.shown_wrong_from}

    def report(self) -> dict[str, Any]:
        """The two keys a generation's JSON carries: `audits` and `banned`."""
        return {"audits": self.as_dict(), "banned": list(self.banned)}


@dataclass(frozen=True)
class AuditFailure:
    """An audit that failed on the generation's route: regenerate from position `good` (the tokens before the first
    window the liar computed; unattributed: the first any peer of the failed window's route computed), without the
    banned liar. Verdicts: lied, unattributed, disputed."""

    verdict: str
    message: str
    blamed: list[str]
    good: int
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "message": self.message, "blamed": list(self.blamed), "good": self.good,
                "evidence": self.evidence}


class LieCaught(BackendError):
    """An audit found the route's output wrong: `failure` (an `AuditFailure`) says who and from where to redo."""

    failure: AuditFailure


@dataclass(frozen=True)
class Audited:
    """A window as the audited route computed it: the tokens before it, its own, its tree, the route's output rows."""

    index: int
    context: tuple[int, ...]
    tokens: tuple[int, ...]
    parents: tuple[int, ...] | None
    rows: np.ndarray
    hops: tuple[Hop, ...]


def replica_weights(formats: set[str]) -> str | None:
    """The weight format an audit's replica route must hold, given the audited route's: its own quantized format
    (no calibrated tolerance crosses formats), any float format for a float route (compared at the precision pair's
    tolerance); None for a route that mixes a quantized format with others (`generate --mix-weights`): no replica
    computes its model, so it is not audited."""
    if formats <= set(FLOAT_FORMATS):
        return "float"
    return next(iter(formats)) if len(formats) == 1 else None


class Auditor:
    """Audits one generation's windows (see the module doc); `offer` each result, `check` before using the next,
    `settle` before the generation's text is final."""

    def __init__(
        self, node: P2PNode, legs: ReturnLegs, swarm: SwarmWatch, head: HeadModule, *, ledger: AuditLedger,
        max_len: int, wire: WireFormat, local_first: SpanModule | None = None, rule: DeadlineRule | None = None,
    ) -> None:
        self.swarm, self.head, self.ledger, self.options = swarm, head, ledger, ledger.options
        self.prober = Prober(node, legs, model=swarm.model, max_len=max_len, wire=wire)
        self.node, self.legs, self.max_len, self.wire, self.first = node, legs, max_len, wire, local_first
        self.rule = rule or DeadlineRule()
        self._rng: random.Random = random.Random(self.options.seed) if self.options.seed is not None \
            else secrets.SystemRandom()
        self._send, self._recv = trio.open_memory_channel[Audited](QUEUE)
        self._pending = 0
        self._drained = trio.Event()
        self._drained.set()
        self._nursery: trio.Nursery | None = None
        self._session: RouteSession | None = None
        self._replica: RouteState | None = None  # the replica route's deadlines (its rounds) and ping timeouts
        self._current: trio.CancelScope | None = None  # the audit running now
        self._blame: trio.Event | None = None  # set once the blame under way has its verdict
        self._stalled = trio.Event()  # set when a replica route went silent or late; cleared by the next one opened
        self._ended = False  # the generation settled: nothing more is audited
        self._held: list[int] = []  # the tokens the replica route holds
        self._no_replica: tuple[float, str] | None = None  # (until when, why) no replica route is looked for
        self._first_cache = local_first.new_cache() if local_first is not None else None
        self.first_seen: dict[str, int] = {}  # peer -> the start of the first window it computed in this generation
        self.failure: AuditFailure | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Auditor]:
        """Audit in the background while the block runs; the replica session is closed after."""
        async with owned_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._run)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()
                await self._close_replica(CLOSE_AT_END_S)

    def offer(self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int] | None, rows: np.ndarray,
              hops: Sequence[Hop]) -> None:
        """A window's result came back: audit it with probability `rate` (decided now, after the peers answered)."""
        self.ledger.windows += 1
        for h in hops:
            self.first_seen.setdefault(h.peer_id, len(context))
        if self.failure is not None or self._ended or self.options.rate <= 0.0 or \
                self._rng.random() >= self.options.rate:
            return
        window = Audited(self.ledger.windows, tuple(context), tuple(tokens), None if parents is None else
                         tuple(parents), np.array(rows, dtype=np.float32, copy=True), tuple(hops))
        try:
            self._send.send_nowait(window)
        except trio.WouldBlock:
            self.ledger.skip("the auditor fell behind (queue full)")
            return
        self._pending += 1
        self._drained = trio.Event()

    def check(self) -> None:
        """Raise `LieCaught` if an audit found the route lying."""
        if self.failure is not None:
            raise LieCaught(self.failure)

    async def settle(self, grace_s: float) -> None:
        """Wait for the audits offered so far at most `grace_s` — not at all once a replica route went silent or late
        and no other was opened since; a blame under way to its verdict — drop the rest (counted skipped), then
        `check`."""
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as nursery:  # done, or stalled (a silent replica is not waited for)
                for event in (self._drained, self._stalled):
                    nursery.start_soon(_set_then_cancel, event, nursery.cancel_scope)
        if self._blame is not None:
            await self._blame.wait()  # a mismatch was seen: its verdict decides whether the text is redone
        self._ended = True
        if self._pending:
            self.ledger.skip(ENDED, self._pending)
            log.info("%d audit(s) still running after a %.1f s grace: dropped", self._pending, grace_s)
            if self._current is not None:
                self._current.cancel()
        self.check()

    async def _run(self) -> None:
        async for window in self._recv:
            try:
                if self.failure is None and not self._ended:
                    with trio.CancelScope() as self._current:
                        await self._audit(window)
            finally:
                self._current = None
                self._pending -= 1
                if self._pending == 0:
                    self._drained.set()

    async def _audit(self, window: Audited) -> None:
        try:
            session = await self._replica_for(window.hops)
            if session is None:
                return
            rows = await self._replay(session, window)
        except (RouteError, trio.TooSlowError) as exc:
            await self._replica_failed(exc)
            return
        self.ledger.audited += 1
        replica = list(session.hops)
        pair = precision_pair(self._precision(window.hops), self._precision(replica))
        tolerance = self.options.tolerance_for(pair)
        check = Comparison.of(window.rows, rows, tolerance, len(window.context))
        self.ledger.compared(pair, tolerance, check.largest, check.agree)
        if check.agree:
            self.ledger.passed += 1
            return
        self.ledger.failed += 1
        evidence = {"window": window.index, "pair": pair, **check.evidence(), "route": [h.peer_id for h in
                    window.hops], "replica": [h.peer_id for h in replica]}
        log.warning("audit of window %d failed: %d of %d positions beyond %.3f (%s) (max %.3f) between route %s and "
                    "replicas %s; finding the liar", window.index, evidence["positions_over"], check.gaps.size,
                    tolerance, pair, check.largest, [short(p) for p in evidence["route"]],
                    [short(p) for p in evidence["replica"]])
        self._blame = trio.Event()
        try:
            await self._close_replica()
            rows_in = await trio.to_thread.run_sync(self._input_rows, window)
            verdict = await locate_liar(self.prober, self.swarm, window.hops, replica, rows_in,
                                        context=len(window.context), parents=window.parents,
                                        tolerance=self._between)
            again = self._judge(window, verdict, evidence)
        finally:
            self._blame.set()
            self._blame = None
        if again:
            await self._audit(window)  # the replica lied: the window itself is still unchecked (a new replica route)

    def _between(self, one: Hop, other: Hop) -> float:
        """The tolerance between two peers' rows of the same layers (blame's comparisons)."""
        return self.options.tolerance_for(precision_pair(self._precision([one]), self._precision([other])))

    def _precision(self, hops: Sequence[Hop]) -> Precision:
        """A route's precision from its peers' records (compute dtype, wire codec); a peer without one: unknown."""
        known = self.swarm.records
        return Precision.of_route([(known[h.peer_id].dtype, known[h.peer_id].codec) if h.peer_id in known
                                   else ("", "") for h in hops])

    async def _replica_failed(self, exc: BaseException) -> None:
        """The replica route missed a deadline or broke: ping its hops, blacklist the silent ones (routes avoid them
        too), count the audit skipped with why, close the session."""
        self._stalled.set()
        state, silent = self._replica, []
        if state is not None:
            silent = await ping_hops(self.node, state.hops, state.ping_timeouts(state.hops))
        for peer in silent:
            backoff = self.swarm.blacklist.add(peer, why="silent on an audit's replica route")
            log.warning("blacklisting %s for %.0f s: silent on an audit's replica route", short(peer), backoff)
        late = isinstance(exc, trio.TooSlowError) or getattr(exc, "code", None) == "timeout"
        what = "missed its deadline" if late else "failed"
        why = f"; {', '.join(short(p) for p in silent)} silent, blacklisted" if silent else f": {exc}"
        self.ledger.skip(f"the replica route {what}{why}")
        await self._close_replica()

    def _judge(self, window: Audited, verdict: Verdict, evidence: dict[str, Any]) -> bool:
        """Ban a liar; fail the generation (to be regenerated) unless the liar was only on the replica route (then
        True: audit the window again)."""
        evidence = {**evidence, "blame": verdict.evidence}
        self.ledger.verdicts.append({"window": window.index, "verdict": verdict.kind, "liar": verdict.liar})
        for peer in verdict.silent:
            self.swarm.blacklist.add(peer, why="silent on a blame probe")
        on_route = {h.peer_id for h in window.hops}
        if verdict.liar is not None:
            ban = self.swarm.bans.add(verdict.liar, verdict.message, evidence)
            self.ledger.banned.append(ban.as_dict())
            log.warning("banned %s until %.0f: %s", short(verdict.liar), ban.until_unix, verdict.message)
            if verdict.liar not in on_route:
                return True
        else:
            log.warning("audit failure not attributed (%s): %s", verdict.kind, verdict.message)
        blamed = [verdict.liar] if verdict.liar is not None else []
        suspects = blamed or [h.peer_id for h in window.hops]
        good = min(self.first_seen.get(p, len(window.context)) for p in suspects)
        self.failure = AuditFailure(verdict.kind, verdict.message, blamed, good, evidence)
        return False

    async def _replica_for(self, hops: Sequence[Hop]) -> RouteSession | None:
        """The open replica session, or a new one on a route sharing no peer with `hops` (None: none exists)."""
        audited = {h.peer_id for h in hops}
        session = self._session
        if session is not None and not (set(session.peers) & (audited | self.swarm.avoided())):
            return session
        await self._close_replica()
        if self._no_replica is not None and trio.current_time() < self._no_replica[0]:
            self.ledger.skip(self._no_replica[1])
            return None
        avoid = dict.fromkeys(audited, "on the audited route")
        formats = {self.swarm.records[p].weight_format for p in audited if p in self.swarm.records}
        weights = replica_weights(formats)
        if weights is None:
            self.ledger.skip(f"the route mixes weight formats ({', '.join(sorted(formats))}): no replica computes "
                             "its model")
            return None
        view = await self.swarm.plan(avoid, weights=weights)
        blocks = self.swarm.blocks or (0, self.swarm.num_layers)
        if view.plan is None and replicas_announced(view.records, audited | self.swarm.avoided(), blocks,
                                                    self.swarm.num_layers):
            view = await self.swarm.plan(avoid, wait_s=PLAN_WAIT_S, weights=weights)  # their probes may lag
        if view.plan is None:
            why = f"no replica route disjoint from the audited one: {view.error}"
            self._no_replica = (trio.current_time() + REPLAN_S, why)
            self.ledger.skip(why)
            return None
        self._no_replica = None
        assert self._nursery is not None
        replica = view.plan.protocol_hops()
        rtts = {pid: rtt for pid, rtt in view.rtts.items() if rtt is not None}
        self._replica = state = RouteState(replica, rule=self.rule, prior=plan_prior(view.plan), rtts=rtts)
        self.prober.rounds = state.rounds
        session = RouteSession(self.node, self.legs, replica, model=self.swarm.model, max_len=self.max_len,
                               wire=self.wire, open_timeout_s=state.rounds.deadline_s(1))
        await session.open(self._nursery)
        self._session, self._held = session, []
        if self._stalled.is_set():
            self._stalled = trio.Event()
        log.info("audits run on %s", [f"{short(h.peer_id)} {h.start}:{h.end}" for h in session.hops])
        return session

    async def _close_replica(self, timeout_s: float = 5.0) -> None:
        session, self._session, self._replica = self._session, None, None
        if session is not None:
            with trio.CancelScope(shield=True):
                await session.close(timeout_s)

    def _rows(self, tokens: Sequence[int], start: int, commit: int, parents: Sequence[int] | None = None) -> np.ndarray:
        return rows_into_route(self.head, self.first, self._first_cache, tokens, start, commit, parents)

    @property
    def _rounds(self) -> RoundTimes | None:
        return None if self._replica is None else self._replica.rounds

    async def _replay(self, session: RouteSession, window: Audited) -> np.ndarray:
        """The window on the replica route after the context it lacks; its output rows."""
        context, n = list(window.context), common_prefix(self._held, window.context)
        if window.parents is None:
            tokens = context[n:] + list(window.tokens)
            out = await run_rows(session, await self._compute(tokens, n, n), start=n, commit=n, rounds=self._rounds)
            self._held = context + list(window.tokens)
            return out[-len(window.tokens):]
        if n < len(context):
            await run_rows(session, await self._compute(context[n:], n, n), start=n, commit=n, rounds=self._rounds)
        start = len(context)
        out = await run_rows(session, await self._compute(window.tokens, start, start, window.parents), start=start,
                             commit=start, parents=window.parents, rounds=self._rounds)
        self._held = context
        return out

    async def _compute(self, tokens: Sequence[int], start: int, commit: int,
                       parents: Sequence[int] | None = None) -> np.ndarray:
        return await trio.to_thread.run_sync(self._rows, tokens, start, commit, parents)

    def _input_rows(self, window: Audited) -> np.ndarray:
        """The rows the head sends into a route for the whole context and the window, on a fresh cache (for blame)."""
        cache = self.first.new_cache() if self.first is not None else None
        context = list(window.context)
        head = rows_into_route(self.head, self.first, cache, context, 0, 0) if context else None
        tail = rows_into_route(self.head, self.first, cache, window.tokens, len(context), len(context), window.parents)
        return tail if head is None else np.concatenate([head, tail])


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
