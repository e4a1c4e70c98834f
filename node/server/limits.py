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
