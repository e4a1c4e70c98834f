"""The vocabulary of the head's route (`route_state`): what happened (events in), what to do (decisions out), and
how a route's recoveries and its end are recorded (`FailoverEvent`, `RouteFailure`)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from .deadlines import RoundPrior
from .messages import Hop

# --- what happened (events in) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """A route failure as data: an `Error` code (or route / timeout / stalled / slow), the text, the peer named."""

    code: str
    message: str
    peer: str | None = None


@dataclass(frozen=True)
class Opened:
    hops: tuple[Hop, ...]
    prior: RoundPrior | None
    now: float


@dataclass(frozen=True)
class OpenFailed:
    fault: Fault
    now: float


@dataclass(frozen=True)
class WindowSent:
    key: Hashable
    tokens: int
    now: float


@dataclass(frozen=True)
class ResultArrived:
    key: Hashable
    now: float


@dataclass(frozen=True)
class DeadlinePassed:
    now: float


@dataclass(frozen=True)
class Broke:
    """The session's stream failed, a peer answered with an error, or no result came within the hard limit."""

    fault: Fault
    now: float


@dataclass(frozen=True)
class Pinged:
    silent: tuple[str, ...]
    now: float


@dataclass(frozen=True)
class Timed:
    times: tuple[float | None, ...]
    now: float


@dataclass(frozen=True)
class Planned:
    hops: tuple[Hop, ...]
    prior: RoundPrior
    rtts: Mapping[str, float]
    now: float


@dataclass(frozen=True)
class NoRoute:
    message: str
    rtts: Mapping[str, float]
    now: float
    missing: tuple[int, ...] = ()  # the blocks no eligible peer serves


Event = Opened | OpenFailed | WindowSent | ResultArrived | DeadlinePassed | Broke | Pinged | Timed | Planned | NoRoute


# --- what to do (decisions out) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Await:
    due: float | None  # None: only the caller's hard limit


@dataclass(frozen=True)
class Ping:
    hops: tuple[Hop, ...]  # the hops to ping (each distinct peer once)
    timeouts: Mapping[str, float]  # peer id -> seconds


@dataclass(frozen=True)
class TimePrefixes:
    tokens: int
    limit_s: float


@dataclass(frozen=True)
class Plan:
    avoid: frozenset[str]
    wait_s: float = 0.0  # blocks missing from the survey: survey again until they are served, this long at most


@dataclass(frozen=True)
class Open:
    hops: tuple[Hop, ...]
    prior: RoundPrior | None
    pause_s: float = 0.0
    blacklist: tuple[str, ...] = ()  # blamed peers to avoid from now on (the process's blacklist)
    forget: tuple[str, ...] = ()  # peers that did not answer a ping: drop their connections


@dataclass(frozen=True)
class Resume:
    replay: bool  # a new session: the committed tokens must be replayed into it


@dataclass(frozen=True)
class FailoverEvent:
    """One recovery: what failed, whom the head blamed, how long until the new session was open, and its peers."""

    error: str
    blamed: list[str]
    seconds: float
    new_route: list[str]
    verdict: str = ""

    def as_dict(self) -> dict:
        return {"error": self.error, "verdict": self.verdict, "blamed": list(self.blamed),
                "seconds": round(self.seconds, 3), "new_route": list(self.new_route)}


@dataclass(frozen=True)
class RouteFailure:
    """Why a route gave out: the verdict, its message, the peers blamed last, and every recovery tried before."""

    verdict: str
    message: str
    blamed: list[str] = field(default_factory=list)
    tried: list[FailoverEvent] = field(default_factory=list)
    missing_blocks: list[int] = field(default_factory=list)  # no_route: the blocks no eligible peer serves

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "message": self.message, "blamed": list(self.blamed),
                "tried": [e.as_dict() for e in self.tried], "missing_blocks": list(self.missing_blocks)}


@dataclass(frozen=True)
class Fail:
    failure: RouteFailure


Decision = Await | Ping | TimePrefixes | Plan | Open | Resume | Fail
