"""The server's view of one federated worker during a generation: its stream, weight, state and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsd.discovery.framing import FramedStream
from dsd.protocol import TopKResult

from .pool import WorkerInfo


@dataclass
class WorkerLink:
    """The server's view of one worker during a generation: stream, weight, state and statistics."""

    info: WorkerInfo
    weight: float
    model: str | None = None
    stream: FramedStream | None = None
    state: str = "opening"  # opening | active | dropped | failed
    reason: str = ""
    k: int = 0
    windows_sent: int = 0
    windows_answered: int = 0
    windows_missed: int = 0
    consecutive_misses: int = 0
    rows_received: int = 0
    eps_sum: float = 0.0
    results: dict[tuple[int, int], TopKResult] = field(default_factory=dict)

    @property
    def peer_id(self) -> str:
        return self.info.peer_id

    @property
    def bytes_received(self) -> int:
        return self.stream.bytes_received if self.stream is not None else 0

    @property
    def bytes_sent(self) -> int:
        return self.stream.bytes_sent if self.stream is not None else 0

    def report(self) -> dict[str, Any]:
        """Per-worker statistics for `--json`."""
        return {
            "peer_id": self.peer_id,
            "model": self.model,
            "weight": self.weight,
            "state": self.state,
            "reason": self.reason,
            "k": self.k,
            "topk_cap": self.info.topk_cap,
            "windows_sent": self.windows_sent,
            "windows_answered": self.windows_answered,
            "windows_missed": self.windows_missed,
            "rows_received": self.rows_received,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "bytes_per_row": round(self.bytes_received / self.rows_received, 2) if self.rows_received else None,
            "mean_eps": round(self.eps_sum / self.rows_received, 8) if self.rows_received else None,
        }
