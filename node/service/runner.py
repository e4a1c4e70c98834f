"""Running one admitted request: wait for a slot, generate over the swarm streaming text, report, record.

The service's state (`ServiceState`) holds what every request shares: the loaded head, the
head's libp2p node, the process's one swarm view (with its blacklist: a peer one request blamed
is avoided by the next), the admission limiter, the metrics and the last requests' records (the
swarm page shows them). A generation starts on the last surveyed route; if that route fails
before the first token, the swarm is surveyed again and the generation starts over once (nothing
was shown yet). Text is handed out by `TextStreamer`: complete characters only and never the
start of a stop string, nor (with tools) what may be a tool call; the final text leaves the stop string out.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.swarm import SwarmWatch
from dsd.node.head.report import GenerationFailed, GenerationReport
from dsd.node.head.streaming import TextStreamer
from dsd.node.head.verify import cut_at_stop
from dsd.node.peer.generation import RouteTarget, generate_over_swarm
from dsd.node.route.legs import ReturnLegs
from dsd.node.route.record import RouteRecord

from .admission import Admission, Slot
from .metrics import ServiceMetrics
from .model import Plan, ServedModel
from .openai_wire import CompletionRequest, logprobs_body, usage_body
from .tool_calls import ToolCall, ToolCallFilter, parse_output
from .wire_errors import WireError

log = logging.getLogger(__name__)

RECORDS_KEPT = 100
CLIENT_GONE = 499  # the status recorded for a request whose client went away (nginx's convention)


@dataclass
class RequestRecord:
    """One finished request, as the swarm page lists it. `speedup_est` is tokens per round trip: the
    speedup over one-token-per-trip decoding on the same route when round trips dominate the time."""

    id: str
    endpoint: str
    status: int
    arrived_unix: float
    elapsed_s: float
    queued_s: float
    ttft_s: float | None
    prompt_tokens: int
    completion_tokens: int
    tokens_per_s: float
    mean_accepted: float
    tokens_per_trip: float
    speedup_est: float | None
    route: list[str]
    failovers: int
    mode: str
    finish_reason: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServiceState:
    """What every request of one service shares."""

    head: ServedModel
    node: P2PNode
    legs: ReturnLegs
    swarm: SwarmWatch
    admission: Admission
    metrics: ServiceMetrics
    api_key: str | None = None
    records: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))
    started_unix: float = field(default_factory=time.time)


@dataclass
class Job:
    """One admitted completion request and what happened to it so far (trio clock times)."""

    req: CompletionRequest
    plan: Plan
    slot: Slot
    endpoint: str
    rid: str
    created: int
    arrived: float
    started: float | None = None
    first_token_at: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived


@dataclass
class Finished:
    """The end of a generation: the final text (the tool calls taken out), the part of it not streamed yet, the
    calls, the logprobs (wire-shaped, or None) and the statistics."""

    text: str
    tail: str
    finish_reason: str
    usage: dict[str, int]
    dsd: dict[str, Any]
    report: GenerationReport
    calls: tuple[ToolCall, ...] = ()
    logprobs: dict[str, Any] | None = None


def no_route_error(why: object) -> WireError:
    """503 naming the blocks no live peer serves (the planner's message says which and why)."""
    return WireError(503, f"no complete route through the swarm: {why}", type="server_error", code="no_route")


def route_record(report: GenerationReport) -> RouteRecord:
    """The route's record of a service generation (the service generates over routes only)."""
    record = report.transport
    assert isinstance(record, RouteRecord), f"a service generation reports a route, not {type(record).__name__}"
    return record


def dsd_stats(report: GenerationReport, job: Job) -> dict[str, Any]:
    """The `dsd` extension of a response: how the speculative decoding went and over which route."""
    r, route = report.result, route_record(report)
    return {
        "mode": r.mode,
        "rounds": r.rounds,
        "mean_accepted": round(r.mean_accepted, 4),
        "acceptance_rate": round(r.acceptance_rate, 4),
        "tokens_per_trip": round(r.tokens_per_trip, 4),
        "ready_share": round(r.ready_share, 4),
        "route": list(route.route),
        "spans": [list(s) for s in route.spans],
        "hops": [h.as_dict() for h in route.hops],
        "failovers": len(route.failovers),
        "elapsed_s": round(r.elapsed_s, 4),
        "tokens_per_s": round(r.tokens_per_s, 4),
        "queued_s": round(job.slot.queued_s, 4),
        "ttft_s": None if job.ttft_s is None else round(job.ttft_s, 4),
        **({} if route.audits is None else route.audits.report()),
    }


async def _generate(state: ServiceState, job: Job, on_tokens: Callable[[list[int]], None]) -> GenerationReport:
    """Generate over the last surveyed route; survey again and start over once if it fails before the first token."""
    head, cfg = state.head, job.plan.cfg
    hops = state.swarm.route_to_start()
    for attempt in (1, 2):
        try:
            return await generate_over_swarm(state.node, state.legs, state.swarm, head.setup_for(cfg), job.plan.prompt,
                                             cfg, target=RouteTarget(hops=hops, local=head.local_span),
                                             tokenizer=head.tokenizer, on_tokens=on_tokens, audit=head.options.audit)
        except GenerationFailed as exc:
            failure = exc.failure
            log.warning("request %s: generation failed after %d tokens (%s): %s; blamed %s", job.rid, len(exc.tokens),
                        failure.verdict, exc, [p[-8:] for p in failure.blamed] or "nobody")
            if failure.verdict == "no_route":  # no route, or none left after a failover: the swarm changed
                state.metrics.failures.labels(cause="no_route").inc()
                with contextlib.suppress(trio.TooSlowError, OSError):
                    await state.swarm.refresh()  # so /v1/models and the page stop offering the broken route
                raise no_route_error(exc) from None
            if attempt == 1 and job.first_token_at is None:
                log.info("request %s: the route failed before the first token; surveying again", job.rid)
                view = await state.swarm.refresh()
                if view.plan is None:
                    state.metrics.failures.labels(cause="no_route").inc()
                    raise no_route_error(state.swarm.missing) from None
                hops = state.swarm.route_to_start()
                continue
            state.metrics.failures.labels(cause="route_failed").inc()
            state.swarm.poke()
            raise WireError(502, f"generation failed after {len(exc.tokens)} tokens ({failure.verdict}): {exc}",
                            type="server_error", code="route_failed") from None
    raise AssertionError("unreachable")


async def run_job(state: ServiceState, job: Job, emit: Callable[[str], None]) -> Finished:
    """Wait for a slot, generate (calling `emit` with each new piece of text, "" for tokens that show nothing
    yet), and return the end. Raises `WireError`; cancellation (the client went away) ends the generation and
    its route session."""
    head, plan, req = state.head, job.plan, job.req
    calls = ToolCallFilter(req.tools, plan.prefill)  # holds back where a tool call may begin (passes all without tools)
    async with job.slot:
        job.started = trio.current_time()
        streamer = TextStreamer(head.tokenizer, plan.cfg.stop_strings) if head.tokenizer is not None else None

        def on_tokens(tokens: list[int]) -> None:
            if job.first_token_at is None:
                job.first_token_at = trio.current_time()
            emit(calls.push(streamer.push(tokens)) if streamer is not None else "")

        report = await _generate(state, job, on_tokens)
    if route_record(report).failovers:
        state.swarm.poke()
    audits = route_record(report).audits
    if job.req.stream and audits is not None and audits.shown_wrong_from is not None:
        raise WireError(502, f"a peer was caught returning wrong hidden states after text was streamed: the text sent "
                        f"was wrong from token {audits.shown_wrong_from} on (the liar is banned; ask again for the "
                        "corrected text)", type="server_error", code="peer_lied")
    tokens = list(report.tokens)
    text, stopped = cut_at_stop(head.decode(tokens), plan.cfg.stop_strings)
    ended = stopped or bool(tokens and tokens[-1] in plan.cfg.eos_ids)
    finish = "stop" if ended or len(tokens) < plan.max_tokens else "length"
    answer = plan.prefill + text  # a malformed required call stays text, the server's start of it included
    parsed = parse_output(answer, req.tools)
    sent = calls.text[: calls.released]
    if parsed.calls:
        finish, text = "tool_calls", parsed.content.strip()
        tail = parsed.content[len(sent):].rstrip() if parsed.content.startswith(sent) else ""
    else:
        text, tail = answer, answer[len(sent):]
    usage = usage_body(len(plan.prompt), len(tokens))
    logprobs = logprobs_body(req, report.result.logprobs, head.token_text,
                             len(req.prompt) if isinstance(req.prompt, str) else 0)
    return Finished(text=text, tail=tail, finish_reason=finish, usage=usage, dsd=dsd_stats(report, job),
                    report=report, calls=parsed.calls, logprobs=logprobs)


def record(state: ServiceState, job: Job, status: int, finished: Finished | None, error: str | None) -> RequestRecord:
    """Count a finished request in the metrics, keep its record for the page and log it."""
    now = trio.current_time()
    result = finished.report.result if finished is not None else None
    route = route_record(finished.report) if finished is not None else RouteRecord()
    n = result.new_tokens if result is not None else 0
    trips = round(result.tokens_per_trip, 4) if result is not None else 0.0
    rec = RequestRecord(
        id=job.rid, endpoint=job.endpoint, status=status, arrived_unix=round(time.time() - (now - job.arrived), 3),
        elapsed_s=round(now - job.arrived, 4), queued_s=round(job.slot.queued_s, 4),
        ttft_s=None if job.ttft_s is None else round(job.ttft_s, 4), prompt_tokens=len(job.plan.prompt),
        completion_tokens=n, tokens_per_s=round(result.tokens_per_s, 4) if result is not None else 0.0,
        mean_accepted=round(result.mean_accepted, 4) if result is not None else 0.0, tokens_per_trip=trips,
        speedup_est=trips if result is not None and result.rounds else None, route=list(route.route),
        failovers=len(route.failovers), mode=result.mode if result is not None else state.head.options.mode,
        finish_reason=finished.finish_reason if finished is not None else None, error=error,
    )
    state.records.append(rec)
    state.metrics.requests.labels(endpoint=job.endpoint, status=str(status)).inc()
    if result is not None:
        state.metrics.observe_generation(result, len(route.failovers), len(job.plan.prompt), job.ttft_s)
    if status == 200:
        route = ", ".join(p[-8:] for p in rec.route)
        log.info("%s %s 200 in %.2f s: %d+%d tokens, %.1f tok/s, ttft %.3f s, queued %.2f s, mean accepted %.2f, "
                 "%.2f tokens/trip, route %s%s", job.endpoint, job.rid, rec.elapsed_s, rec.prompt_tokens, n,
                 rec.tokens_per_s, rec.ttft_s or 0.0, rec.queued_s, rec.mean_accepted, trips, route,
                 f", {rec.failovers} failovers" if rec.failovers else "")
    elif status == CLIENT_GONE:
        log.info("%s %s: the client went away after %.2f s; generation cancelled", job.endpoint, job.rid,
                 rec.elapsed_s)
    else:
        log.warning("%s %s %d after %.2f s: %s", job.endpoint, job.rid, status, rec.elapsed_s, error)
    return rec
