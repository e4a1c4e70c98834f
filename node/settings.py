"""Settings shared by the daemon and the CLI, kept free of heavy imports so `--help` stays fast."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Decoding modes of the head engine: one token per trip, draft-then-wait, draft during the trip, plus adaptive.
MODES = ("ar", "sd", "dsd", "dsd-adaptive")

@dataclass(frozen=True)
class ServerLimits:
    """What one block peer grants to the swarm; every limit is enforced per request."""

    max_sessions: int = 32
    max_sessions_per_peer: int = 8
    kv_budget_tokens: int = 32768
    max_len: int = 4096
    max_window: int = 256
    idle_timeout_s: float = 120.0
    open_timeout_s: float = 30.0
    send_timeout_s: float = 60.0


@dataclass(frozen=True)
class WireFormat:
    """How hidden states are encoded on the wire; raw fp32 is exact (DSD's lossless default)."""

    codec: str = "raw"
    zstd: bool = False

    def encode(self, array: np.ndarray) -> Any:
        from dsd.protocol import encode_tensor

        return encode_tensor(array, codec=self.codec, zstd=self.zstd)
