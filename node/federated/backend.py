"""Server side (`FederatedBackend`, a `TargetBackend` that returns probabilities): broadcasts
each window to every active worker in parallel, waits until every one answered or the
window's deadline passed (the shared rule of `dsd.protocol.deadlines` over this pool's measured
rounds, capped by `window_timeout_s`), rebuilds each distribution (renormalize | residual), averages
with the weights renormalised over the workers that answered, and hands the engine
probabilities [rows, V]. A worker that misses a deadline is left out of that window
(logged, counted); its KV stays consistent because it still processes every window in
stream order (late answers are discarded by (epoch, start)), so it rejoins when it keeps
up again; after `max_misses` consecutive misses it is dropped for the rest of the
generation. A worker whose stream fails is dropped at once. Generation goes on while at
least one worker answers.

Token trees: a window with `parents` goes to every worker whole, asking for every node's
top-K (a row per node, in window order), and the next window commits its accepted path with
`keep`, as on a route of block peers; the engine verifies the tree against the aggregate's
rows like any other probability rows.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import trio

from dsd.discovery.framing import close_quietly
from dsd.discovery.host import P2PNode
from dsd.discovery.tasks import owned_nursery
from dsd.node.head.backend import Capabilities, TargetBackend
from dsd.node.head.sampling import SamplingParams
from dsd.node.server.limits import ServerLimits
from dsd.protocol import (
    Ack,
    CloseSession,
    DraftWindow,
    Error,
    OpenSession,
    TopKResult,
    aggregate,
    reconstruct,
)
from dsd.protocol.deadlines import DeadlineRule, RoundTimes
from dsd.protocol.ids import FEDERATED_PROTOCOL
from dsd.protocol.topk import RECONSTRUCT_METHODS

from .links import WorkerLink
from .pool import FederatedError, WorkerInfo, exchange_hello, pool_key
from .record import FederatedRecord

log = logging.getLogger(__name__)

# K asked of every worker by default. bench/results/federated-2026-11-29.json (1.5B + 0.5B workers,
# 3 prompts, T ∈ {0.8, 1.0, 1.2}): K = 64 keeps the aggregate's ℓ1 bias under 2ε̄ at every temperature,
# changes acceptance by ≤ 0.8 %, and costs 234 B per position instead of 608 KB for the whole distribution.
DEFAULT_TOPK = 64


# Longest window the server sends; longer prompts are prefilled in chunks of this size.
PREFILL_CHUNK = ServerLimits.max_window


@dataclass
class _Window:
    epoch: int
    first_row: int
    rows: int
    deadline: float
    targets: list[WorkerLink]
    sent_at: float
    tokens: int


class FederatedBackend(TargetBackend):
    """The head engine's target backend over federated workers: returns aggregated probabilities [rows, V].

    Open it with `open_federated_backend` (one session per worker, opened in parallel, and a
    reader task per worker in its nursery). Its probabilities tell the engine to verify against
    log(p̂) at temperature 1.
    """

    capabilities = Capabilities(trees=True, probs=True)

    def __init__(
        self,
        node: P2PNode,
        workers: Sequence[WorkerInfo],
        *,
        vocab_size: int,
        params: SamplingParams,
        max_len: int,
        top_k: int | None = DEFAULT_TOPK,
        weights: Sequence[float] | None = None,
        method: str = "residual",
        window_timeout_s: float = 60.0,
        open_timeout_s: float = 60.0,
        max_misses: int = 3,
        session_id: str | None = None,
        deadline: DeadlineRule | None = None,
    ) -> None:
        if not workers:
            raise FederatedError("federated generation needs at least one worker")
        if method not in RECONSTRUCT_METHODS:
            raise FederatedError(f"--reconstruct must be one of {', '.join(RECONSTRUCT_METHODS)}, got {method!r}")
        if top_k is not None and not 1 <= top_k <= vocab_size:
            raise FederatedError(f"--topk must be in [1, {vocab_size}] (the vocabulary size), got {top_k}")
        if weights is None:
            weights = [1.0] * len(workers)
        if len(weights) != len(workers):
            raise FederatedError(f"got {len(weights)} weights for {len(workers)} workers")
        if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise FederatedError(f"weights must be finite, >= 0 and not all zero, got {list(weights)}")
        if window_timeout_s <= 0:
            raise FederatedError(f"--worker-timeout must be > 0, got {window_timeout_s}")
        for w in workers:
            if w.vocab_size != vocab_size:
                raise FederatedError(
                    f"worker {w.peer_id} ({w.model or 'model unknown'}) has a vocabulary of {w.vocab_size} tokens, "
                    f"the server's has {vocab_size}: federated workers must share the vocabulary"
                )
        if len({w.peer_id for w in workers}) != len(workers):
            raise FederatedError("a worker is listed twice")
        self.node = node
        self.vocab_size = int(vocab_size)
        self.params = params
        self.max_len = max_len
        self.top_k = top_k
        self.method = method
        self.window_timeout_s = window_timeout_s
        # A window is due after k × p95 + floor of the rounds every worker answered, never after window_timeout_s.
        self.rounds = RoundTimes(replace(deadline or DeadlineRule(), cap_s=window_timeout_s))
        self._last_answer_at = 0.0
        self.open_timeout_s = open_timeout_s
        self.max_misses = max_misses
        self.id = session_id or secrets.token_hex(8)
        self.links = [WorkerLink(w, float(wt), model=w.model) for w, wt in zip(workers, weights, strict=True)]
        self.windows = 0
        self.misses = 0
        self.drops = 0
        self.aggregate_s = 0.0
        self._window: _Window | None = None
        self._wake = trio.Event()
        self._closing = False  # set when the sessions are closed: a stream ending then is no failure

    # --- lifecycle --------------------------------------------------------

    @property
    def active(self) -> list[WorkerLink]:
        return [link for link in self.links if link.state == "active"]

    async def _open_all(self) -> None:
        """Open every worker's session in parallel; FederatedError (after closing those that opened)
        when a vocabulary differs or no worker opened."""
        try:
            async with trio.open_nursery() as opening:
                for link in self.links:
                    opening.start_soon(self._open, link)
            mismatched = [link for link in self.links if link.reason.startswith("vocabulary mismatch")]
            if mismatched:
                raise FederatedError("; ".join(f"worker {link.peer_id}: {link.reason}" for link in mismatched))
            if not self.active:
                reasons = "; ".join(f"{link.peer_id}: {link.reason}" for link in self.links)
                raise FederatedError(f"no federated worker could be opened ({reasons})")
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self._close_all()
            raise

    async def _close_all(self) -> None:
        self._closing = True
        async with trio.open_nursery() as n:
            for link in self.links:
                n.start_soon(self._close_link, link)

    async def _close_link(self, link: WorkerLink) -> None:
        if link.stream is None:
            return
        with trio.move_on_after(3):
            try:
                await link.stream.send(CloseSession(self.id))
            except Exception as exc:
                log.debug("close to %s: %r", link.peer_id, exc)
        await close_quietly(link.stream)

    async def _open(self, link: WorkerLink) -> None:
        info = link.info
        try:
            with trio.fail_after(self.open_timeout_s):
                link.stream = await self.node.open(info.peer_id, info.addrs, FEDERATED_PROTOCOL)
                desc = await exchange_hello(link.stream)
                link.model = desc["model"]
                if desc["vocab_size"] is not None and desc["vocab_size"] != self.vocab_size:
                    raise FederatedError(
                        f"vocabulary mismatch: model {desc['model']!r} has {desc['vocab_size']} tokens, the server's "
                        f"has {self.vocab_size}; federated workers must share the vocabulary"
                    )
                await link.stream.send(
                    OpenSession(self.id, pool_key(self.vocab_size), 0, info.num_layers, self.max_len, ())
                )
                reply = await link.stream.receive()
                if isinstance(reply, Error):
                    raise FederatedError(f"refused the session: {reply.code}: {reply.message}")
                if not isinstance(reply, Ack):
                    raise FederatedError(f"answered OpenSession with {type(reply).__name__}")
            link.state = "active"
            log.info("federated session %s open on %s (%s)", self.id, info.peer_id, link.model)
        except Exception as exc:  # refused, unreachable, timeout, bad frame
            link.state = "failed"
            link.reason = str(exc) if isinstance(exc, FederatedError) else f"{type(exc).__name__}: {exc}"
            log.warning("federated worker %s not used: %s", info.peer_id, link.reason)
            if link.stream is not None:
                await close_quietly(link.stream)

    async def _reader(self, link: WorkerLink) -> None:
        """Collect a worker's answers (keyed by epoch and first row) until its stream ends."""
        assert link.stream is not None
        try:
            while True:
                msg = await link.stream.receive()
                if isinstance(msg, TopKResult):
                    link.results[(msg.epoch, msg.start)] = msg
                    self._last_answer_at = time.monotonic()
                elif isinstance(msg, Error):
                    raise FederatedError(f"worker error {msg.code}: {msg.message}")
                self._notify()
        except Exception as exc:  # EOF, reset, bad frame, worker error
            if link.state == "active" and not self._closing:
                link.state = "failed"
                link.reason = str(exc) if isinstance(exc, FederatedError) else f"stream ended: {type(exc).__name__}: {exc}"
                self.drops += 1
                log.warning("federated worker %s dropped: %s", link.peer_id, link.reason)
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    # --- TargetBackend ----------------------------------------------------

    async def submit(
        self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        """Broadcast the window to every active worker; a prefill (start 0) asks for its last row only,
        a token tree (`parents`) for every node. `keep` (with commit = the last tree's start) names that
        tree's accepted nodes, root first: every worker keeps just those KV rows."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("a window needs at least one token")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        tree = None if parents is None else tuple(int(p) for p in parents)
        rows = 1 if start == 0 and tree is None else len(tokens)
        if rows > PREFILL_CHUNK or (tree is not None and len(tokens) > PREFILL_CHUNK):
            raise ValueError(f"a draft window holds at most {PREFILL_CHUNK} tokens, got {len(tokens)}")
        msgs: list[DraftWindow] = []
        at, first_commit, first_keep = 0, commit, None if keep is None else tuple(int(i) for i in keep)
        while len(tokens) - at > PREFILL_CHUNK:  # long prompts: chunks whose answers are ignored
            msgs.append(DraftWindow(self.id, epoch, start + at, first_commit, tuple(tokens[at : at + PREFILL_CHUNK]), 1, 1.0,
                                    keep=first_keep))
            at += PREFILL_CHUNK
            first_commit = first_keep = None
        rest = tuple(tokens[at:])
        k = min(self.top_k, self.vocab_size) if self.top_k is not None else self.vocab_size
        # Workers apply the temperature only; top-k and top-p apply to the aggregate, in that order
        # (the engine verifies against warp(log p̂, top_k, top_p) at temperature 1).
        msgs.append(DraftWindow(self.id, epoch, start + at, first_commit, rest, k, self.params.temperature,
                                1.0, rows=min(rows, len(rest)), parents=tree, keep=first_keep))
        targets = self.active
        if not targets:
            raise FederatedError(self._none_left())
        now = time.monotonic()
        self._window = _Window(epoch, start + len(tokens) - rows, rows, now + self.rounds.deadline_s(len(tokens)), targets,
                               now, len(tokens))
        async with trio.open_nursery() as n:
            for link in targets:
                n.start_soon(self._send_window, link, msgs)

    async def _send_window(self, link: WorkerLink, msgs: list[DraftWindow]) -> None:
        assert link.stream is not None
        try:
            with trio.fail_after(self.window_timeout_s):
                for m in msgs:
                    await link.stream.send(m)
            link.windows_sent += 1
        except Exception as exc:
            if link.state == "active":
                link.state = "failed"
                link.reason = f"send failed: {type(exc).__name__}: {exc}"
                self.drops += 1
                log.warning("federated worker %s dropped: %s", link.peer_id, link.reason)
            self._notify()

    def _none_left(self) -> str:
        reasons = "; ".join(f"{link.peer_id} ({link.model}): {link.state} {link.reason}" for link in self.links)
        return f"no federated worker is left ({reasons})"

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        """Aggregated probabilities [rows, V] for the submitted window, from the workers that met its deadline."""
        w = self._window
        if w is None or w.epoch != epoch:
            raise RuntimeError(f"collect(epoch={epoch}) without a matching submit()")
        if rows != w.rows:
            raise ValueError(f"collect asked for {rows} rows but the window was submitted for {w.rows}")
        key = (w.epoch, w.first_row)
        with trio.move_on_at(trio.current_time() + max(0.0, w.deadline - time.monotonic())):
            while True:
                wake = self._wake
                if all(key in link.results or link.state != "active" for link in w.targets):
                    break
                await wake.wait()
        if all(key in link.results for link in w.targets):
            self.rounds.observe(w.tokens, max(0.0, self._last_answer_at - w.sent_at))
        t0 = time.perf_counter()
        self.windows += 1
        answered: list[tuple[WorkerLink, TopKResult]] = []
        for link in w.targets:
            res = link.results.pop(key, None)
            link.results.clear()  # older answers are stale
            if res is not None:
                answered.append((link, res))
                link.windows_answered += 1
                link.consecutive_misses = 0
            elif link.state == "active":
                link.windows_missed += 1
                link.consecutive_misses += 1
                self.misses += 1
                log.warning("federated worker %s missed the deadline of window (epoch %d, row %d)", link.peer_id, *key)
                if link.consecutive_misses >= self.max_misses:
                    link.state = "dropped"
                    link.reason = f"missed {link.consecutive_misses} window deadlines in a row"
                    self.drops += 1
                    log.warning("federated worker %s dropped: %s", link.peer_id, link.reason)
        if not answered:
            raise FederatedError(f"no worker answered window (epoch {epoch}, row {w.first_row}): " + self._none_left())
        dists, weights = [], []
        for link, res in answered:
            ids, p = res.arrays()
            if res.positions != rows:
                raise FederatedError(f"worker {link.peer_id} answered {res.positions} rows, {rows} expected")
            link.k = res.k
            link.rows_received += rows
            link.eps_sum += float(np.sum(1.0 - p.astype(np.float64).sum(axis=1)))
            dists.append(reconstruct(ids, p, self.vocab_size, self.method))  # type: ignore[arg-type]
            weights.append(link.weight)
        if sum(weights) <= 0:
            weights = [1.0] * len(weights)
        probs = torch.from_numpy(aggregate(dists, weights)).to(torch.float32)
        self.aggregate_s += time.perf_counter() - t0
        return probs

    def transport(self) -> FederatedRecord:
        """Federated statistics: per-worker bytes, mean eps, K, answers and misses."""
        return FederatedRecord(
            reconstruct=self.method, top_k=self.top_k, vocab_size=self.vocab_size, windows=self.windows,
            missed=self.misses, dropped=self.drops, workers=[link.report() for link in self.links],
            rows=sum(link.rows_received for link in self.links),
            bytes_received=sum(link.bytes_received for link in self.links),
            bytes_sent=sum(link.bytes_sent for link in self.links), aggregate_s=self.aggregate_s,
        )


@asynccontextmanager
async def open_federated_backend(
    node: P2PNode, workers: Sequence[WorkerInfo], **options: Any
) -> AsyncIterator[FederatedBackend]:
    """A `FederatedBackend` (options as its constructor's) with every usable worker's session open for the block.

    Each worker's answers are read by a task in this nursery until the sessions are closed; an
    error inside the block comes out as itself, not wrapped in an exception group.
    """
    backend = FederatedBackend(node, workers, **options)
    async with owned_nursery() as readers:
        await backend._open_all()
        for link in backend.active:
            readers.start_soon(backend._reader, link)
        try:
            yield backend
        finally:
            await backend._close_all()
            readers.cancel_scope.cancel()
