"""What a serving peer grants: limits, admission, KV budget, idle receive and throughput (block and federated)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable

import trio

from dsd.discovery.framing import FramedStream
from dsd.discovery.host import P2PNode
from dsd.discovery.ping import measure_rtt
from dsd.protocol import Message

from .limits import ServerLimits

log = logging.getLogger(__name__)


class SessionError(Exception):
    """A request that ends its session: answered with an `Error` frame, then the stream closes.

    `blame` is the peer at fault when it is not the one raising (its next hop, its upstream).
    """

    def __init__(self, code: str, message: str, blame: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.blame = blame


class Ledger:
    """Who holds how much of a serving peer: admits sessions within the limits and reserves their KV tokens.

    A session is counted from `admit` (before its stream to the next hop is even open) until
    `release`, so concurrent opens cannot overshoot the limits; `wait_empty` wakes when the
    last one is released.
    """

    def __init__(self, limits: ServerLimits, what: str = "peer") -> None:
        self.limits = limits
        self.what = what  # "peer" or "worker", as the refusals say it
        self.reserved_tokens = 0
        self._held: dict[Hashable, tuple[str, int]] = {}
        self._per_remote: Counter[str] = Counter()
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    @property
    def cache_tokens_left(self) -> int:
        """KV tokens not reserved by any session (announced in the DHT record)."""
        return max(0, self.limits.kv_budget_tokens - self.reserved_tokens)

    def admit(self, key: Hashable, remote: str, max_len: int) -> None:
        """Reserve `max_len` KV tokens for session `key` of `remote`, or raise SessionError (limit / busy)."""
        limits = self.limits
        if key in self._held:
            raise ValueError(f"session {key!r} is already in the ledger")
        if max_len > limits.max_len:
            raise SessionError("limit", f"max_len {max_len} exceeds this {self.what}'s limit {limits.max_len}")
        if len(self._held) >= limits.max_sessions:
            raise SessionError("busy", f"session limit reached ({limits.max_sessions})")
        if self._per_remote[remote] >= limits.max_sessions_per_peer:
            raise SessionError("busy", f"per-peer session limit reached ({limits.max_sessions_per_peer})")
        if max_len > self.cache_tokens_left:
            raise SessionError("busy", f"KV budget exhausted: {self.cache_tokens_left} tokens left, {max_len} asked")
        self._held[key] = (remote, max_len)
        self._per_remote[remote] += 1
        self.reserved_tokens += max_len
        if self._empty.is_set():
            self._empty = trio.Event()

    def release(self, key: Hashable) -> bool:
        """Give back session `key`'s tokens; False if it held none (already released)."""
        held = self._held.pop(key, None)
        if held is None:
            return False
        remote, tokens = held
        self.reserved_tokens -= tokens
        self._per_remote[remote] -= 1
        if not self._per_remote[remote]:
            del self._per_remote[remote]
        if not self._held:
            self._empty.set()
        return True

    async def wait_empty(self) -> None:
        """Return once no session holds anything (at once if none does)."""
        await self._empty.wait()


async def receive_within(stream: FramedStream, idle_timeout_s: float) -> Message:
    """The next message of a session's stream, or SessionError('idle') after `idle_timeout_s` of silence."""
    with trio.move_on_after(idle_timeout_s):
        return await stream.receive()
    raise SessionError("idle", f"session idle for {idle_timeout_s:.0f} s: closed")


class Liveness:
    """When a session last heard from its upstream (`heard` on every message), and why it was given up."""

    def __init__(self) -> None:
        self.last_heard = trio.current_time()
        self.lost: str | None = None

    def heard(self) -> None:
        self.last_heard = trio.current_time()


async def watch_upstream(node: P2PNode, remote: str, liveness: Liveness, limits: ServerLimits, scope: trio.CancelScope) -> None:
    """Ping `remote` whenever it has been silent for `liveness_interval_s`; if no pong comes within
    `liveness_timeout_s`, record why in `liveness.lost` and cancel the session's `scope`."""
    checked = liveness.last_heard
    while True:
        await trio.sleep_until(max(liveness.last_heard, checked) + limits.liveness_interval_s)
        if trio.current_time() - liveness.last_heard < limits.liveness_interval_s:
            continue
        try:
            await measure_rtt(node, remote, (), samples=1, timeout=limits.liveness_timeout_s)
        except Exception as exc:  # timeout, reset, refused
            silent = trio.current_time() - liveness.last_heard
            if silent >= limits.liveness_interval_s:  # (it may have spoken while we pinged)
                liveness.lost = (f"upstream {remote} silent for {silent:.0f} s and no pong within "
                                 f"{limits.liveness_timeout_s:.0f} s ({type(exc).__name__})")
                scope.cancel()
                return
        checked = trio.current_time()


async def measure_throughput(
    step: Callable[[int], object], limiter: trio.CapacityLimiter, *, tokens: int = 1, repeats: int = 3
) -> float:
    """Tokens per second of `step(i)`, the i-th window of `tokens` positions, run in a worker thread.

    One untimed warm-up step, then `repeats` timed ones, each behind `limiter` like real windows.
    """
    await trio.to_thread.run_sync(step, 0, limiter=limiter)
    t0 = time.perf_counter()
    for i in range(repeats):
        await trio.to_thread.run_sync(step, i + 1, limiter=limiter)
    return repeats * tokens / max(time.perf_counter() - t0, 1e-9)
