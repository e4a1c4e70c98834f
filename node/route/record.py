"""What a route did during a generation: its peers, the bytes on the wire, the head's own compute, the failovers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsd.protocol.route_state import FailoverEvent

from .audit import AuditLedger


@dataclass(frozen=True)
class RingHop:
    """One hop of the ring as a report shows it; `local` is the head's own span."""

    peer_id: str
    start: int
    end: int
    local: bool = False
    link: str | None = None  # how the leg into this hop travels: direct | relayed | hole-punched, +quic over QUIC

    def as_dict(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "start": self.start, "end": self.end, "local": self.local, "link": self.link}


def ring_hops(
    hops: Iterable[Any], head_peer_id: str, local: tuple[int, int] | None, links: Sequence[str | None] = ()
) -> list[RingHop]:
    """Every hop of the ring in order: the route's hops (anything with peer_id, start and end) and the head's own
    span `local` (the model's first layers or its last), if any; `links[i]`: how the leg into hop i travels."""
    out = [RingHop(h.peer_id, h.start, h.end, link=links[i] if i < len(links) else None) for i, h in enumerate(hops)]
    if local is not None:
        out.insert(0 if local[0] == 0 else len(out), RingHop(head_peer_id, local[0], local[1], True))
    return out


@dataclass(frozen=True)
class RouteRecord:
    """The transport record of a generation over a route (the last route, when it failed over)."""

    route: list[str] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    hops: list[RingHop] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    head_compute_s: float = 0.0
    failovers: list[FailoverEvent] = field(default_factory=list)
    return_link: str | None = None  # how the last peer's leg back to the head travels
    link_moves: list[dict[str, str]] = field(default_factory=list)  # legs moved off a relay mid-session (whose, to what)
    audits: AuditLedger | None = None  # what the audits did (None: not audited)

    def as_dict(self) -> dict[str, Any]:
        return {
            "route": list(self.route),
            "spans": [list(s) for s in self.spans],
            "hops": [h.as_dict() for h in self.hops],
            "return_link": self.return_link,
            "link_moves": [dict(m) for m in self.link_moves],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "head_compute_s": round(self.head_compute_s, 4),
            "failovers": len(self.failovers),
            "failover_s": [round(e.seconds, 3) for e in self.failovers],
            "failover_blamed": [e.blamed for e in self.failovers],
            "failover_events": [e.as_dict() for e in self.failovers],
            **({} if self.audits is None else self.audits.report()),
        }
