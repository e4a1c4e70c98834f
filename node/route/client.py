"""The head's route client: carries out its `RouteState`'s decisions (pings, trial windows, plans, new sessions).

The state (`dsd.protocol.route_state`) decides; this module only moves bytes: it owns the current
`RouteSession`, tells the state each window sent and each result received, and when the state asks
for pings, trial windows, a plan (from the process's `SwarmWatch`, which keeps the blacklist) or a
new session, it does that and hands back what came of it, until the state says to wait, to resume,
or that the route is gone (`RouteGaveOut`). Every step is logged, so a failure reads as the sequence
of what was seen and decided.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.planner import RoutePlan
from dsd.discovery.swarm import SwarmWatch
from dsd.protocol import Hop, Result, WireFormat
from dsd.protocol.deadlines import RoundPrior
from dsd.protocol.route_state import (
    Await,
    Broke,
    DeadlinePassed,
    Decision,
    Fail,
    FailoverEvent,
    Fault,
    NoRoute,
    Open,
    Opened,
    OpenFailed,
    Ping,
    Pinged,
    Plan,
    Planned,
    ResultArrived,
    Resume,
    RouteState,
    Timed,
    TimePrefixes,
    WindowSent,
    short,
)

from .errors import RouteError, RouteGaveOut
from .legs import ReturnLegs
from .probes import ping_hops, time_prefixes
from .session import RouteSession

log = logging.getLogger(__name__)


def plan_prior(plan: RoutePlan) -> RoundPrior:
    """The planner's round estimate as fixed seconds (links, overheads) plus compute per window token."""
    compute = sum(h.compute_s for h in plan.hops)
    return RoundPrior(max(0.0, plan.est_round_s - compute), compute / plan.window_tokens)


class Reopened(Exception):
    """The route was replaced (or reopened) while a result was awaited: the backend replays into the new session."""


class RouteClient:
    """One generation's route: its sessions, opened in `nursery` (whose tasks also close the replaced ones), and
    the `state` that decides when to probe, replace and give up."""

    def __init__(
        self, node: P2PNode, legs: ReturnLegs, swarm: SwarmWatch, nursery: trio.Nursery, state: RouteState, *,
        max_len: int, wire: WireFormat | None = None, open_timeout_s: float = 60.0,
    ) -> None:
        self.node = node
        self.legs = legs
        self.swarm = swarm
        self.state = state
        self.max_len = max_len
        self.wire = wire
        self.open_timeout_s = open_timeout_s
        self.session: RouteSession | None = None
        self._nursery = nursery
        self._fault: Fault | None = None  # a send failed: the next receive hands it to the state
        self._closed_sent = 0
        self._closed_received = 0
        self._hidden_size: int | None = None  # width of the hidden states sent (for trial windows)

    # --- what the generation reports ------------------------------------------------------------------

    @property
    def events(self) -> list[FailoverEvent]:
        return self.state.events

    @property
    def hops(self) -> list[Hop]:
        return list(self.state.hops)

    @property
    def bytes_sent(self) -> int:
        """Bytes the head sent over every session of this route."""
        return self._closed_sent + (self.session.traffic.sent if self.session else 0)

    @property
    def bytes_received(self) -> int:
        return self._closed_received + (self.session.traffic.received if self.session else 0)

    # --- driving ----------------------------------------------------------------------------------------

    async def open(self, hops: Sequence[Hop], prior: RoundPrior | None) -> None:
        """Open the first session on `hops` (retried, then failed over, as the state says)."""
        await self._drive(Open(tuple(hops), prior))

    async def send_window(
        self, hidden: np.ndarray, *, start: int, commit: int | None, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None, ahead: bool = False,
    ) -> None:
        """Send a window on the current session (nothing once a send has failed: the next receive recovers)."""
        if self._fault is not None:
            return
        assert self.session is not None
        self._hidden_size = int(hidden.shape[-1])
        try:
            await self.session.send_window(hidden, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep,
                                           ahead=ahead)
        except RouteError as exc:
            self._fault = exc.fault()
            return
        self.state.handle(WindowSent((epoch, start), int(hidden.shape[0]), trio.current_time()))

    async def receive(self, *, epoch: int, timeout: float) -> Result:
        """The next result of `epoch` or newer, waiting at most `timeout` for each; raises `Reopened` when the route
        was replaced meanwhile (the windows in flight are gone) and `RouteGaveOut` when it is gone for good."""
        give_up = trio.current_time() + timeout
        while True:
            if self._fault is not None:
                fault, self._fault = self._fault, None
                await self._recover(self.state.handle(Broke(fault, trio.current_time())))
                continue
            assert self.session is not None
            due = self.state.timer.due()
            try:
                msg = await self.session.receive(until=give_up if due is None else min(due, give_up))
            except RouteError as exc:
                self._fault = exc.fault()
                continue
            now = trio.current_time()
            if msg is None:
                if now >= give_up:
                    self._fault = Fault("timeout", f"no result within {timeout:.0f} s")
                else:
                    log.info("session %s: a window missed its deadline", self.session.id)
                    await self._recover(self.state.handle(DeadlinePassed(now)))
                continue
            await self._recover(self.state.handle(ResultArrived((msg.epoch, msg.start), now)))
            if msg.epoch >= epoch:
                return msg

    async def _recover(self, decision: Decision) -> None:
        """Carry out `decision` and what follows it; raises `Reopened` if a new session was opened."""
        if await self._drive(decision):
            raise Reopened()

    async def _drive(self, decision: Decision) -> bool:
        """Do what the state says until it says to wait or resume; True when a new session must be replayed into."""
        state = self.state
        while True:
            match decision:
                case Await():
                    return False
                case Resume(replay=replay):
                    if replay:
                        event = state.events[-1] if state.events else None
                        if event is not None:
                            log.warning("failover %d (%s): new route %s in %.2f s", len(state.events), event.verdict,
                                        [short(p) for p in event.new_route], event.seconds)
                    return replay
                case Fail(failure=failure):
                    log.warning("route gave out (%s): %s; blamed %s; %d recoveries before", failure.verdict,
                                failure.message, [short(p) for p in failure.blamed], len(failure.tried))
                    raise RouteGaveOut(failure)
                case Ping(hops=hops, timeouts=timeouts):
                    silent = await ping_hops(self.node, hops, timeouts)
                    decision = state.handle(Pinged(tuple(silent), trio.current_time()))
                case TimePrefixes(tokens=tokens, limit_s=limit_s):
                    decision = state.handle(Timed(await self._trial(tokens, limit_s), trio.current_time()))
                case Plan(avoid=avoid, wait_s=wait_s):
                    decision = state.handle(await self._plan(avoid, wait_s))
                case Open():
                    decision = await self._open(decision)

    async def _trial(self, tokens: int, limit_s: float) -> tuple[float | None, ...]:
        """Trial windows of `tokens` tokens through every prefix of the route."""
        if self._hidden_size is None:  # nothing was sent yet: nothing can be judged
            return tuple(0.0 for _ in self.state.hops)
        times = await time_prefixes(self.node, self.legs, self.state.hops, model=self.swarm.model,
                                    hidden_size=self._hidden_size, tokens=tokens, limit_s=limit_s, wire=self.wire)
        return tuple(times)

    async def _plan(self, avoid: frozenset[str], wait_s: float = 0.0) -> Planned | NoRoute:
        """A route from a fresh survey without `avoid` and the blacklist, as the state takes it; with `wait_s`, blocks
        no live peer serves are waited for that long (surveying again every second, saying what is missing)."""
        log.info("planning a route without %s", [short(p) for p in sorted(avoid)] or "new blame")
        try:
            view = await self.swarm.plan(avoid, wait_s=wait_s)
        except Exception as exc:  # the survey timed out, the DHT failed
            return NoRoute(f"the survey failed: {exc!r}", {}, trio.current_time())
        rtts = {pid: rtt for pid, rtt in view.rtts.items() if rtt is not None}
        if view.plan is None:
            missing = tuple(view.error.missing_blocks) if view.error is not None else ()
            return NoRoute(str(view.error), rtts, trio.current_time(), missing)
        return Planned(tuple(view.plan.protocol_hops()), plan_prior(view.plan), rtts, trio.current_time())

    async def _open(self, decision: Open) -> Decision:
        """Blacklist and forget what the decision names, close the old session in the background, open the new one."""
        for peer in decision.blacklist:
            backoff = self.swarm.blacklist.add(peer, why="a route of this head blamed it (silent, broken or slow)")
            log.warning("blacklisting %s for %.0f s", short(peer), backoff)
        for peer in decision.forget:
            self._nursery.start_soon(self.node.forget_peer, peer)
        old = self._retire()
        if old is not None:
            self._nursery.start_soon(old.close)  # best effort, in the background: the old route may be frozen
        if decision.pause_s:
            await trio.sleep(decision.pause_s)
        session = RouteSession(self.node, self.legs, decision.hops, model=self.swarm.model, max_len=self.max_len,
                               wire=self.wire, open_timeout_s=self.open_timeout_s)
        try:
            await session.open(self._nursery)
        except RouteError as exc:
            after = self.state.handle(OpenFailed(exc.fault(), trio.current_time()))
            again = "; retrying once on the same peers" if isinstance(after, Open) and after.pause_s else ""
            log.warning("opening the route %s failed (%s)%s", [short(h.peer_id) for h in decision.hops], exc, again)
            return after
        self.session, self._fault = session, None
        return self.state.handle(Opened(decision.hops, decision.prior, trio.current_time()))

    def _retire(self) -> RouteSession | None:
        """Drop the current session, counting its bytes; the caller closes it."""
        session, self.session = self.session, None
        if session is not None:
            self._closed_sent += session.traffic.sent
            self._closed_received += session.traffic.received
        return session

    async def close(self) -> None:
        """Close the current session (best effort within its own deadline: the route may be broken)."""
        session = self._retire()
        if session is not None:
            await session.close()
