"""P2PNode: one py-libp2p host (TCP with noise and yamux; QUIC beside it when it listens on a `/udp/…/quic-v1`
address) with a Kademlia DHT in server mode and dsd's record store.

Dialling a peer that announced both transports, the node tries TCP first and QUIC only when TCP does not get
through (`addrs.dial_order`): py-libp2p would rank QUIC first, and dials one address per transport.

Run it as an async context manager inside the caller's trio code. It connects to the
bootstrap peers, seeds the routing table from them, stores signed discovery records
for the keys it is close to (`record_store`), and hands incoming streams of the
protocols registered with `set_handler` to their handlers as `FramedStream`s.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import IOException
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from dsd.protocol.ids import RECORDS_PROTOCOL

from . import libp2p_logs  # noqa: F401  (hides py-libp2p's churn messages)
from .addrs import announceable, dial_order, is_circuit, is_quic, split_addr
from .dht import ServersOnlyDHT
from .framing import FramedStream, LinkError
from .identity import peer_id_of
from .nat import NatOptions, NatTraversal
from .record_client import LOOKUP_TIMEOUT_S, REQUEST_TIMEOUT_S, RecordClient
from .record_store import RecordStore, serve_records
from .records import record_key

log = logging.getLogger(__name__)

Handler = Callable[[FramedStream, str], Awaitable[None]]
StreamWrapper = Callable[[Any], Any]


CONNECT_TIMEOUT_S = 5.0
TCP_FIRST_S = 2.0  # how long TCP has to connect before QUIC is tried, where a peer announced both (several RTTs)
CLOSE_TIMEOUT_S = 2.0
MAINTENANCE_INTERVAL_S = 15.0
STORE_GC_INTERVAL_S = 1.0


# py-libp2p's auto-connector dials every known peer whenever a node holds fewer than
# 50 connections (go-libp2p's defaults for the public IPFS DHT); a dsd swarm connects on
# demand, so keep no minimum and let it idle.
QUIET_CONNECTIONS = ConnectionConfig(
    min_connections=0, low_watermark=0, high_watermark=300, max_connections=300, auto_connect_interval=3600.0
)


class P2PNode:
    """A libp2p host plus Kademlia DHT (server mode) plus the dsd record store; an async context manager."""

    def __init__(
        self,
        key_pair: KeyPair,
        listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        bootstrap: Sequence[str] = (),
        stream_wrapper: StreamWrapper | None = None,
        allow_peers: set[str] | None = None,
        *,
        wrap_incoming: bool = True,
        require_bootstrap: bool = True,
        dht_server: bool = True,
        nat: NatOptions | None = None,
    ) -> None:
        self.key_pair = key_pair
        self.peer_id: str = peer_id_of(key_pair)
        self.listen_addrs = [split_addr(a)[0] for a in listen_addrs]
        # py-libp2p builds its transports from the listen addresses: a node dials QUIC only if it listens on it too
        self.quic = any(is_quic(str(a)) for a in self.listen_addrs)
        self.bootstrap = list(bootstrap)
        for b in self.bootstrap:
            if split_addr(b)[1] is None:
                raise ValueError(f"bootstrap address {b!r} must end in /p2p/<peer id>")
        self.stream_wrapper = stream_wrapper
        self.wrap_incoming = wrap_incoming
        self.allow_peers = None if allow_peers is None else set(allow_peers)
        self.require_bootstrap = require_bootstrap
        self.dht_server = dht_server
        self.nat_options = nat
        self.nat: NatTraversal | None = None
        self.store = RecordStore(key_for_model=record_key, allow_signers=self._allowed_signers())
        self.host: Any = None
        self.dht: ServersOnlyDHT | None = None
        self._running: AsyncExitStack | None = None
        self._handlers: dict[str, Handler] = {}
        self._fallback_addrs: dict[ID, list[multiaddr.Multiaddr]] = {}  # QUIC addresses tried when TCP fails

    def _allowed_signers(self) -> set[str] | None:
        """In a private swarm, records signed by anyone but the allowed peers (and us) are refused."""
        return None if self.allow_peers is None else self.allow_peers | {self.peer_id}

    def accepts_record_of(self, peer_id: str) -> bool:
        return self.allow_peers is None or peer_id in self.allow_peers or peer_id == self.peer_id

    # --- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> P2PNode:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._run())
            self._running = stack.pop_all()  # kept open until __aexit__ (closed here if starting fails)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop the node; an error from the `async with` block goes on as itself (it never enters the node's nurseries)."""
        running, self._running = self._running, None
        if running is not None:
            await running.aclose()

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[None]:
        """The node's lifetime: the libp2p host, the DHT service and the maintenance task, each in its own `async with`.

        A failure to start comes out as itself, not wrapped in an exception group.
        """
        noise = NoiseTransport(self.key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
        self.host = new_host(
            key_pair=self.key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_preference="YAMUX",
            listen_addrs=self.listen_addrs,
            connection_config=QUIET_CONNECTIONS,
            addrs_factory=self._advertised,
        )
        # With NAT services, a node starts as a DHT client and serves the DHT once it knows it can be dialled:
        # a private node listed in routing tables would send every lookup to an address nobody reaches.
        serve_now = self.dht_server and self.nat_options is None
        self.dht = ServersOnlyDHT(self.host, DHTMode.SERVER if serve_now else DHTMode.CLIENT)
        failure: Exception | None = None
        async with self.host.run(listen_addrs=self.listen_addrs), background_trio_service(self.dht), \
                self._nat_running():
            try:
                await self._start()
            except Exception as exc:  # re-raised below, once the services are stopped
                failure = exc
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._maintain)
                    try:
                        yield
                    finally:
                        nursery.cancel_scope.cancel()
                        await self._hang_up()
        if failure is not None:
            raise failure

    @asynccontextmanager
    async def _nat_running(self) -> AsyncIterator[None]:
        """The NAT services (reachability, relay v2, hole punching) when the node was given NatOptions."""
        if self.nat_options is None:
            yield
            return
        self.nat = NatTraversal(self.host, self.nat_options, self.stream_wrapper)
        async with self.nat.running():
            yield

    async def _start(self) -> None:
        """Serve the registered protocols, join the swarm through the bootstrap peers, learn whether we can be
        dialled (with NAT services), then serve the record store and the DHT unless we cannot."""
        for pid, handler in self._handlers.items():
            self._install(pid, handler)
        if self.bootstrap:
            reached = await self.join(refresh=False)  # the table is refreshed in the background (`_maintain`)
            if not reached and self.require_bootstrap:
                raise ConnectionError(f"no bootstrap peer reachable: {', '.join(self.bootstrap)}")
        if self.nat is not None and self.dht_server:  # heads are DHT clients: nobody dials them, no need to ask
            await self.learn_reachability()
        if self.dht_server:
            self._install(RECORDS_PROTOCOL, self._serve_records, framed=False)

    async def learn_reachability(self) -> str:
        """Ask the bootstrap peers (AutoNAT) whether we can be dialled. A private node stays a DHT client that
        serves no records (nobody could reach it to store or read them); any other serves the DHT."""
        assert self.nat is not None
        servers = [ID.from_base58(pid) for _, pid in map(split_addr, self.bootstrap) if pid and pid != self.peer_id]
        servers = [s for s in servers if self.host.get_network().get_connections(s)]
        # where we listen (not what identify advertises, which is the mapped address once there is one)
        listen = announceable(self.host.get_transport_addrs(), self.peer_id, self.bootstrap)
        reach = await self.nat.learn_reachability(servers, listen)
        if reach == "private":
            self.dht_server = False
        elif self.dht is not None and self.dht.mode != DHTMode.SERVER:
            await self.dht.switch_mode(DHTMode.SERVER)
            await self.host._push_identify_to_all_peers()  # so peers see KAD among our protocols and list us
        return reach

    async def _hang_up(self) -> None:
        """Close connections explicitly so remote peers see us go now (not when sockets are collected)."""
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            try:
                await self.host.close()
            except Exception as exc:
                log.debug("host close: %r", exc)

    @property
    def addrs(self) -> list[str]:
        """The addresses others can reach this node at, each ending in /p2p/<peer id>: its listen addresses
        (0.0.0.0 replaced by the interface toward the swarm), or when it is private (behind a NAT) its
        addresses through the relays it holds slots on, or behind a NAT whose gateway maps it a port, that one."""
        if self.host is None:
            return []
        if self.nat is not None and self.nat.reachability == "private":
            return self.nat.circuit_addrs(self.peer_id)
        if self.nat is not None and self.nat.mapped:  # dialled back through the gateway's mapping: that one only
            return [f"{self.nat.mapped}/p2p/{self.peer_id}"]
        return announceable(self.host.get_addrs(), self.peer_id, self.bootstrap)

    @property
    def reachability(self) -> str:
        """public | private | unknown (no NAT services: a loopback or LAN node, reachable where it listens)."""
        return "unknown" if self.nat is None else self.nat.reachability

    def link_kind(self, peer_id: str, stream: FramedStream | None = None) -> str | None:
        """How streams to `peer_id` (or `stream`, one of them) travel: direct | hole-punched | relayed, with `+quic`
        when the connection is QUIC; None when not connected."""
        if self.nat is not None:
            kind = self.nat.link_kind(peer_id, None if stream is None else stream.stream)
        else:
            kind = "direct" if self._connections(ID.from_base58(peer_id))[1] else None
        if kind is not None and kind != "relayed" and self.quic and self.transport_to(peer_id) == "quic":
            kind += "+quic"
        return kind

    # --- joining the DHT -------------------------------------------------------

    async def join(self, refresh: bool = True) -> int:
        """Connect to the bootstrap peers, add them to the routing table, then (`refresh`) look ourselves up.

        The self-lookup makes the bootstrap peers add us to their tables and returns the
        peers near us, which we add to ours. Returns how many bootstrap peers answered.
        """
        assert self.dht is not None
        reached = 0
        for addr in self.bootstrap:
            ma, pid = split_addr(addr)
            if pid == self.peer_id:
                continue
            try:
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    await self.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                    await self.dht.add_server(ID.from_base58(pid))
                reached += 1
            except trio.TooSlowError:
                log.warning("bootstrap %s: no answer within %.0f s", addr, CONNECT_TIMEOUT_S)
            except Exception as exc:
                log.warning("bootstrap %s unreachable: %r", addr, exc)
        if reached and refresh:
            await self._refresh_table()
        return reached

    async def _refresh_table(self) -> None:
        assert self.dht is not None
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            found = await self.dht.peer_routing.find_closest_peers_network(ID.from_base58(self.peer_id).to_bytes())
            for pid in found:
                if pid.to_base58() != self.peer_id:
                    await self.dht.add_server(pid)

    async def _maintain(self) -> None:
        """Expire stored records often; rejoin if the routing table emptied, else drop the nodes that left and
        refresh it: at once, then every `MAINTENANCE_INTERVAL_S`.

        The first refresh runs here, not in `join`, so a start never waits on unresponsive DHT nodes.
        """
        last_refresh = -MAINTENANCE_INTERVAL_S
        while True:
            await trio.sleep(STORE_GC_INTERVAL_S)
            self.store.expire()
            if trio.current_time() - last_refresh < MAINTENANCE_INTERVAL_S:
                continue
            last_refresh = trio.current_time()
            try:
                if self.bootstrap and self.routing_table_size() == 0:
                    await self.join()
                elif self.routing_table_size():
                    await self._drop_departed()
                    await self._refresh_table()
            except Exception as exc:
                log.debug("routing table maintenance failed: %r", exc)

    async def _drop_departed(self) -> None:
        """Remove from the routing table the nodes with no open connection that cannot be dialled again.

        Nodes that left (a head's process ends after its generation) stay listed otherwise, and this node
        would hand them to every lookup as the closest to some key."""
        assert self.dht is not None
        for client in self.dht.client_peers():  # DHT clients (heads, private peers): nobody should ask them
            self.dht.routing_table.remove_peer(client)
        idle = [p for p in self.dht.routing_table.get_peer_ids() if not self._connections(p)[1]]

        async def check(peer: ID, limiter: trio.CapacityLimiter) -> None:
            async with limiter:
                addrs = self.host.get_peerstore().addrs(peer)
                try:
                    with trio.fail_after(CONNECT_TIMEOUT_S):
                        await self.host.connect(PeerInfo(peer, addrs))
                except Exception as exc:
                    log.debug("dropping %s from the routing table: unreachable (%r)", peer, exc)
                    self.dht.routing_table.remove_peer(peer)

        limiter = trio.CapacityLimiter(8)
        async with trio.open_nursery() as nursery:
            for peer in idle:
                nursery.start_soon(check, peer, limiter)

    def routing_table_size(self) -> int:
        return 0 if self.dht is None else self.dht.get_routing_table_size()

    # --- streams ----------------------------------------------------------------

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        """Serve `protocol_id`: each incoming stream goes to handler(framed stream, remote peer id)."""
        self._handlers[protocol_id] = handler
        if self.host is not None:
            self._install(protocol_id, handler)

    def _install(self, protocol_id: str, handler: Callable[..., Awaitable[None]], framed: bool = True) -> None:
        async def on_stream(stream: Any) -> None:
            remote = stream.muxed_conn.peer_id.to_base58()
            if self.allow_peers is not None and remote not in self.allow_peers:
                log.info("reset %s stream from %s: not in allow_peers", protocol_id, remote)
                await _quiet(stream.reset())
                return
            if self.stream_wrapper is not None and self.wrap_incoming:
                stream = self.stream_wrapper(stream)
            fs: Any = FramedStream(stream, remote=remote) if framed else stream
            try:
                await handler(fs, remote)
            except Exception as exc:
                level = logging.DEBUG if isinstance(exc, (EOFError, ConnectionError, IOException)) else logging.WARNING
                log.log(level, "%s handler for %s failed: %r", protocol_id, remote, exc)
                await _quiet(stream.reset())
                return
            await _quiet(stream.close())

        self.host.set_stream_handler(TProtocol(protocol_id), on_stream)

    def _advertised(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """What identify tells others (and the DHT passes on): the gateway's mapped address once confirmed, not the
        LAN address behind it (the swarm dials one address per transport: the first it knows)."""
        if self.nat is not None and self.nat.mapped:
            return [multiaddr.Multiaddr(self.nat.mapped)]
        return candidates

    def _remember(self, peer_id: str, addrs: Sequence[str]) -> ID:
        pid = ID.from_base58(peer_id)
        mas = []
        for a in addrs:
            if is_circuit(a):  # dialled through NatTraversal; the swarm drops relay addresses anyway
                continue
            ma, embedded = split_addr(a)
            if embedded is not None and embedded != peer_id:
                raise ValueError(f"address {a} belongs to {embedded}, not {peer_id}")
            mas.append(ma)
        if not self.quic and any(is_quic(str(a)) for a in mas):
            mas = [a for a in mas if not is_quic(str(a))]
            if not mas:
                raise LinkError(f"{peer_id} is reachable only over QUIC, and this node does not run it (--quic on)")
        if mas:  # the signed record's addresses replace what identify or the DHT told: the swarm dials the first
            first, fallback = dial_order(mas)
            self._fallback_addrs[pid] = fallback
            self._set_addrs(pid, first)
        return pid

    def _set_addrs(self, pid: ID, mas: Sequence[multiaddr.Multiaddr]) -> None:
        """Make `mas` the addresses the swarm dials `pid` at (a no-op when they already are)."""
        store = self.host.get_peerstore()
        try:
            known = {str(a) for a in store.addrs(pid)}
        except PeerStoreError:  # never seen (or expired)
            known = set()
        if known != {str(a) for a in mas}:
            store.clear_addrs(pid)
            store.add_addrs(pid, list(mas), 0)

    async def open_raw(self, peer_id: str, addrs: Sequence[str], protocol_id: str) -> Any:
        """A new libp2p stream to `peer_id` (dialling `addrs` if not connected), through stream_wrapper.

        Raises LinkError (a ConnectionError) when the peer cannot be reached or refuses the protocol.
        """
        if self.host is None:
            raise RuntimeError("P2PNode is not running (use `async with`)")
        if peer_id == self.peer_id:
            raise ValueError("cannot open a stream to ourselves")
        pid = self._remember(peer_id, addrs)
        try:
            if any(is_circuit(a) for a in addrs) or self._fallback_addrs.get(pid):  # else the swarm dials (and
                await self.connect(peer_id, addrs, pid)  # redials broken connections) itself
            stream = await self._new_stream(pid, protocol_id)
        except Exception as exc:  # dial failures, refused protocols, resets during negotiation
            raise LinkError(f"cannot open {protocol_id} to {peer_id}: {exc!r}") from exc
        return self.stream_wrapper(stream) if self.stream_wrapper is not None else stream

    async def _new_stream(self, pid: ID, protocol_id: str) -> Any:
        """A new stream to `pid`; when its connections broke under us, they are dropped and it is dialled once more.

        py-libp2p keeps a connection the other side closed or reset in its table until it notices,
        and `new_stream` then fails at once ("No valid connections", "Failed to send SYN") instead of
        dialling; a live peer's records or session would be lost to that. Open connections are
        never closed here: the retry happens only when none is left open.
        """
        for retry in (False, True):
            held, open_ = self._connections(pid)
            if held and not open_:
                log.debug("dropping closed connections to %s before opening %s", pid, protocol_id)
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    await _quiet(self.host.disconnect(pid))
            try:
                return await self.host.new_stream(pid, [TProtocol(protocol_id)])
            except Exception as exc:
                if retry or not held or self._connections(pid)[1]:
                    raise
                log.debug("connection to %s broke while opening %s (%r); dialling again", pid, protocol_id, exc)
        raise AssertionError("unreachable")

    async def connect(self, peer_id: str, addrs: Sequence[str], pid: ID | None = None) -> None:
        """Make sure a connection to `peer_id` is open: dial it if needed, through a relay when it announced only
        relayed addresses (then punch a direct one in the background). ConnectionError if it cannot be reached."""
        pid = pid or self._remember(peer_id, addrs)
        if self._connections(pid)[1]:
            return
        if not any(is_circuit(a) for a in addrs):
            await self._dial_direct(peer_id, pid)
        elif self.nat is None:
            raise ConnectionError(f"{peer_id} is reachable only through a relay, and this node runs no relay client")
        else:
            await self.nat.dial(pid, addrs)

    async def _dial_direct(self, peer_id: str, pid: ID) -> None:
        """Dial `pid` at its first-choice addresses (TCP), then, if that fails, at its QUIC ones: a network that
        drops one transport (a firewall, a NAT that punches only UDP, a blackholed path) still reaches it."""
        try:
            first = list(self.host.get_peerstore().addrs(pid))
        except PeerStoreError:  # nothing known but QUIC addresses, or nothing at all
            first = []
        fallback = self._fallback_addrs.get(pid, [])
        try:
            with trio.fail_after(TCP_FIRST_S if fallback else CONNECT_TIMEOUT_S):
                await self.host.connect(PeerInfo(pid, first))
            return
        except Exception as exc:
            if not fallback:
                raise
            log.info("dialling %s over %s failed (%r): trying QUIC at %s", peer_id,
                     ", ".join(str(a) for a in first) or "no address", exc, ", ".join(map(str, fallback)))
        self._set_addrs(pid, fallback)
        self.host.get_network().unblock_peer(pid)  # the failed TCP dial put it in py-libp2p's negative cache
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                await self.host.connect(PeerInfo(pid, fallback))
        finally:
            self._set_addrs(pid, first)  # the next dial tries TCP first again
        log.info("connected to %s over QUIC", peer_id)

    def transport_to(self, peer_id: str) -> str | None:
        """The transport of the open connection to `peer_id`: tcp | quic | relayed; None when not connected."""
        for conn in self.host.get_network().get_connections(ID.from_base58(peer_id)):
            if conn.is_closed:
                continue
            try:
                addrs = [str(a) for a in conn.muxed_conn.get_transport_addresses()]
            except Exception:  # a connection that cannot say (relayed connections may not)
                addrs = []
            if any(is_circuit(a) for a in addrs):
                return "relayed"
            return "quic" if any(is_quic(a) for a in addrs) else "tcp"
        return None

    def _connections(self, pid: ID) -> tuple[int, int]:
        """How many connections the swarm holds to `pid`, and how many of them are still open."""
        conns = self.host.get_network().get_connections(pid)
        return len(conns), sum(not c.is_closed for c in conns)

    async def open(self, peer_id: str, addrs: Sequence[str], protocol_id: str) -> FramedStream:
        """A FramedStream to `peer_id` speaking `protocol_id`; connects if needed."""
        return FramedStream(await self.open_raw(peer_id, addrs, protocol_id), remote=peer_id)

    # --- record store: server side -------------------------------------------

    async def _serve_records(self, raw: Any, remote: str) -> None:
        """Answer one put or get of `remote` from our record store."""
        await serve_records(self.store, raw, remote, REQUEST_TIMEOUT_S)

    # --- record store: client side --------------------------------------------

    async def put_records(self, key: bytes, blobs: Sequence[bytes]) -> int:
        """Store signed records under `key` here and on the closest live nodes (`RecordClient.put`)."""
        return await RecordClient(self).put(key, blobs)

    async def get_records(self, key: bytes) -> list[bytes]:
        """Every signed record under `key` held here or by the closest live nodes (`RecordClient.get`)."""
        return await RecordClient(self).get(key)

    async def hang_up(self, peer_id: str) -> None:
        """Close every connection to `peer_id` (best effort): the next stream dials it afresh, TCP first."""
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await _quiet(self.host.disconnect(ID.from_base58(peer_id)))

    async def forget_peer(self, peer_id: str) -> None:
        """Drop a peer found unresponsive from the routing table and close its connections (best effort)."""
        if self.dht is not None:
            self.dht.routing_table.remove_peer(ID.from_base58(peer_id))
        await self.hang_up(peer_id)


async def _quiet(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except trio.Cancelled:
        raise
    except Exception:
        pass

