"""`GET /api/swarm` and `GET /`: the swarm page and the JSON it polls.

The JSON is the last survey (`SwarmView.report`, as `dsd-node route --json` prints it) shaped
for the page: every peer with a short id and alive/dead (a peer that answered an earlier
survey but not the last one stays listed as dead for `DEAD_KEPT_S`), the coverage of each
layer, the current route (the whole ring: a head that serves layers itself, `serve --blocks`,
is a hop marked `local`, and counts in the coverage), the last requests' speculative-decoding
statistics and the service's load. Both routes are public, like `/metrics`: they show no
prompts, texts or keys. Nothing here surveys: the page shows what the background survey found.
"""

from __future__ import annotations

import time
from importlib.resources import files
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from dsd.node.head.setup import parse_draft
from dsd.node.route.record import ring_hops

from .runner import RequestRecord, ServiceState

SHORT_ID_CHARS = 12  # as `dsd-node route` prints peer ids
REQUESTS_SHOWN = 20
CHANGES_SHOWN = 12  # the newest swarm changes (joins, leaves, moves) the page lists
PAGE = "page.html"


def short_id(peer_id: str) -> str:
    """The tail of a peer id (libp2p ids share their first characters)."""
    return peer_id[-SHORT_ID_CHARS:]


def _peers(state: ServiceState, report: dict[str, Any]) -> list[dict[str, Any]]:
    route = {h["peer_id"] for h in (report["route"] or {}).get("hops", [])}
    banned = state.swarm.bans.active()
    surveyed = state.swarm.surveyed_unix
    peers = []
    for p in report["peers"]:
        alive = p["rtt_ms"] is not None
        seen = surveyed if alive else state.swarm.last_alive.get(p["peer_id"], (None, None))[1]
        peers.append({
            "peer_id": p["peer_id"], "short_id": short_id(p["peer_id"]), "start": p["start"], "end": p["end"],
            "throughput": p["throughput"], "rtt_ms": p["rtt_ms"], "cache_tokens_left": p["cache_tokens_left"],
            "version": p["version"], "dtype": p["dtype"], "alive": alive, "in_route": p["peer_id"] in route,
            "last_seen_unix": seen, "state": "alive" if alive else "unreachable",
            "reachability": p.get("reachability", "unknown"), "link": p.get("link"), "banned": p["peer_id"] in banned,
            "load": p.get("load"),
        })
    listed = {p["peer_id"] for p in peers}
    for peer_id, (rec, seen) in sorted(state.swarm.last_alive.items(), key=lambda kv: (kv[1][0].start, kv[0])):
        if peer_id not in listed:  # announced no more (stopped, or its record expired)
            peers.append({
                "peer_id": peer_id, "short_id": short_id(peer_id), "start": rec.start, "end": rec.end,
                "throughput": rec.throughput, "rtt_ms": None, "cache_tokens_left": rec.cache_tokens_left,
                "version": rec.version, "dtype": rec.dtype, "alive": False, "in_route": False,
                "last_seen_unix": seen, "state": "gone", "reachability": rec.reachability, "link": None,
                "banned": peer_id in banned, "load": None,
            })
    return peers


def draft_kind(draft: str) -> str:
    """"ngram", "model" or "model+ngram": what drafts, without the server's paths."""
    store, ngram = parse_draft(draft)
    return "+".join(kind for kind, used in (("model", store is not None), ("ngram", ngram)) if used)


def _request(rec: RequestRecord) -> dict[str, Any]:
    d = rec.as_dict()
    d["route"] = [short_id(p) for p in rec.route]
    return d


def swarm_body(state: ServiceState) -> dict[str, Any]:
    """What the swarm page shows, as JSON."""
    watch, head = state.swarm, state.head
    if watch.view is not None:
        report = watch.view.report(watch.model, watch.num_layers)
    else:
        report = {"peers": [], "coverage": [0] * watch.num_layers, "route": None,
                  "missing_blocks": watch.missing.missing_blocks, "error": "the swarm has not been surveyed yet"}
    route = None
    if watch.view is not None and watch.view.plan is not None:
        hops = ring_hops(watch.view.plan.hops, state.node.peer_id, head.local_blocks)
        route = {"hops": [{**h.as_dict(), "short_id": short_id(h.peer_id)} for h in hops],
                 "est_round_ms": round(watch.view.plan.est_round_s * 1000, 3)}
    coverage = list(report["coverage"])
    local = None
    if head.local_blocks is not None:
        start, end = head.local_blocks
        local = {"peer_id": state.node.peer_id, "short_id": short_id(state.node.peer_id), "start": start, "end": end}
        coverage[start:end] = [c + 1 for c in coverage[start:end]]
    now = time.time()
    return {
        "model": head.model_id,
        "num_layers": head.num_layers,
        "now_unix": round(now, 3),
        "surveyed_unix": round(watch.surveyed_unix, 3) if watch.view is not None else None,
        "peers": _peers(state, report),
        "coverage": coverage,
        "local": local,
        "route": route,
        "missing_blocks": report["missing_blocks"],
        "error": report["error"],
        "bans": [{**b.as_dict(), "short_id": short_id(b.peer_id)} for b in watch.bans.active().values()],
        "changes": [{**c.as_dict(), "short_id": short_id(c.peer_id)} for c in list(watch.changes)[-CHANGES_SHOWN:][::-1]],
        "requests": [_request(r) for r in list(state.records)[-REQUESTS_SHOWN:][::-1]],
        "service": {
            "mode": head.options.mode, "draft": draft_kind(head.options.draft), "running": state.admission.running,
            "waiting": state.admission.waiting, "max_concurrent": state.admission.max_running,
            "queue": state.admission.max_waiting, "uptime_s": round(now - state.started_unix, 1),
            "head_peer_id": state.node.peer_id, "device": head.device, "dtype": head.dtype,
        },
    }


def page_html() -> str:
    """The swarm page: one self-contained file (inline CSS and JS) shipped as package data."""
    return files(__package__).joinpath(PAGE).read_text(encoding="utf-8")


def page_routes() -> list[BaseRoute]:
    """`GET /` (the page) and `GET /api/swarm` (its JSON)."""
    html = page_html()

    async def page(request: Request) -> Response:
        return HTMLResponse(html, headers={"cache-control": "no-cache"})

    async def api_swarm(request: Request) -> Response:
        state: ServiceState = request.app.state.service
        return JSONResponse(swarm_body(state), headers={"cache-control": "no-store"})

    return [Route("/", page, methods=["GET"]), Route("/api/swarm", api_swarm, methods=["GET"])]
