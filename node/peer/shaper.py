"""Emulated WAN links: delay each write by one-way latency ± jitter plus its serialisation time.

The kernel here has no netem, so the daemon shapes its own outgoing bytes. A shaped
stream's `write` returns at once (like a socket buffer); a pump task delivers each
chunk to the real stream when its time comes, in order. Reads pass through: every
peer shapes what it sends, so a round trip between two shaped peers costs two
one-way latencies.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import trio

log = logging.getLogger(__name__)

# Shaped bytes waiting for delivery on one stream; past this, `write` blocks (back-pressure).
MAX_QUEUED_CHUNKS = 256


@dataclass(frozen=True)
class LinkProfile:
    """One emulated link: one-way latency, uniform jitter and bandwidth (None = unlimited)."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ValueError("latency and jitter must be >= 0")
        if self.jitter_s > self.latency_s:
            raise ValueError("jitter must not exceed the latency (delays would go negative)")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError("bandwidth must be > 0")

    @classmethod
    def from_options(cls, latency_ms: float, jitter_ms: float = 0.0, mbit: float | None = None) -> LinkProfile:
        """Build a profile from the CLI's milliseconds and megabits per second."""
        return cls(latency_ms / 1000.0, jitter_ms / 1000.0, mbit * 1e6 if mbit else None)

    def cli_args(self) -> list[str]:
        """The `--wan-*` options that give another dsd-node process this profile."""
        out = ["--wan-latency-ms", f"{self.latency_s * 1000:g}", "--wan-jitter-ms", f"{self.jitter_s * 1000:g}"]
        if self.bandwidth_bps is not None:
            out += ["--wan-mbit", f"{self.bandwidth_bps / 1e6:g}"]
        return out

    def as_dict(self) -> dict[str, float | None]:
        """Milliseconds and megabits per second, as the testnet state records them."""
        mbit = None if self.bandwidth_bps is None else self.bandwidth_bps / 1e6
        return {"latency_ms": self.latency_s * 1000, "jitter_ms": self.jitter_s * 1000, "mbit": mbit}

    @property
    def active(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bps is not None

    def serialisation_s(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth_bps is None else nbytes * 8 / self.bandwidth_bps


class LinkSchedule:
    """Pure timing of one link: when each chunk finishes sending and when it arrives (FIFO)."""

    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self.profile = profile
        self._rng = rng
        self._wire_free_at = -math.inf
        self._last_arrival = -math.inf

    def arrival(self, now: float, nbytes: int) -> float:
        """Arrival time of a chunk of `nbytes` handed to the link at `now`; never before an earlier chunk."""
        start = max(now, self._wire_free_at)
        self._wire_free_at = start + self.profile.serialisation_s(nbytes)
        jitter = self._rng.uniform(-self.profile.jitter_s, self.profile.jitter_s) if self.profile.jitter_s else 0.0
        arrival = max(self._wire_free_at + self.profile.latency_s + jitter, self._last_arrival)
        self._last_arrival = arrival
        return arrival


class ShapedStream:
    """A stream whose writes reach the peer after the link's delay; everything else passes through."""

    def __init__(self, inner: Any, schedule: LinkSchedule, nursery: trio.Nursery) -> None:
        self._inner = inner
        self._schedule = schedule
        self._send, self._recv = trio.open_memory_channel[tuple[float, bytes]](MAX_QUEUED_CHUNKS)
        self._drained = trio.Event()
        self._error: BaseException | None = None
        nursery.start_soon(self._pump)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _pump(self) -> None:
        try:
            async with self._recv:
                async for deliver_at, data in self._recv:
                    await trio.sleep_until(deliver_at)
                    await self._inner.write(data)
        except Exception as exc:  # the peer went away: surface it on the next write
            self._error = exc
            log.debug("shaped stream delivery failed: %r", exc)
        finally:
            self._drained.set()

    async def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        await self._send.send((self._schedule.arrival(trio.current_time(), len(data)), bytes(data)))

    async def read(self, n: int | None = None) -> bytes:
        return await self._inner.read(n)

    async def flush(self) -> None:
        """Wait until every queued chunk has been delivered (or delivery failed)."""
        await self._send.aclose()
        await self._drained.wait()

    async def close(self) -> None:
        with trio.move_on_after(30 + 2 * self._schedule.profile.latency_s):
            await self.flush()
        await self._inner.close()

    async def reset(self) -> None:
        await self._send.aclose()
        await self._inner.reset()


class LinkShaper:
    """Wraps streams so what this peer sends crosses an emulated WAN link; owns the pump tasks."""

    def __init__(self, profile: LinkProfile, seed: int | None = None) -> None:
        self.profile = profile
        self._rng = random.Random(seed)
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve as the pump tasks' home until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def wrap(self, stream: Any) -> Any:
        """The stream itself when shaping is off, else a ShapedStream with its own link schedule."""
        if not self.profile.active:
            return stream
        if self._nursery is None:
            raise RuntimeError("LinkShaper.run() must be started before wrapping streams")
        return ShapedStream(stream, LinkSchedule(self.profile, self._rng), self._nursery)
