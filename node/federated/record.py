"""What a federated generation's transport did: per-worker answers and bytes, misses, drops, aggregation time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FederatedRecord:
    """The transport record of a federated generation."""

    reconstruct: str
    top_k: int | None
    vocab_size: int
    windows: int
    missed: int
    dropped: int
    workers: list[dict[str, Any]]
    rows: int
    bytes_received: int
    bytes_sent: int
    aggregate_s: float

    @property
    def active_workers(self) -> int:
        return sum(w["state"] == "active" for w in self.workers)

    def as_dict(self) -> dict[str, Any]:
        return {
            "federated": True,
            "reconstruct": self.reconstruct,
            "top_k": self.top_k,
            "vocab_size": self.vocab_size,
            "windows": self.windows,
            "missed": self.missed,
            "dropped": self.dropped,
            "workers": self.workers,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "uplink_bytes_per_row": round(self.bytes_received / self.rows, 2) if self.rows else None,
            "full_distribution_bytes_per_row": 4 * self.vocab_size,
            "aggregate_s": round(self.aggregate_s, 4),
        }
