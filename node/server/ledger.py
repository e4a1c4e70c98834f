"""What a serving peer grants: limits, admission errors, KV budget (shared by block and federated servers)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


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


class SessionError(Exception):
    """A request that ends its session: answered with an `Error` frame, then the stream closes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
