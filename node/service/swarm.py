"""The service's view of the swarm: the last survey (records, RTTs, the planned route or what is missing).

Refreshed in the background every `refresh_s`, and on demand (a request that finds no route,
a route that failed): requests start on the last planned route instead of surveying each
time, so the time to the first token does not pay for a survey. Refreshes are coalesced: a
caller that asks while one runs gets its result. The swarm page reads `view` as well, and
`last_alive`: the peers seen answering, so one that vanished is shown dead for a while. A head
that serves layers itself (`serve --blocks`) surveys routes over the other layers only (`blocks`).
"""

from __future__ import annotations

import logging
import time

import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.planner import NoRouteError
from dsd.discovery.records import PeerRecord
from dsd.discovery.survey import SwarmView, survey
from dsd.protocol import Hop

from .metrics import ServiceMetrics

log = logging.getLogger(__name__)

DEAD_KEPT_S = 600.0  # a peer that stopped answering is remembered (shown dead) this long


class SwarmWatch:
    """The last `SwarmView` of `model` and when it was taken."""

    def __init__(self, node: P2PNode, model: str, num_layers: int, metrics: ServiceMetrics, *,
                 refresh_s: float = 15.0, survey_timeout_s: float = 30.0,
                 blocks: tuple[int, int] | None = None) -> None:
        self.node = node
        self.model = model
        self.num_layers = num_layers
        self.blocks = blocks  # the layers a route must cover (None: every layer)
        self.metrics = metrics
        self.refresh_s = refresh_s
        self.survey_timeout_s = survey_timeout_s
        self.view: SwarmView | None = None
        self.surveyed_at = 0.0  # trio clock
        self.surveyed_unix = 0.0
        self.last_alive: dict[str, tuple[PeerRecord, float]] = {}  # peer id -> its last live record, unix time
        self._lock = trio.Lock()
        self._wake = trio.Event()

    @property
    def hops(self) -> list[Hop] | None:
        """The planned route of the last survey, or None."""
        if self.view is None or self.view.plan is None:
            return None
        return list(self.view.plan.protocol_hops())

    @property
    def missing(self) -> NoRouteError:
        """Why there is no route: the last survey's error (every block is missing before the first)."""
        if self.view is not None and self.view.error is not None:
            return self.view.error
        first, last = self.blocks or (0, self.num_layers)
        return NoRouteError(list(range(first, last)), self.num_layers)

    async def refresh(self, max_age_s: float = 0.0) -> SwarmView:
        """A view at most `max_age_s` old: the last one, or a new survey (one at a time)."""
        asked = trio.current_time()
        async with self._lock:
            if self.view is not None and self.surveyed_at >= asked - max_age_s:
                return self.view
            with trio.fail_after(self.survey_timeout_s):
                view = await survey(self.node, self.model, self.num_layers, blocks=self.blocks)
            before = self.view
            self.view, self.surveyed_at, self.surveyed_unix = view, trio.current_time(), time.time()
            self._remember(view)
            self._note(before, view)
            return view

    def _remember(self, view: SwarmView) -> None:
        """Keep the records of the peers that answered the probes; forget the long dead."""
        for rec in view.records:
            if view.rtts.get(rec.peer_id) is not None:
                self.last_alive[rec.peer_id] = (rec, self.surveyed_unix)
        for peer, (_, seen) in list(self.last_alive.items()):
            if seen < self.surveyed_unix - DEAD_KEPT_S:
                del self.last_alive[peer]

    def _note(self, before: SwarmView | None, view: SwarmView) -> None:
        route = view.plan.peers if view.plan is not None else []
        self.metrics.observe_route(view.plan is not None, view.rtts, route)
        old = before.plan.peers if before is not None and before.plan is not None else None
        if view.plan is None and (before is None or before.plan is not None):
            log.warning("no complete route for %s: %s", self.model, view.error)
        elif view.plan is not None and route != old:
            spans = ", ".join(f"{h.peer_id[-8:]} {h.start}:{h.end}" for h in view.plan.hops)
            log.info("route for %s: %s (est. %.1f ms per round)", self.model, spans, view.plan.est_round_s * 1000)

    def poke(self) -> None:
        """Survey again soon, in the background (a route failed over: the view is stale)."""
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Survey now (a failure is logged: requests will retry), then every `refresh_s` or when poked."""
        started = False
        while True:
            try:
                await self.refresh(max_age_s=1.0)
            except Exception as exc:  # the DHT or a probe failed, or the survey timed out: try again later
                log.warning("swarm survey failed: %r", exc)
            if not started:
                task_status.started()
                started = True
            with trio.move_on_after(self.refresh_s):
                await self._wake.wait()
            self._wake = trio.Event()
