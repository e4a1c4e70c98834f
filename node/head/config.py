"""What the head engine is configured with: generation settings, the drafter interfaces, and the window
limits they share (the backend's interface: `backend.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsd.protocol.deadlines import DeadlineRule

from .draft_tree import MAX_POOL_NODES, MAX_TREE_NODES
from .logprobs import MAX_TOP_LOGPROBS
from .modes import MODES
from .sampling import SamplingParams

MAX_PIPELINE = 4  # dsd: most windows in flight at once
LOOKAHEAD = 3  # dsd: tokens pre-drafted per branch beyond the current window size
TREE_CAP = MAX_TREE_NODES - 1  # drafted nodes a tree window may carry: the wire's limit minus the root
TREE_TOP_K = 4  # children per expanded node, and nodes expanded per layer (EAGLE-2's small-target setting)
TREE_DEPTH_CAP = (MAX_POOL_NODES - TREE_TOP_K) // (TREE_TOP_K * TREE_TOP_K) + 1  # deepest pool that fits


class Drafter(Protocol):
    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor | None]: ...


class TreeDrafter(Drafter, Protocol):
    """A drafter that can grow token trees: next-token distributions of many contexts in one forward."""

    def settle(self, context: Sequence[int]) -> None: ...

    def dists_many(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor: ...


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how."""

    mode: str = "dsd"
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    gamma: int | None = None  # fixed window size; None adapts
    gamma_max: int = 16
    tau_max: float = 0.3  # dsd-adaptive only; 0 is lossless
    seed: int = 0
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    result_timeout_s: float = 300.0
    branches: int = 8  # dsd: outcome branches pre-drafted besides full acceptance (0 = only that guess)
    alternatives: int = 2  # dsd: alternative tokens bet on per draft position
    deadline: DeadlineRule = field(default_factory=DeadlineRule)  # how long a window's result is awaited
    tree_nodes: int | None = None  # drafted nodes of a tree window: None = the controller decides, 0 = chains
    pipeline: int = 2  # dsd: windows in flight at once (the next sent on the full-acceptance bet); 1 = one
    ahead_alone: bool = True  # dsd: draft the full-acceptance bet alone and send it before the other branches
    ahead_min: float = 0.05  # dsd: send a window ahead only if its bet is at least this likely (draft's q or measured α)
    budget: bool = False  # dsd: a window goes ahead, and a branch is drafted, only where its chance pays for its cost
    ready_trees: bool = False  # dsd: a matched pre-drafted chain gives way to a tree drafted now when the tree pays more
    deep_min: float = 0.0  # dsd, pipeline > 2: windows beyond the second go out only while this share of bets wins
    fallback: bool = False  # dsd: while ahead-of-verdict work costs more than it saves, decode as sd (probing again)
    logprobs: int | None = None  # record the target's log-probability of each token and this many alternatives (None: off)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0.0 <= self.ahead_min <= 1.0:
            raise ValueError(f"ahead_min must be in [0, 1], got {self.ahead_min}")
        if not 0.0 <= self.deep_min <= 1.0:
            raise ValueError(f"deep_min must be in [0, 1], got {self.deep_min}")
        if not 1 <= self.pipeline <= MAX_PIPELINE:
            raise ValueError(f"pipeline must be in [1, {MAX_PIPELINE}], got {self.pipeline}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.branches < 0 or self.alternatives < 1:
            raise ValueError("branches must be >= 0 and alternatives >= 1")
        if self.tree_nodes is not None and (
            isinstance(self.tree_nodes, bool) or not isinstance(self.tree_nodes, int)
            or not 0 <= self.tree_nodes <= TREE_CAP
        ):
            raise ValueError(f"tree_nodes must be None (auto) or an integer in [0, {TREE_CAP}], got {self.tree_nodes!r}")

    @property
    def max_window_nodes(self) -> int:
        """The most drafted tokens one window may carry (a chain's γ_max or a tree's nodes): sizes a session."""
        return max(self.gamma_max, TREE_CAP if self.tree_nodes is None else self.tree_nodes)

    @property
    def session_slack(self) -> int:
        """KV rows a session needs beyond prompt and completion: a tree window's nodes all take rows, plus the root
        and the bonus token."""
        return self.max_window_nodes + 2

    def session_len(self, prompt_len: int) -> int:
        """The `max_len` a target session of this generation asks for."""
        return prompt_len + self.max_new_tokens + self.session_slack
