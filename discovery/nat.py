"""NAT traversal for one libp2p host: reachability (AutoNAT v1), circuit relay v2 (serving it, reserving slots on
relays, dialling through them) and hole punching (DCUtR), all from py-libp2p, sized and wired for dsd.

A peer behind a home NAT cannot be dialled at the address it listens on. It learns so from AutoNAT dial-backs and
asks its gateway to map a port (UPnP IGD, `portmap.py`): when a second round of dial-backs reaches it at the mapped
address, it announces that address and is public. Otherwise it reserves a slot on relays and announces
`<relay>/p2p-circuit/p2p/<itself>`; whoever dials it goes through a relay first and then, in the background, tries
DCUtR to punch a direct connection. New streams take the direct connection once it exists (the swarm prefers direct
ones); a relayed connection is closed only once no stream uses it, so a session that opened over the relay is never
cut by the upgrade.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from .addrs import circuit_addr, is_circuit, is_quic, split_addr, tcp_endpoint
from .portmap import PortMapper

log = logging.getLogger(__name__)

REACHABILITY_MODES = ("auto", "public", "private")
LINK_KINDS = ("direct", "relayed", "hole-punched")

# What one relay grants. A relayed connection carries every session between two peers for as long as both
# live: hidden states are 6 KB (1.5B model, fp32) to 16 KB (70B, fp16) per token and leg, a long prompt's
# prefill tens of MB. So a circuit may live 6 h and move 16 GiB (go/js relays grant 2 min / 128 KiB, made for
# signalling only); a circuit that reaches either limit is reset, and the route fails over like after any
# lost link. 64 circuits per reserving peer (heads and the peers before it), 128 reserving peers per relay.
RELAY_LIMITS = RelayLimits(duration=6 * 3600, data=16 << 30, max_circuit_conns=64, max_reservations=128)
MIN_RELAYS = 2  # a private peer keeps slots on this many relays, so losing one relay never strands it
AUTONAT_SERVERS = 3  # dial-backs asked for; the verdict is the majority of those that answered
DIAL_BACK_TIMEOUT_S = 3.0
DIAL_TIMEOUT_S = 8.0
PUNCH_TIMEOUT_S = 40.0  # a failed TCP punch ends in ~22 s; one still running after this is given up (DCUtR may hang)
RELAY_IDLE_CHECK_S = 5.0


class _Unshared(dict):
    """A dict that keeps nothing: the library's table of circuits by peer id (see CircuitRelay)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class CircuitRelay(CircuitV2Protocol):
    """Circuit relay v2, corrected and shaped.

    The library files each circuit under a peer id (its source's, then its destination's) and, when either
    direction of any circuit ends, closes whatever circuit is filed under that id: the end of one head's
    circuit to a peer cut that peer's live circuit to the next peer (seen as failovers on symmetric NATs).
    Here each circuit closes its own two streams and nothing else. Forwarded bytes cross this node's emulated WAN
    link (`stream_wrapper`), so a relayed leg costs two links' latency, as through a real relay."""

    def __init__(self, *args: Any, stream_wrapper: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_wrapper = stream_wrapper
        self._active_relays = _Unshared()

    async def _relay_data(self, src_stream: Any, dst_stream: Any, *args: Any, **kwargs: Any) -> None:
        try:
            out = self.stream_wrapper(dst_stream) if self.stream_wrapper is not None else dst_stream
            await super()._relay_data(src_stream, out, *args, **kwargs)
        finally:  # one direction ended: end this circuit (the other direction's read then ends too)
            await self._close_stream(src_stream)
            await self._close_stream(dst_stream)


class HonestAutoNAT(AutoNATService):
    """AutoNAT v1 whose dial-back opens a new connection to the address asked about (TCP, or QUIC for a QUIC address).

    py-libp2p's server "dials" with `host.connect`, which returns at once over the connection the request
    came on, so it proves nothing; a fresh TCP handshake (or QUIC connection) from here proves the port takes
    connections from outside. The server still only dials addresses at the requester's observed IP (the spec's amplification rule),
    so a peer behind a NAT, which announces its LAN address, gets a refusal: not reachable at what it announces."""

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        for raw in addrs:
            ma = multiaddr.Multiaddr(raw)
            if is_quic(str(ma)):
                if await self._quic_dial_back(peer_id, ma):
                    return bytes(raw)
                continue
            end = tcp_endpoint(ma)
            if end is None:
                continue
            try:
                with trio.fail_after(DIAL_BACK_TIMEOUT_S):
                    stream = await trio.open_tcp_stream(*end)
                await stream.aclose()
                return bytes(raw)
            except (OSError, trio.TooSlowError):
                continue
        return None

    async def _quic_dial_back(self, peer_id: ID, ma: multiaddr.Multiaddr) -> bool:
        """A fresh QUIC connection to `ma` (a new handshake from here, not the connection the request came on), closed
        at once: True if the peer answered there. Needs this node to run QUIC (listen on a QUIC address)."""
        try:
            with trio.fail_after(DIAL_BACK_TIMEOUT_S):
                conn = await self.host.get_network().dial_addr(ma, peer_id)
        except Exception as exc:
            log.debug("AutoNAT: QUIC dial-back to %s failed: %r", ma, exc)
            return False
        with trio.move_on_after(DIAL_BACK_TIMEOUT_S):
            await conn.close()
        return True


class PatientDCUtR(DCUtRProtocol):
    """DCUtR that closes a peer's relayed connection only once no stream uses it (the library closes it 60 s
    after a punch, which would reset a session opened over the relay in the middle of a generation)."""

    async def _close_relayed_conns_after_grace(self, peer_id: ID, grace: float = 60.0) -> None:
        await trio.sleep(grace)
        while True:
            relayed = [c for c in self.host.get_network().get_connections(peer_id) if _kind(c) == "relayed"]
            if not relayed or not await self._verify_direct_connection(peer_id):
                return
            idle = [c for c in relayed if not c.get_streams()]
            for conn in idle:
                log.info("closing the idle relayed connection to %s: a direct one took over", peer_id)
                await conn.close()
            if len(idle) == len(relayed):
                return
            await trio.sleep(RELAY_IDLE_CHECK_S)


def _kind(conn: Any) -> str:
    try:
        return "relayed" if conn.get_connection_type() == ConnectionType.RELAYED else "direct"
    except Exception:
        return "direct"


@dataclass
class NatOptions:
    """How a node deals with NATs: `reachability` auto (ask AutoNAT) | public | private; `relay`: serve circuit relay
    v2; `punch`: upgrade relayed connections by hole punching (off: they stay relayed, a baseline to measure);
    `port_mapping`: when AutoNAT finds it private, ask the gateway for a port (UPnP) and announce it if confirmed."""

    reachability: str = "auto"
    relay: bool = False
    punch: bool = True
    port_mapping: bool = True

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY_MODES:
            raise ValueError(f"reachability must be one of {REACHABILITY_MODES}, got {self.reachability!r}")


class _SeenRelayed:
    """A network notifee that remembers which peers were ever connected over a relay (a later direct
    connection to them is then a punched one)."""

    def __init__(self, peers: set[str]) -> None:
        self.peers = peers

    async def connected(self, network: Any, conn: Any) -> None:
        if _kind(conn) == "relayed":
            self.peers.add(conn.muxed_conn.peer_id.to_base58())

    async def opened_stream(self, network: Any, stream: Any) -> None: ...
    async def closed_stream(self, network: Any, stream: Any) -> None: ...
    async def disconnected(self, network: Any, conn: Any) -> None: ...
    async def listen(self, network: Any, ma: Any) -> None: ...
    async def listen_close(self, network: Any, ma: Any) -> None: ...


class NatTraversal:
    """The NAT services of one running host: AutoNAT (server and client), relay v2 (hop if `relay`, stop and
    client always), DCUtR. `running()` starts them; the node calls `learn_reachability`, `reserve`, `dial`.
    `stream_wrapper` (the emulated WAN) delays what the relay forwards."""

    def __init__(self, host: Any, options: NatOptions, stream_wrapper: Any = None) -> None:
        self.host = host
        self.options = options
        self.reachability = options.reachability if options.reachability != "auto" else "unknown"
        self.reservations: dict[str, str] = {}  # relay peer id -> the relay's address we reserved through
        self.portmap = PortMapper() if options.port_mapping and options.reachability == "auto" else None
        self.mapped: str | None = None  # the gateway's mapped address, once a dial-back reached us there
        self._renewing = False
        self.punches: list[dict[str, Any]] = []  # each punch we initiated: peer, ok, seconds
        self._seen_relayed: set[str] = set()
        self._punching: set[str] = set()
        self._nursery: trio.Nursery | None = None
        roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if options.relay else RelayRole(0))
        self.relay = CircuitRelay(host, RELAY_LIMITS, allow_hop=options.relay, stream_wrapper=stream_wrapper)
        self.transport = CircuitV2Transport(host, self.relay, RelayConfig(roles=roles, limits=RELAY_LIMITS))
        self.dcutr = PatientDCUtR(host)
        self.autonat = HonestAutoNAT(host, serve=True)
        host.get_network().register_notifee(_SeenRelayed(self._seen_relayed))

    @asynccontextmanager
    async def running(self) -> AsyncIterator[NatTraversal]:
        async with background_trio_service(self.relay), AsyncExitStack() as stack:
            if self.options.punch:
                await stack.enter_async_context(background_trio_service(self.dcutr))
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    yield self
                finally:
                    self._nursery = None
                    nursery.cancel_scope.cancel()
                    if self.portmap is not None:
                        await self.portmap.close()

    # --- reachability -----------------------------------------------------------

    async def learn_reachability(self, servers: Sequence[ID], addrs: Sequence[str]) -> str:
        """Ask up to AUTONAT_SERVERS connected peers to dial `addrs` back; the majority of the answers decides.
        Private, with port mapping on: ask the gateway for the listen port and have the mapped address dialled
        back too; public at it if the majority reached us there (`mapped`), else the mapping is removed.

        A small swarm has one or two servers, not the spec's four: one answer is enough, ties stay unknown.
        With --reachability public|private set, nothing is asked."""
        if self.options.reachability != "auto":
            return self.reachability
        direct = [a for a in addrs if not is_circuit(a)]
        reach = await self._dial_backs(servers, direct)
        if reach == "private" and self.portmap is not None:
            reach = await self._try_mapping(servers, direct)
        if reach == "unknown" and self.reachability != "unknown":  # no answers is no news: keep the last verdict
            log.debug("no AutoNAT server answered; still %s", self.reachability)
            return self.reachability
        if reach != self.reachability:
            log.info("reachability: %s%s", reach, f" (at {self.mapped}, a port the gateway maps)" if self.mapped else "")
        self.reachability = reach
        return reach

    async def _dial_backs(self, servers: Sequence[ID], addrs: Sequence[str]) -> str:
        """public | private | unknown: what the majority of the AutoNAT servers that answered found at `addrs`."""
        raw = [split_addr(a)[0].to_bytes() for a in addrs]
        verdicts: list[bool] = []
        for server in list(servers)[:AUTONAT_SERVERS]:
            try:
                status, _ = await self.autonat.query_server(server, raw, timeout=2 * DIAL_BACK_TIMEOUT_S + 2)
            except Exception as exc:
                log.debug("AutoNAT server %s did not answer: %r", server, exc)
                continue
            if status in (int(AutoNATMessage.OK), int(AutoNATMessage.E_DIAL_ERROR), int(AutoNATMessage.E_DIAL_REFUSED)):
                verdicts.append(status == int(AutoNATMessage.OK))
        yes, no = verdicts.count(True), verdicts.count(False)
        log.debug("AutoNAT: %d of %d dial-backs to %s reached us", yes, len(verdicts), ", ".join(addrs))
        return "public" if yes > no else "private" if no > yes else "unknown"

    async def _try_mapping(self, servers: Sequence[ID], addrs: Sequence[str]) -> str:
        """Private at `addrs`: map the listen port on the gateway, keep it if a dial-back gets through it."""
        assert self.portmap is not None and self._nursery is not None
        ends = [e for e in (tcp_endpoint(split_addr(a)[0]) for a in addrs) if e]
        if not ends:
            return "private"
        if self.portmap.mapping is None and await self.portmap.open(ends[0][1]) is None:
            return "private"
        mapping = self.portmap.mapping
        assert mapping is not None
        if await self._dial_backs(servers, [mapping.multiaddr]) != "public":
            log.warning("the gateway maps %s to us but no AutoNAT dial-back got through it: not announcing it, "
                        "reached through relays", mapping.multiaddr)
            self.portmap.failure = f"the gateway maps {mapping.multiaddr} but nothing it forwards reaches us"
            self.mapped = None
            await self.portmap.close()
            return "private"
        self.mapped = mapping.multiaddr
        if not self._renewing:
            self._nursery.start_soon(self._renew)
        return "public"

    async def _renew(self) -> None:
        """Renew the gateway's lease while we hold a mapping (one renewer at a time)."""
        assert self.portmap is not None
        self._renewing = True
        try:
            await self.portmap.keep()
        finally:
            self._renewing = False

    # --- relays -------------------------------------------------------------------

    async def reserve(self, relay_id: str, relay_addr: str) -> bool:
        """Reserve a slot on one relay (renewed by the transport until it goes away); True if granted."""
        assert self._nursery is not None, "NatTraversal is not running"
        pid = ID.from_base58(relay_id)
        try:
            with trio.fail_after(DIAL_TIMEOUT_S):
                await self.host.connect(PeerInfo(pid, [split_addr(relay_addr)[0]]))
                stream = await self.host.new_stream(pid, [HOP_PROTOCOL])
                ok = await self.transport.reserve(stream, pid, self._nursery)
        except Exception as exc:
            log.debug("no reservation on %s: %r", relay_id, exc)
            return False
        if ok:
            self.reservations[relay_id] = relay_addr
            log.info("reserved a relay slot on %s", relay_id)
        return bool(ok)

    def drop_lost_relays(self) -> list[str]:
        """Forget reservations on relays we hold no open connection to any more; the relays dropped."""
        lost = [r for r in self.reservations if not self._open_conns(ID.from_base58(r))]
        for relay in lost:
            del self.reservations[relay]
            self.transport._reservations.pop(ID.from_base58(relay), None)  # stop its renewals
            log.warning("relay %s went away: its reservation is dropped", relay)
        return lost

    def circuit_addrs(self, peer_id: str) -> list[str]:
        return [circuit_addr(addr, relay, peer_id) for relay, addr in sorted(self.reservations.items())]

    # --- dialling ------------------------------------------------------------------

    async def dial(self, pid: ID, addrs: Sequence[str]) -> None:
        """Connect to `pid`: its direct addresses first, then through each relay it announced; after a relayed
        connection, try to punch a direct one in the background. ConnectionError if nothing answers."""
        direct = [split_addr(a)[0] for a in addrs if not is_circuit(a)]
        failures: list[str] = []
        if direct:
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    await self.host.connect(PeerInfo(pid, direct))
                return
            except Exception as exc:
                failures.append(f"direct: {exc!r}")
        for addr in (a for a in addrs if is_circuit(a)):
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    await self.transport.dial(multiaddr.Multiaddr(addr))
            except Exception as exc:
                failures.append(f"{addr}: {exc!r}")
                continue
            self._seen_relayed.add(pid.to_base58())
            self.punch_soon(pid)
            return
        raise ConnectionError(f"cannot reach {pid}: " + "; ".join(failures or ["no address"]))

    def punch_soon(self, pid: ID) -> None:
        """Try DCUtR toward `pid` in the background (a failed punch takes ~22 s: never on the critical path)."""
        peer = pid.to_base58()
        if self._nursery is None or peer in self._punching or not self.options.punch:
            return
        self._punching.add(peer)
        self._nursery.start_soon(self._punch, pid)

    def punching(self, peer_id: str) -> bool:
        """Is a punch toward `peer_id` that we started still running?"""
        return peer_id in self._punching

    async def _punch(self, pid: ID) -> None:
        started = trio.current_time()
        ok = False
        try:
            with trio.move_on_after(PUNCH_TIMEOUT_S) as scope:
                ok = await self.dcutr.initiate_hole_punch(pid)
            if scope.cancelled_caught:
                log.info("hole punch to %s still unfinished after %.0f s: given up", pid, PUNCH_TIMEOUT_S)
        except Exception as exc:
            log.debug("hole punch to %s failed: %r", pid, exc)
        seconds = trio.current_time() - started
        self.punches.append({"peer": pid.to_base58(), "ok": bool(ok), "seconds": round(seconds, 3)})
        log.info("hole punch to %s %s after %.1f s", pid, "succeeded" if ok else "failed (staying relayed)", seconds)
        self._punching.discard(pid.to_base58())

    # --- what a link is --------------------------------------------------------------

    def _open_conns(self, pid: ID) -> list[Any]:
        return [c for c in self.host.get_network().get_connections(pid) if not c.is_closed]

    def link_kind(self, peer_id: str, stream: Any = None) -> str | None:
        """How new streams to `peer_id` travel now (or `stream`, a libp2p stream to it, travels: over the
        connection it was opened on, which a punch that succeeds later does not change): direct, hole-punched
        (direct, after a relay) or relayed; None when not connected."""
        conns = self._open_conns(ID.from_base58(peer_id))
        muxed = getattr(stream, "muxed_conn", None)
        if muxed is not None:
            conns = [c for c in conns if getattr(c, "muxed_conn", None) is muxed] or conns
        kinds = {_kind(c) for c in conns}
        if "relayed" in kinds:
            self._seen_relayed.add(peer_id)
        if "direct" in kinds:
            return "hole-punched" if peer_id in self._seen_relayed else "direct"
        return "relayed" if kinds else None
