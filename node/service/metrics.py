"""The service's Prometheus metrics: one `CollectorRegistry` per service, rendered by the app at `GET /metrics`.

No HTTP thread of prometheus_client: the app serves the text format itself, so metrics cost
nothing between scrapes. Per-generation statistics come from the head engine's counters
(`dsd.node.head.report`); gauges of running and queued requests read the admission limiter
at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from dsd.discovery.survey import SwarmView
from dsd.node.head.joint import JoinStats
from dsd.node.head.report import GenerationResult

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SHARE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ServiceMetrics:
    """Everything `dsd-node serve` counts, in its own registry (several services can share a process)."""

    def __init__(self, running: Callable[[], float], queued: Callable[[], float],
                 joint: dict[str, JoinStats] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dsd_serve_requests", "API requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("dsd_serve_generated_tokens", "Tokens generated (completion tokens)", registry=r)
        self.prompt_tokens = Counter("dsd_serve_prompt_tokens", "Prompt tokens of the generations run", registry=r)
        self.ttft = Histogram("dsd_serve_time_to_first_token_seconds",
                              "From a request's arrival (queue wait included) to its first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("dsd_serve_time_per_output_token_seconds",
                                   "Seconds per generated token after the first, one observation per generation",
                                   buckets=TOKEN_BUCKETS, registry=r)
        self.accepted = Histogram("dsd_serve_accepted_drafts_per_round",
                                  "Drafted tokens the target accepted, one observation per draft round",
                                  buckets=ACCEPTED_BUCKETS, registry=r)
        self.round_s = Histogram("dsd_serve_round_trip_seconds",
                                 "Mean seconds per round trip around the route after the prompt, one observation "
                                 "per generation", buckets=LATENCY_BUCKETS, registry=r)
        self.ready_share = Histogram("dsd_serve_ready_window_share",
                                     "Share of windows that were pre-drafted during the previous trip, per generation",
                                     buckets=SHARE_BUCKETS, registry=r)
        self.failovers = Counter("dsd_serve_failovers", "Routes replaced during generations", registry=r)
        self.failures = Counter("dsd_serve_generation_failures", "Generations that failed, by cause", ["cause"],
                                registry=r)
        self.peer_rtt = Gauge("dsd_serve_peer_rtt_seconds", "Ping RTT to each peer of the current route (last survey)",
                              ["peer"], registry=r)
        self.route_complete = Gauge("dsd_serve_route_complete", "1 when the last survey found a complete route",
                                    registry=r)
        active = Gauge("dsd_serve_active_sessions", "Generations running (each holds one route session)", registry=r)
        active.set_function(running)
        waiting = Gauge("dsd_serve_queued_requests", "Requests waiting for a generation slot", registry=r)
        waiting.set_function(queued)
        if joint:  # `serve --head-batching on`: what the head's joint calls did, read at scrape time
            runs = Gauge("dsd_serve_joint_runs", "Joint calls the head ran so far (draft forwards, lm_head, its own span), by part",
                         ["part"], registry=r)
            calls = Gauge("dsd_serve_joint_calls", "Generations' requests those joint calls held so far, by part "
                          "(over dsd_serve_joint_runs: requests per call)", ["part"], registry=r)
            for part, stats in joint.items():
                runs.labels(part=part).set_function(lambda s=stats: s.runs)
                calls.labels(part=part).set_function(lambda s=stats: s.calls)

    def observe_generation(self, result: GenerationResult, failovers: int, prompt_tokens: int,
                           ttft_s: float | None) -> None:
        """Count one generation from the engine's counters and the route's failovers."""
        n = result.new_tokens
        self.tokens.inc(n)
        self.prompt_tokens.inc(prompt_tokens)
        self.failovers.inc(failovers)
        for accepted in result.accepted_per_round:
            self.accepted.observe(accepted)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if n > 1:
                self.per_token.observe(max(0.0, result.elapsed_s - ttft_s) / (n - 1))
        if result.rounds > 1:
            self.round_s.observe(max(0.0, result.elapsed_s - result.prefill_s) / (result.rounds - 1))
        if result.windows_after_prefill:
            self.ready_share.observe(result.ready_share)

    def observe_survey(self, _before: SwarmView | None, view: SwarmView) -> None:
        """The last survey: is there a route, and the RTT to each of its peers."""
        self.route_complete.set(1 if view.plan is not None else 0)
        self.peer_rtt.clear()
        for peer in view.plan.peers if view.plan is not None else []:
            rtt = view.rtts.get(peer)
            if rtt is not None:
                self.peer_rtt.labels(peer=peer).set(rtt)

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
