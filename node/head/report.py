"""What a generation reports: the engine's counters (`GenerationResult`), the transport's record beside them
(`GenerationReport`), or why it stopped with the tokens made so far (`GenerationFailed`).

Typed all the way to the edge: the CLI, the service and the benchmarks read fields, and `as_dict` is the
one place a report becomes JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .backend import Failure, NoTransport, TransportRecord
from .logprobs import TokenLogprob


@dataclass
class TimeBreakdown:
    """Where the head's wall time went, in seconds.

    Drafting done while a window was in flight is *hidden*: `drafting_hidden_used` is the part
    spent on the branch that became the next window, `drafting_hidden_wasted` the rest
    (bets that did not come true). `drafting - drafting_hidden_used - drafting_hidden_wasted`
    is drafting on the critical path (after a trip, or in `sd`).
    """

    drafting: float = 0.0
    drafting_hidden_used: float = 0.0
    drafting_hidden_wasted: float = 0.0
    waiting: float = 0.0
    verifying: float = 0.0

    @property
    def drafting_exposed(self) -> float:
        return max(0.0, self.drafting - self.drafting_hidden_used - self.drafting_hidden_wasted)

    def as_dict(self) -> dict[str, float]:
        used = self.drafting_hidden_used
        return {
            "drafting_s": round(self.drafting, 4),
            "drafting_hidden_used_s": round(used, 4),
            "drafting_hidden_wasted_s": round(self.drafting_hidden_wasted, 4),
            "drafting_exposed_s": round(self.drafting_exposed, 4),
            "waiting_s": round(self.waiting, 4),
            "verifying_s": round(self.verifying, 4),
            # Share of the drafting that the next windows used and that cost no time on the critical path.
            "hidden_used_share": round(used / (used + self.drafting_exposed), 4) if used + self.drafting_exposed > 0 else 0.0,
        }


@dataclass
class GenerationResult:
    """New tokens and the engine's statistics (counters are exact, not derived from ratios), kept up to date
    while the engine runs: a generation that fails midway still has its tokens and counters.

    `drafted` counts every drafted token sent for verification: all nodes of a tree window, so
    `acceptance_rate` is the share of drafted tokens kept. `mean_tree_nodes` is the mean number of
    drafted tokens per draft window (a chain's γ), `mean_window_depth` the mean positions they
    reach (a tree's depth); trees were sent when `tree_windows` > 0.
    """

    mode: str
    tokens: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    times: TimeBreakdown = field(default_factory=TimeBreakdown)
    prefill_s: float = 0.0
    windows_after_prefill: int = 0  # windows sent once the prompt was in
    ready_rounds: int = 0  # of those, windows that were pre-drafted during the previous trip
    branches_drafted: int = 0  # outcome branches advanced during trips (main guess included)
    drafted_depth: int = 0  # positions drafted per window, summed (a chain's γ, a tree's depth)
    tree_windows: int = 0  # draft windows sent as token trees
    pipelined_rounds: int = 0  # of the ready rounds, windows sent before the verdict they bet on (dsd pipeline)
    pipelined_wasted: int = 0  # windows sent before a verdict that then did not match them (dropped)
    ready_given_up: int = 0  # ready chains set aside for a tree drafted after the verdict (`ready_trees`)
    fallback_rounds: int = 0  # rounds decoded as sd by dsd's fallback rule (`fallback.py`)
    ahead_gaps: list[float] = field(default_factory=list)  # per window sent ahead: seconds after the one it bets on
    route_loads: list[float] = field(default_factory=list)  # per round: the load its route reported (window.py)
    head_loads: list[float] = field(default_factory=list)  # per round: the serving head's own load (draft_batch.py)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the config asks for them

    def continuing(self, kept: Sequence[int], before: Sequence[GenerationResult],
                   kept_logprobs: Sequence[TokenLogprob] = ()) -> GenerationResult:
        """This result as the continuation of `kept` tokens made by earlier attempts (`before`, regenerated from
        a checked point): the tokens (and their `kept_logprobs`) joined, the work of every attempt added."""
        merged = GenerationResult(self.mode, tokens=[*kept, *self.tokens], logprobs=[*kept_logprobs, *self.logprobs])
        for f in fields(self):
            if f.name in ("mode", "tokens", "logprobs"):
                continue
            mine, parts = getattr(self, f.name), [getattr(b, f.name) for b in before]
            if isinstance(mine, TimeBreakdown):
                value: Any = TimeBreakdown(**{t.name: sum(getattr(p, t.name) for p in [mine, *parts])
                                              for t in fields(TimeBreakdown)})
            elif isinstance(mine, list):
                value = [x for p in [*parts, mine] for x in p]
            else:
                value = mine + sum(parts)
            setattr(merged, f.name, value)
        return merged

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_trip(self) -> float:
        return len(self.tokens) / self.rounds if self.rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted_per_round)) if self.accepted_per_round else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tree_nodes(self) -> float:
        rounds = len(self.accepted_per_round)
        return self.drafted / rounds if rounds else 0.0

    @property
    def mean_window_depth(self) -> float:
        rounds = len(self.accepted_per_round)
        return self.drafted_depth / rounds if rounds else 0.0

    @property
    def ready_share(self) -> float:
        return self.ready_rounds / self.windows_after_prefill if self.windows_after_prefill else 0.0

    def as_dict(self) -> dict:
        n = len(self.tokens)
        draft_rounds = len(self.accepted_per_round)
        return {
            "mode": self.mode,
            "tokens": self.tokens,
            "new_tokens": n,
            "elapsed_s": round(self.elapsed_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 4),
            "rounds": self.rounds,
            "draft_rounds": draft_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_accepted": round(self.mean_accepted, 4),
            "accepted_per_round": list(self.accepted_per_round),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_trip": round(self.tokens_per_trip, 4),
            "windows_after_prefill": self.windows_after_prefill,
            "ready_rounds": self.ready_rounds,
            "ready_share": round(self.ready_share, 4),
            "branches_drafted": self.branches_drafted,
            "mean_tree_nodes": round(self.mean_tree_nodes, 4),
            "mean_window_depth": round(self.mean_window_depth, 4),
            "tree_windows": self.tree_windows,
            "pipelined_rounds": self.pipelined_rounds,
            "pipelined_wasted": self.pipelined_wasted,
            "ready_given_up": self.ready_given_up,
            "fallback_rounds": self.fallback_rounds,
            "ahead_gap_s": round(float(np.median(self.ahead_gaps)), 4) if self.ahead_gaps else None,
            "route_load": round(float(np.mean(self.route_loads)), 4) if self.route_loads else 0.0,
            "head_load": round(float(np.mean(self.head_loads)), 4) if self.head_loads else 0.0,
            "time_breakdown": self.times.as_dict(),
        }


@dataclass
class GenerationReport:
    """One generation: the engine's counters and the backend's transport record."""

    result: GenerationResult
    transport: TransportRecord = field(default_factory=NoTransport)

    @property
    def tokens(self) -> list[int]:
        return self.result.tokens

    def as_dict(self) -> dict[str, Any]:
        """The report as `--json` prints it: the engine's statistics and the transport's, side by side."""
        uplink = round(self.transport.bytes_received / max(1, self.result.new_tokens), 2)
        return {**self.result.as_dict(), **self.transport.as_dict(), "uplink_bytes_per_token": uplink}


class GenerationFailed(Exception):
    """A generation stopped before its end: `failure` says why (verdict, blamed peers, what was tried);
    `result` holds the tokens made so far and the counters, `transport` what the wire did."""

    def __init__(self, failure: Failure, result: GenerationResult, transport: TransportRecord | None = None) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.result = result
        self.transport = transport if transport is not None else NoTransport()

    @property
    def tokens(self) -> list[int]:
        return self.result.tokens

    def as_dict(self) -> dict[str, Any]:
        """What `--json` prints for a failed generation: the report so far and the failure."""
        return {**self.result.as_dict(), **self.transport.as_dict(), "error": str(self),
                "failure": self.failure.as_dict()}
