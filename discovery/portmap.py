"""Port mapping on a home gateway (UPnP IGD through miniupnpc): ask the router to forward a public port to the port
this peer listens on, so others dial it directly instead of through relays.

A mapping is only a claim of the gateway: the node announces the mapped address once an AutoNAT dial-back reached
it there (`host.learn_reachability`), renews the lease at half its length while it runs, and removes the mapping
when it stops. Every way this can go wrong ends in a `PortMapError` naming it, and the node goes on through relays:
no gateway answering on the LAN, a gateway that refuses, one whose external address is itself private (a second
NAT beyond it), one that lists a mapping other than the one asked for. miniupnpc's calls block: they run in a
thread, each under a deadline.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

log = logging.getLogger(__name__)

LEASE_S = 1800  # asked of the gateway; renewed at half (a gateway granting only permanent mappings gets 0)
DISCOVER_MS = 1500  # how long the SSDP search listens for gateways
CALL_TIMEOUT_S = 10.0  # one gateway call (SOAP over HTTP on the LAN)
DESCRIPTION = "dsd-node"

T = TypeVar("T")


class PortMapError(Exception):
    """Why the gateway gave no usable mapping."""


@dataclass(frozen=True)
class Mapping:
    """A port the gateway forwards: its external address and port to ours, for `lease_s` seconds (0: until removed)."""

    external_ip: str
    external_port: int
    internal_ip: str
    internal_port: int
    protocol: str
    lease_s: int

    @property
    def multiaddr(self) -> str:
        """The mapped address as a multiaddr (without /p2p)."""
        return f"/ip4/{self.external_ip}/{self.protocol.lower()}/{self.external_port}"


def _private(ip: str) -> bool:
    """An address no one beyond the gateway can dial back: RFC 1918, shared (carrier NAT), link-local, loopback."""
    addr = ipaddress.ip_address(ip)
    return any(addr in ipaddress.ip_network(net) for net in (
        "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "127.0.0.0/8"))


class UpnpGateway:
    """One UPnP Internet Gateway Device on the LAN, through miniupnpc (blocking calls: see `PortMapper`)."""

    def __init__(self, discover_ms: int = DISCOVER_MS, client: Any = None) -> None:
        if client is None:
            import miniupnpc  # ships with the pinned libp2p

            client = miniupnpc.UPnP()
        self.upnp = client
        self.upnp.discoverdelay = discover_ms
        self.found = False

    def find(self) -> str:
        """Search the LAN for a gateway; its external address. PortMapError if none answers or it is unusable."""
        try:
            devices = self.upnp.discover()
        except Exception as exc:  # miniupnpc raises "Success" on some platforms after a search that found devices
            if str(exc) != "Success":
                raise PortMapError(f"UPnP search failed: {exc}") from exc
            devices = 1
        if not devices:
            raise PortMapError("no UPnP gateway answered on the LAN")
        try:
            self.upnp.selectigd()
        except Exception as exc:
            if "no upnp device" in str(exc).lower():  # the search counted nothing it could use as a device
                raise PortMapError("no UPnP gateway answered on the LAN") from exc
            raise PortMapError(f"UPnP devices answered but none is an Internet gateway: {exc}") from exc
        external = self._external()
        self.found = True
        return external

    def _external(self) -> str:
        try:
            external = self.upnp.externalipaddress()
            ipaddress.IPv4Address(external)
        except Exception as exc:
            raise PortMapError(f"the gateway gives no valid external address ({exc})") from exc
        if _private(external):
            raise PortMapError(f"the gateway's external address {external} is private: another NAT lies beyond it")
        return external

    def map(self, internal_port: int, protocol: str = "TCP", lease_s: int = LEASE_S) -> Mapping:
        """Ask for `internal_port` on this machine's LAN address, the same external port first, else any the gateway
        picks; the mapping as the gateway then lists it. PortMapError if refused or listed otherwise."""
        if not self.found:
            raise PortMapError("no gateway: call find() first")
        if not 0 < internal_port < 65536:
            raise PortMapError(f"cannot map port {internal_port}")
        lan = self.upnp.lanaddr
        external_ip = self._external()
        port, lease = internal_port, lease_s
        try:
            self.upnp.addportmapping(port, protocol, lan, internal_port, DESCRIPTION, "", lease)
        except Exception as first:
            try:  # the port is taken (another machine of the LAN) or the lease refused: let the gateway choose
                port = int(self.upnp.addanyportmapping(internal_port, protocol, lan, internal_port, DESCRIPTION, "",
                                                        lease))
            except Exception as exc:
                raise PortMapError(f"the gateway refused to map {protocol} port {internal_port}: {first}; {exc}") from exc
        listed = self.upnp.getspecificportmapping(port, protocol)
        if not listed or listed[0] != lan or int(listed[1]) != internal_port:
            raise PortMapError(f"the gateway accepted {protocol} {external_ip}:{port} -> {lan}:{internal_port} but "
                               f"lists {listed!r} for it")
        return Mapping(external_ip, port, lan, internal_port, protocol, lease)

    def renew(self, mapping: Mapping) -> None:
        """Ask again for the same mapping (a new lease); PortMapError if it is gone or refused."""
        try:
            self.upnp.addportmapping(mapping.external_port, mapping.protocol, mapping.internal_ip,
                                     mapping.internal_port, DESCRIPTION, "", mapping.lease_s)
        except Exception as exc:
            raise PortMapError(f"the gateway refused to renew {mapping.multiaddr}: {exc}") from exc

    def unmap(self, mapping: Mapping) -> None:
        """Remove the mapping (PortMapError if the gateway refuses)."""
        try:
            self.upnp.deleteportmapping(mapping.external_port, mapping.protocol)
        except Exception as exc:
            raise PortMapError(f"the gateway did not remove {mapping.multiaddr}: {exc}") from exc


class PortMapper:
    """A node's mapping on its gateway: `open` asks for one, `keep` renews it until cancelled, `close` removes it."""

    def __init__(self, gateway: UpnpGateway | None = None) -> None:
        self._gateway = gateway
        self.mapping: Mapping | None = None
        self.failure: str | None = None  # why there is no mapping, for status lines

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with trio.fail_after(CALL_TIMEOUT_S):
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

    async def open(self, internal_port: int, lease_s: int = LEASE_S) -> Mapping | None:
        """Find the gateway and map `internal_port`; the mapping, or None with the reason logged and kept."""
        try:
            if self._gateway is None:
                self._gateway = await self._call(UpnpGateway)
            if not self._gateway.found:
                await self._call(self._gateway.find)
            self.mapping = await self._call(self._gateway.map, internal_port, "TCP", lease_s)
        except (PortMapError, trio.TooSlowError) as exc:
            self.failure = str(exc) if isinstance(exc, PortMapError) else "the gateway did not answer in time"
            log.info("no port mapping: %s (reached through relays instead)", self.failure)
            if self._gateway is not None:
                self._gateway.found = False  # search again next time: the gateway may have gone or changed
            return None
        self.failure = None
        log.info("the gateway maps %s to port %d here (lease %s)", self.mapping.multiaddr, internal_port,
                 f"{self.mapping.lease_s} s" if self.mapping.lease_s else "permanent")
        return self.mapping

    async def keep(self) -> None:
        """Renew the lease at half its length until cancelled; a failed renewal is logged and retried sooner."""
        while self.mapping is not None and self.mapping.lease_s:
            await trio.sleep(self.mapping.lease_s / 2)
            try:
                assert self._gateway is not None
                await self._call(self._gateway.renew, self.mapping)
                log.debug("renewed %s", self.mapping.multiaddr)
            except (PortMapError, trio.TooSlowError) as exc:
                log.warning("port mapping renewal failed: %s; retrying", exc)
                await trio.sleep(min(30.0, self.mapping.lease_s / 8))

    async def close(self) -> None:
        """Remove the mapping (shielded: runs while the node stops); failures are logged."""
        mapping, self.mapping = self.mapping, None
        if mapping is None or self._gateway is None:
            return
        with trio.CancelScope(shield=True):
            try:
                await self._call(self._gateway.unmap, mapping)
                log.info("removed the port mapping %s", mapping.multiaddr)
            except (PortMapError, trio.TooSlowError) as exc:
                log.warning("could not remove the port mapping %s: %s", mapping.multiaddr, exc)
