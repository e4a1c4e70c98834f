"""Relays in the swarm: relays announce themselves under one DHT key; a private peer (behind a NAT) keeps slots on
at least `MIN_RELAYS` of them, found among its bootstrap peers and in the DHT, and takes new ones when one goes.
A peer asks again now and then whether it can be dialled (`watch_reachability`): a network that changed (a gateway
that now maps a port, a mapping a router forgot) changes what it announces, at once."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

import trio

from .addrs import split_addr
from .announce import Announcer, fetch_records
from .host import P2PNode
from .nat import MIN_RELAYS
from .records import PeerRecord

log = logging.getLogger(__name__)

RELAYS_KEY = "dsd/relays"  # the "model" relays announce under: every relay's record sits under one DHT key
CHECK_INTERVAL_S = 5.0


def relay_announcer(node: P2PNode, ttl_s: float) -> Announcer:
    """Announces that `node` serves circuit relay v2 (a record under RELAYS_KEY), refreshed like any record."""
    return Announcer(node, lambda: PeerRecord(node.peer_id, (), RELAYS_KEY, 0, 1, role="relay"), ttl_s=ttl_s)


async def relay_candidates(node: P2PNode) -> list[tuple[str, str]]:
    """(peer id, address) of relays to try: the bootstrap peers first (a `--bootstrap-only` node relays by
    default), then those announced in the DHT, in random order so private peers spread over them."""
    out: list[tuple[str, str]] = []
    for addr in node.bootstrap:
        pid = split_addr(addr)[1]
        if pid and pid != node.peer_id:
            out.append((pid, addr))
    try:
        found = [r for r in await fetch_records(node, RELAYS_KEY, 0) if r.role == "relay" and r.addrs]
    except Exception as exc:
        log.debug("reading the relays' records failed: %r", exc)
        found = []
    random.shuffle(found)
    known = {pid for pid, _ in out}
    out += [(r.peer_id, r.addrs[0]) for r in found if r.peer_id not in known and r.peer_id != node.peer_id]
    return out


async def top_up(node: P2PNode) -> int:
    """Drop reservations on relays that went away and reserve on new ones until MIN_RELAYS are held; how many
    are held now."""
    nat = node.nat
    assert nat is not None
    nat.drop_lost_relays()
    if len(nat.reservations) >= MIN_RELAYS:
        return len(nat.reservations)
    for pid, addr in await relay_candidates(node):
        if pid not in nat.reservations and await nat.reserve(pid, addr) and len(nat.reservations) >= MIN_RELAYS:
            break
    return len(nat.reservations)


async def keep_relays(node: P2PNode, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """While the node is private: hold slots on MIN_RELAYS relays, checked every CHECK_INTERVAL_S; started once
    the first round has reserved what it could (so the first record carries relayed addresses)."""
    held = 0
    if node.reachability == "private":
        held = await top_up(node)
        if held < MIN_RELAYS:
            log.warning("behind a NAT and only %d relay slot(s) held (want %d): start relays (`dsd-node start "
                        "--bootstrap-only` relays by default) or open a port and pass --reachability public",
                        held, MIN_RELAYS)
    task_status.started(held)
    while True:
        await trio.sleep(CHECK_INTERVAL_S)
        if node.reachability != "private":
            continue
        before = set(node.nat.reservations) if node.nat else set()
        await top_up(node)
        if node.nat and set(node.nat.reservations) != before:
            log.info("relay slots now on %s", ", ".join(sorted(node.nat.reservations)) or "no relay")


async def watch_reachability(node: P2PNode, every_s: float, changed: Callable[[], Awaitable[object]] | None = None,
                             ) -> None:
    """Ask the AutoNAT servers again about every `every_s` seconds (jittered ×0.8–1.2), the gateway's mapping
    included; when the verdict or the announced addresses change, hold relay slots at once if private now, log
    it and call `changed` (republish the records)."""
    while True:
        await trio.sleep(every_s * random.uniform(0.8, 1.2))
        before = (node.reachability, list(node.addrs))
        try:
            await node.learn_reachability()
        except Exception as exc:
            log.warning("reachability check failed: %r; keeping %s", exc, before[0])
            continue
        if node.reachability == "private":
            await top_up(node)
        after = (node.reachability, list(node.addrs))
        if after == before:
            continue
        log.warning("the network changed: %s, was %s; announcing %s", after[0], before[0], " ".join(after[1]))
        if changed is not None:
            await changed()
