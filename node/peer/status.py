"""What a running peer tells its volunteer: plain lines at start, then one status line a minute (`--status-s`),
also kept in its ready file for `dsd-node status` (issue 59)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dsd.discovery.announce import Announcer
from dsd.shard_store.files import atomic_write_bytes

from .host import Peer


def peer_status(peer: Peer, announcer: Announcer | None, role: str = "block") -> dict[str, Any]:
    """The peer's state now: what it serves, how it is reached and announced, its sessions, rows served and load."""
    node, server = peer.node, peer.dispatcher.server
    out: dict[str, Any] = {"at_unix": round(time.time(), 3), "peer_id": node.peer_id, "role": role,
                           "reachability": node.reachability, "addrs": list(node.addrs),
                           "announced_to": announcer.last_stored_at if announcer is not None else None}
    if server is not None:
        load = server.batcher.report()
        out.update(model=server.model_id, start=server.start, end=server.end, weights=server.span.weights,
                   sessions=len(server.sessions), windows_served=server.windows_served,
                   rows_served=server.rows_served, busy=round(load.busy, 3), rows_per_s=round(load.rows_per_s, 2),
                   draining=server.closing)
    return out


def status_line(st: dict[str, Any]) -> str:
    """One plain line of a status: what is served, the sessions, the work done, the load, how it is reached."""
    parts = []
    if "start" in st:
        parts.append(f"serving blocks {st['start']}:{st['end']} of {st['model']} ({st['weights']})"
                     + (", draining" if st.get("draining") else ""))
        parts.append(f"{st['sessions']} sessions open")
        parts.append(f"{st['rows_served']} tokens served in {st['windows_served']} windows")
        parts.append(f"busy {100 * st['busy']:.0f} % ({st['rows_per_s']:g} tokens/s)")
    elif st.get("role") == "federated":
        parts.append("a federated worker (whole model, top-K answers)")
    else:
        parts.append("serving no blocks (DHT and relay only)")
    reach = {"public": "reachable directly", "private": "reached through relays"}.get(st["reachability"],
                                                                                       "reachability unknown")
    parts.append(reach)
    if st.get("announced_to") is not None:
        parts.append(f"records on {st['announced_to']} DHT nodes")
    return " · ".join(parts)


def why_serving(info: dict[str, Any], blocks_option: str | None) -> str:
    """The start-up line that says what this peer serves and why."""
    how = "the least covered span (--blocks auto)" if blocks_option in (None, "auto") else f"as asked (--blocks {blocks_option})"
    if info.get("role") == "federated":
        return (f"serving all {info['num_layers']} layers of {info['model']} as a federated worker (top-K answers), "
                f"computing in {info['dtype']} on {info['device']}")
    return (f"serving blocks {info['start']}:{info['end']} of {info['model']} ({info['num_layers']} layers): {how}; "
            f"weights {info['weights']}, computing in {info['dtype']} on {info['device']}, "
            f"{info['throughput']:.3g} tokens/s through the span")


def write_status(ready_file: Path, info: dict[str, Any], st: dict[str, Any]) -> None:
    """The ready file again, with the status in it (atomically: `dsd-node status` may read it at any moment)."""
    atomic_write_bytes(ready_file, json.dumps({**info, "status": st}, indent=2).encode())
