"""Find a route from the head's point of view: fetch DHT records, probe RTTs, run the planner.

Shared by `dsd-node route`, `testnet up` (to know the swarm is complete) and
`generate`; the planner itself is a pure function in `dsd.discovery.planner`.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import trio

from .announce import fetch_records
from .host import P2PNode
from .ping import measure_rtt
from .planner import NoRouteError, RoutePlan, plan_route, reasons
from .records import PeerRecord

log = logging.getLogger(__name__)

RELAYED_COST_FACTOR = 1.25


@dataclass
class SwarmView:
    """What the head saw: live records, measured RTTs (None = unreachable) and the plan, if any."""

    records: list[PeerRecord]
    rtts: dict[str, float | None] = field(default_factory=dict)
    plan: RoutePlan | None = None
    error: NoRouteError | None = None
    links: dict[str, str | None] = field(default_factory=dict)  # peer id -> direct | relayed | hole-punched

    def coverage(self, num_layers: int) -> list[int]:
        """How many live block records cover each layer."""
        cover = [0] * num_layers
        for rec in self.records:
            if rec.role == "block":
                for i in range(max(0, rec.start), min(num_layers, rec.end)):
                    cover[i] += 1
        return cover


    def report(self, model: str, num_layers: int) -> dict:
        """The swarm as `route --json` prints it: peers with RTTs, coverage, the route or what is missing."""
        peers = [
            {
                "peer_id": r.peer_id,
                "addrs": list(r.addrs),
                "start": r.start,
                "end": r.end,
                "throughput": r.throughput,
                "rtt_ms": None if self.rtts.get(r.peer_id) is None else round(self.rtts[r.peer_id] * 1000, 3),
                "reachability": r.reachability,
                "link": self.links.get(r.peer_id),
                "version": r.version,
                "dtype": r.dtype,
                "cache_tokens_left": r.cache_tokens_left,
                "load": {"busy": r.busy, "batch_rows": r.batch_rows, "rows_per_s": r.rows_per_s,
                         "queued_rows": r.queued_rows},
                "expires": r.expires,
            }
            for r in sorted(self.records, key=lambda r: (r.start, r.end, r.peer_id))
        ]
        route = None
        if self.plan is not None:
            route = {
                "hops": [{"peer_id": h.peer_id, "start": h.start, "end": h.end, "link": self.links.get(h.peer_id)}
                         for h in self.plan.hops],
                "est_round_s": round(self.plan.est_round_s, 6),
            }
        missing = list(self.error.missing_blocks) if self.error is not None else []
        return {
            "model": model,
            "num_layers": num_layers,
            "peers": peers,
            "coverage": self.coverage(num_layers),
            "route": route,
            "missing_blocks": missing,
            "error": str(self.error) if self.error is not None else None,
        }


# Probes stop this long after they started, or `PROBE_SLACK` times as long as the first pong took,
# whichever is later (once the peers measured are `enough`; never after the timeout): a frozen
# candidate is not waited for.
PROBE_MIN_WAIT_S = 1.5
PROBE_SLACK = 4.0


async def probe_rtts(
    node: P2PNode,
    records: Iterable[PeerRecord],
    timeout_s: float = 5.0,
    *,
    min_wait_s: float = PROBE_MIN_WAIT_S,
    slack: float = PROBE_SLACK,
    enough: Callable[[Mapping[str, float | None]], bool] | None = None,
) -> dict[str, float | None]:
    """Median RTT to every distinct peer, probed in parallel; None for a peer that did not answer.

    Probing ends when every peer is measured, or at max(`min_wait_s`, `slack` × the time the first
    pong took) after the start once `enough(rtts so far)` holds (a complete route, say), and in any
    case at `timeout_s`; a peer cut short keeps the median of the pongs it sent by then.
    """
    peers = {rec.peer_id: rec for rec in records}
    samples: dict[str, list[float]] = {pid: [] for pid in peers}
    t0 = trio.current_time()
    pong = [trio.Event()]  # set (and replaced) at every pong

    def measured() -> dict[str, float | None]:
        return {pid: statistics.median(ts) if ts else None for pid, ts in samples.items()}

    async def one(rec: PeerRecord) -> None:
        def seen(rtt: float) -> None:
            samples[rec.peer_id].append(rtt)
            pong[0].set()
            pong[0] = trio.Event()

        try:
            await measure_rtt(node, rec.peer_id, rec.addrs, timeout=timeout_s, on_sample=seen)
        except Exception as exc:  # unreachable, reset, timeout, a wrong pong
            log.info("ping %s failed: %r", rec.peer_id, exc)
            samples[rec.peer_id].clear()

    async def every(outer: trio.CancelScope) -> None:
        async with trio.open_nursery() as nursery:
            for rec in peers.values():
                nursery.start_soon(one, rec)
        outer.cancel()

    async def cutoff(outer: trio.CancelScope) -> None:
        await pong[0].wait()
        await trio.sleep_until(t0 + max(min_wait_s, slack * (trio.current_time() - t0)))
        while enough is not None and not enough(measured()):
            await pong[0].wait()
        outer.cancel()

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(every, nursery.cancel_scope)
            nursery.start_soon(cutoff, nursery.cancel_scope)
    rtts = measured()
    missing = [pid[-8:] for pid, rtt in rtts.items() if rtt is None]
    if missing:
        log.info("no RTT from %s within %.2f s", ", ".join(missing), trio.current_time() - t0)
    return rtts


async def live_records(node: P2PNode, model: str, num_layers: int, timeout_s: float = 5.0) -> list[PeerRecord]:
    """The model's block records whose peers answer a ping now (this node's own kept as it is): a killed peer's record
    stays listed until its TTL, and a newcomer choosing its span or a peer deciding to move must not count it."""
    records = [r for r in await fetch_records(node, model, num_layers) if r.role == "block"]
    # Every peer gets the whole `timeout_s` to answer (no early cut-off as a route's survey has): a live peer that
    # is slow to dial must not look dead, or it would send peers to move into the "hole" it leaves.
    rtts = await probe_rtts(node, [r for r in records if r.peer_id != node.peer_id], timeout_s, min_wait_s=timeout_s)
    return [r for r in records if r.peer_id == node.peer_id or rtts.get(r.peer_id) is not None]


async def survey(
    node: P2PNode, model: str, num_layers: int, *, blacklist: Iterable[str] | Mapping[str, str] = (), role: str = "block",
    blocks: tuple[int, int] | None = None, weights: str | None = None,
) -> SwarmView:
    """Fetch, probe and plan once; blacklisted peers (or a mapping of them to why) are neither probed nor planned
    over, and a "no route" error names each with its reason.

    `blocks` = (start, end) plans a route over those layers only (the head serves the others,
    see `planner.remote_blocks`); peers serving none of them are not probed. `weights`: the route's weight
    format (`planner.plan_route`).
    """
    first, last = (0, num_layers) if blocks is None else blocks
    banned = reasons(blacklist)
    records = [r for r in await fetch_records(node, model, num_layers) if r.role == role]
    view = SwarmView(records)
    candidates = [r for r in records if r.peer_id not in banned and r.start < last and r.end > first]

    def complete(rtts: Mapping[str, float | None]) -> bool:
        """Do the peers measured so far cover every layer to route (or is no route possible anyway)?"""
        cover = SwarmView([r for r in candidates if rtts.get(r.peer_id) is not None]).coverage(num_layers)
        return all(cover[first:last]) or not all(SwarmView(candidates).coverage(num_layers)[first:last])

    view.rtts = await probe_rtts(node, candidates, enough=complete)
    view.links = {pid: node.link_kind(pid) for pid, rtt in view.rtts.items() if rtt is not None}
    # A relayed link costs its measured round trip (through the relay) and a little more, so direct and
    # punched links win near-ties: the relay shares its bandwidth among every circuit it carries.
    reachable = {pid: rtt * (RELAYED_COST_FACTOR if view.links.get(pid) == "relayed" else 1.0)
                 for pid, rtt in view.rtts.items() if rtt is not None}
    # The planner says why it leaves out the banned and those probed without an answer (unreachable).
    live = [r for r in records if r.peer_id in reachable or r.peer_id in banned or r.peer_id in view.rtts]
    try:
        view.plan = plan_route(live, reachable, num_layers, blacklist=banned, blocks=blocks, weights=weights)
    except NoRouteError as exc:
        view.error = exc
    return view


async def wait_for_route(
    node: P2PNode, model: str, num_layers: int, timeout_s: float, poll_s: float = 1.0,
    *, blocks: tuple[int, int] | None = None, blacklist: Iterable[str] = (),
) -> SwarmView:
    """Survey until a complete route (over `blocks`, default every layer) exists; raises the last NoRouteError on
    timeout. Each survey that finds blocks missing is logged with what is waited for (records can lag: a
    peer that just started, or one whose record a node that left still held)."""
    view: SwarmView | None = None
    t0 = trio.current_time()
    with trio.move_on_after(timeout_s):
        while True:
            view = await survey(node, model, num_layers, blocks=blocks, blacklist=blacklist)
            if view.plan is not None:
                if trio.current_time() - t0 > poll_s:
                    log.info("a complete route for %s after %.1f s of waiting", model, trio.current_time() - t0)
                return view
            log.info("%s; waiting up to %.0f s more for the swarm's records", view.error,
                     max(0.0, timeout_s - (trio.current_time() - t0)))
            await trio.sleep(poll_s)
    if view is not None and view.error is not None:
        raise view.error
    raise TimeoutError(f"no complete route for {model} after {timeout_s:.0f} s")
