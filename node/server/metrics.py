"""A serving peer's Prometheus metrics: its sessions, windows, bytes, KV tokens and the errors it answered.

The rooms where things happen count here: the block server or the federated worker (sessions
opened and refused, forward step times, KV tokens, errors of a session, a worker's stream bytes)
and the infer dispatcher (bad openings, the bytes of every incoming stream). The peer layer serves the registry over HTTP
(`dsd.node.peer.metrics_http`). One registry per peer, so several peers can share a process;
no prometheus_client thread: gauges and byte totals are read from the live objects when
scraped, so counting costs nothing between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from dsd.discovery.framing import FramedStream

T = TypeVar("T")

# Upper ends of the window-size buckets: a window of n positions is labelled by the first one >= n.
WINDOW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def window_bucket(tokens: int) -> str:
    """The label of a window of `tokens` positions: "1", "2", "3-4", "5-8", ..., "129-256", "257+"."""
    low = 1
    for high in WINDOW_BUCKETS:
        if tokens <= high:
            return str(high) if low == high else f"{low}-{high}"
        low = high + 1
    return f"{low}+"


def timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """`fn(*args)` and the seconds it took (run it in the worker thread: queueing for it is not counted)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


class _StreamBytes:
    """Bytes moved both ways by the tracked streams: the open ones read live, the ended ones folded in."""

    def __init__(self) -> None:
        self.open: set[FramedStream] = set()
        self.received = 0
        self.sent = 0

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("dsd_peer_bytes", "Bytes of session streams (/dsd/infer/1, /dsd/federated/1; "
                                     "frame headers included), by direction", labels=["direction"])
        family.add_metric(["in"], self.received + sum(s.bytes_received for s in self.open))
        family.add_metric(["out"], self.sent + sum(s.bytes_sent for s in self.open))
        yield family


class PeerMetrics:
    """Everything a serving peer counts, in its own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions_opened = Counter("dsd_peer_sessions_opened", "Sessions this peer opened", registry=r)
        self.sessions_refused = Counter("dsd_peer_sessions_refused", "Session opens refused, by error code",
                                        ["code"], registry=r)
        self.errors = Counter("dsd_peer_errors", "Error frames this peer answered (refusals, bad frames, "
                              "sessions ended by an error), by code", ["code"], registry=r)
        self.forward = Histogram("dsd_peer_forward_step_seconds", "Compute time of one window through this "
                                 "peer's span (a worker's whole model), by window size (positions)", ["window"], buckets=STEP_BUCKETS,
                                 registry=r)
        self.step_windows = Histogram("dsd_peer_step_windows", "Windows (of different sessions) one compute step "
                                      "ran together, per window: 1 = alone", buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.windows_ahead = Counter("dsd_peer_windows_ahead", "Windows a head sent ahead on a bet (run after "
                                     "the windows heads wait on)", registry=r)
        self.sessions_open = Gauge("dsd_peer_sessions_open", "Sessions holding a place on this peer", registry=r)
        self.kv_reserved = Gauge("dsd_peer_kv_tokens_reserved", "KV cache tokens reserved by open sessions "
                                 "(their max_len)", registry=r)
        self.kv_used = Gauge("dsd_peer_kv_tokens_used", "KV cache positions filled in open sessions", registry=r)
        self.kv_budget = Gauge("dsd_peer_kv_budget_tokens", "KV cache tokens this peer grants across sessions",
                               registry=r)
        self._bytes = _StreamBytes()
        r.register(self._bytes)

    def watch_sessions(self, *, open_: Callable[[], float], reserved: Callable[[], float],
                       used: Callable[[], float], budget: int) -> None:
        """Read the session and KV gauges from the server that holds them, at every scrape."""
        self.sessions_open.set_function(open_)
        self.kv_reserved.set_function(reserved)
        self.kv_used.set_function(used)
        self.kv_budget.set(budget)

    def refused(self, code: str) -> None:
        """A session open answered with an Error frame of `code`."""
        self.sessions_refused.labels(code=code).inc()
        self.errors.labels(code=code).inc()

    def error(self, code: str) -> None:
        """An Error frame of `code` this peer sent (a bad opening, a session ended by an error)."""
        self.errors.labels(code=code).inc()

    def observe_forward(self, tokens: int, seconds: float, batch: int = 1, ahead: bool = False) -> None:
        """One window's step: its compute time, how many windows that step ran together, whether it was sent ahead."""
        self.forward.labels(window=window_bucket(tokens)).observe(seconds)
        self.step_windows.observe(batch)
        if ahead:
            self.windows_ahead.inc()

    def track(self, stream: FramedStream) -> None:
        """Count the bytes `stream` moves until `untrack` (call that in a `finally`)."""
        self._bytes.open.add(stream)

    def untrack(self, stream: FramedStream) -> None:
        if stream in self._bytes.open:
            self._bytes.open.discard(stream)
            self._bytes.received += stream.bytes_received
            self._bytes.sent += stream.bytes_sent

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
