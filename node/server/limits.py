"""What a serving peer grants to the swarm, as settings: a module of its own so that the command line can
show and parse them without loading the network stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one block peer grants to the swarm; every limit is enforced per request.

    A session whose upstream has been silent for `liveness_interval_s` is checked with a ping to it;
    no pong within `liveness_timeout_s` ends the session (a frozen or vanished head or peer whose
    connection never reset frees its state within about the sum, 10 s by default). An upstream that
    answers pings but sends nothing ends the session after `idle_timeout_s`.
    """

    max_sessions: int = 32
    max_sessions_per_peer: int = 8
    kv_budget_tokens: int = 32768
    max_len: int = 4096
    max_window: int = 256
    idle_timeout_s: float = 120.0
    open_timeout_s: float = 30.0
    send_timeout_s: float = 60.0
    liveness_interval_s: float = 5.0
    liveness_timeout_s: float = 5.0


DEFAULT_MAX_BATCH_TOKENS = 256  # rows per step: a 128-token prompt chunk and a hundred decode windows beside it
DEFAULT_MAX_BATCH_SESSIONS = 16


@dataclass(frozen=True)
class BatchOptions:
    """Whether windows of different sessions share a step, and how many rows and sessions one step may hold."""

    enabled: bool = True
    max_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_sessions: int = DEFAULT_MAX_BATCH_SESSIONS

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_sessions < 1:
            raise ValueError(f"--max-batch-tokens and the session cap must be >= 1, got {self.max_tokens}, "
                             f"{self.max_sessions}")
