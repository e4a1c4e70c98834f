"""Where the target model runs, as the engine sees it: `TargetBackend`, what it can do, what it reports, how it fails.

A backend is opened by whoever owns its transport (a route of block peers, federated workers, the local
reference) and handed to `generation.generate`; it declares its `capabilities` instead of being probed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs besides chain windows sent one at a time."""

    trees: bool = False  # token-tree windows (`parents`, and `keep` of the accepted path)
    pipeline: bool = False  # a window before the results of those in flight are collected (dsd's windows sent ahead)
    probs: bool = False  # `collect` returns probabilities already warped by whoever computed them, not logits


class TransportRecord(Protocol):
    """What a backend's transport did during a generation (bytes, route, workers...): typed fields, JSON at the edge."""

    bytes_sent: int
    bytes_received: int

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class NoTransport:
    """The record of a backend with no wire (the local reference)."""

    bytes_sent: int = 0
    bytes_received: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_sent": 0, "bytes_received": 0}


class Failure(Protocol):
    """Why a backend gave out: a verdict (a short code), a message, the peers blamed, and JSON for the edge."""

    verdict: str
    message: str
    blamed: list[str]

    def as_dict(self) -> dict[str, Any]: ...


class BackendError(Exception):
    """The target cannot go on (no route left, no worker left): `failure` says why."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class TargetBackend:
    """Base of every backend: the engine submits windows and collects the target's rows for them.

    `replays` counts the times the backend rebuilt the target's state elsewhere (a route failed over):
    windows sent ahead before that are gone, and the engine sends anew.
    """

    capabilities = Capabilities()
    replays = 0
    load = 0.0  # what one more row costs the others sharing the target, in their tokens (a route's peers say)

    async def submit(
        self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        """Send a window at positions start.. after committing the last one: truncate to `commit`, or with
        `keep` (commit = that window's start) keep its accepted path. `parents` makes the window a tree.
        The engine passes `parents` and `keep` only when `capabilities.trees`."""
        raise NotImplementedError

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        """Target logits for the last `rows` positions of the submitted window, [rows, V] (probabilities when
        `capabilities.probs`). Raises `BackendError` when the target is gone for good."""
        raise NotImplementedError

    async def settle(self) -> None:
        """Wait for any check of the results collected so far (a route's audits); BackendError if one failed."""

    def transport(self) -> TransportRecord:
        """What the transport did so far."""
        return NoTransport()
