"""Continuous batching on a block peer: windows of different sessions waiting while the span computes run as one
step when it is free (`SpanModule.step_each`: the weights are read once for all their rows).

No task of its own: every window's coroutine queues its job and competes for the span (one step at a time); the one
that gets it takes the most urgent waiting job and, after it, every other waiting job on the same span in order of
urgency while the step's rows stay within `max_tokens` and its sessions within `max_sessions`, runs them in a worker
thread, and hands each its rows. Urgency: windows a head is blocked on first, then windows sent ahead on a bet
(`Forward.ahead`), each kind oldest first; a window sent ahead that `AHEAD_PATIENCE` steps have passed by counts as
blocked. So the oldest blocked window always goes in the next step, and no window waits behind more than the steps
already queued before it plus that patience. A step of one job is exactly today's unbatched step; with batching off every step is one
job. A step whose joint run fails (one window's cache refuses it) is rerun window by window, so each gets its own
answer or error. A faulty peer's lying sessions (tests and demos) always step alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import trio

from dsd.protocol.load import LoadMeter, LoadReport
from dsd.shard_store import SpanModule, SpanWindow

from .limits import BatchOptions

AHEAD_PATIENCE = 2  # steps a window sent ahead may be passed by blocked ones before it counts as blocked itself


@dataclass(eq=False)  # a job is itself: queues find it by identity
class Job:
    """One session's window waiting for the span: what `SpanModule.step` takes, and, once run, its rows or error.
    `alone` runs it outside any batch (a lying session's step)."""

    span: SpanModule
    window: SpanWindow
    alone: Callable[[], np.ndarray] | None = None
    ahead: bool = False  # sent on a bet: no head waits on it yet
    owner: str = ""  # the session it belongs to (the load meter counts rows per session)
    passed: int = 0  # steps that ran while it waited (a window sent ahead is promoted after AHEAD_PATIENCE)
    done: trio.Event = field(default_factory=trio.Event)
    rows: np.ndarray | None = None
    error: BaseException | None = None
    seconds: float = 0.0  # the step's compute time
    batch: int = 0  # how many windows the step held

    @property
    def tokens(self) -> int:
        return int(self.window.hidden.shape[1])


class Batcher:
    """The span's steps: `run` a job and get its rows (see the module doc); `compute` is the limiter every step
    holds (the peer's throughput probe and shutdown hold it too); `meter` measures the load from the steps."""

    def __init__(self, options: BatchOptions | None = None) -> None:
        self.options = options or BatchOptions()
        self.compute = trio.CapacityLimiter(1)
        self.meter = LoadMeter()
        self._waiting: list[Job] = []
        self.steps = 0

    def report(self) -> LoadReport:
        """The span's recent load, with the rows waiting now (for the record)."""
        return self.meter.report(queued_rows=sum(job.tokens for job in self._waiting))

    async def run(self, job: Job) -> np.ndarray:
        """Queue `job`, take part in the steps until it has run; its output rows [tokens, hidden] as float32."""
        self._waiting.append(job)
        try:
            while not job.done.is_set():
                async with self.compute:
                    if job.done.is_set():
                        break
                    batch = self._take()
                    with trio.CancelScope(shield=True):  # the others' rows are delivered even if this session ends
                        await trio.to_thread.run_sync(self._step, batch)
        finally:
            if job in self._waiting:
                self._waiting.remove(job)
        if job.error is not None:
            raise job.error
        assert job.rows is not None
        return job.rows

    def _take(self) -> list[Job]:
        """The most urgent waiting job, then the others on its span in that order within the step's budget: jobs
        a head is blocked on before those sent ahead on a bet (promoted once AHEAD_PATIENCE steps passed them by),
        each kind oldest first."""
        order = sorted(self._waiting, key=lambda j: j.ahead and j.passed < AHEAD_PATIENCE)  # stable: arrival order
        first = order[0]
        self._waiting.remove(first)
        batch, rows = [first], first.tokens
        if self.options.enabled and first.alone is None:
            for job in order[1:]:
                if len(batch) >= self.options.max_sessions:
                    break
                if job.span is not first.span or job.alone is not None or rows + job.tokens > self.options.max_tokens:
                    continue
                self._waiting.remove(job)
                batch.append(job)
                rows += job.tokens
        for job in self._waiting:
            job.passed += 1
        return batch

    def _step(self, batch: Sequence[Job]) -> None:
        """In the worker thread: run a lying session's step alone, the other windows as one step (`step_each`: one
        by one if that fails), set each job's rows or error and wake it."""
        t0 = time.perf_counter()
        try:
            ready = [job for job in batch if self._alone(job)]
            if ready:
                outs = ready[0].span.step_each([job.window for job in ready])
                for job, out in zip(ready, outs, strict=True):
                    if isinstance(out, Exception):
                        job.error = out
                    else:
                        job.rows = cpu_rows(out)
        finally:
            trio.from_thread.run_sync(self._finish, batch, time.perf_counter() - t0)

    def _finish(self, batch: Sequence[Job], seconds: float) -> None:
        """In trio's thread: count the step, let the meter see it, wake its jobs."""
        self.steps += 1
        rows: dict[str, int] = {}
        for job in batch:
            rows[job.owner] = rows.get(job.owner, 0) + job.tokens
        self.meter.observe(seconds, rows)
        for job in batch:
            job.seconds, job.batch = seconds, len(batch)
            job.done.set()

    @staticmethod
    def _alone(job: Job) -> bool:
        """Run a lying session's whole step here (False); True for a window that joins the step."""
        if job.alone is None:
            return True
        try:
            job.rows = job.alone()
        except Exception as exc:
            job.error = exc
        return False


def cpu_rows(out: torch.Tensor) -> np.ndarray:
    """A step's output [1, tokens, hidden] as float32 rows on the CPU (they cross the wire from there)."""
    return out[0].to("cpu").to(torch.float32).numpy()
