"""Multiaddrs as the swarm uses them: splitting off the peer id, telling circuit addresses from direct ones, and
choosing what a peer may announce (never 0.0.0.0, which every dialer tries in vain)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

import multiaddr
from libp2p.peer.peerinfo import info_from_p2p_addr

CIRCUIT = "/p2p-circuit"


def split_addr(addr: str) -> tuple[multiaddr.Multiaddr, str | None]:
    """(transport multiaddr, peer id or None) for a direct address with or without /p2p/<id>."""
    try:
        ma = multiaddr.Multiaddr(addr)
    except Exception as exc:
        raise ValueError(f"bad multiaddr {addr!r}: {exc}") from None
    if "/p2p/" in addr:
        info = info_from_p2p_addr(ma)
        return info.addrs[0], info.peer_id.to_base58()
    return ma, None


def is_circuit(addr: str) -> bool:
    """A `<relay>/p2p-circuit/p2p/<peer>` address: reached through a relay, not dialled directly."""
    return CIRCUIT in addr


def circuit_addr(relay_addr: str, relay_id: str, peer_id: str) -> str:
    """The address at which `peer_id` is reached through the relay `relay_id` (listening at `relay_addr`)."""
    base = relay_addr if relay_addr.endswith(f"/p2p/{relay_id}") else f"{relay_addr}/p2p/{relay_id}"
    return f"{base}{CIRCUIT}/p2p/{peer_id}"


def relay_of(addr: str) -> str:
    """The relay's peer id in a circuit address."""
    return addr.split(CIRCUIT)[0].rsplit("/p2p/", 1)[1]


def tcp_endpoint(ma: multiaddr.Multiaddr) -> tuple[str, int] | None:
    """(ip, port) of an /ip4 or /ip6 .../tcp/PORT address, else None."""
    ip = next((ma.value_for_protocol(p) for p in ("ip4", "ip6") if _has(ma, p)), None)
    if ip is None or not _has(ma, "tcp"):
        return None
    return ip, int(ma.value_for_protocol("tcp"))


def _has(ma: multiaddr.Multiaddr, proto: str) -> bool:
    return any(p.name == proto for p in ma.protocols())


def is_unspecified(ma: multiaddr.Multiaddr) -> bool:
    end = tcp_endpoint(ma)
    return end is not None and ipaddress.ip_address(end[0]).is_unspecified


def source_ip_toward(addrs: Iterable[str]) -> str | None:
    """The local IPv4 address the kernel would send from to reach the first of `addrs` (no packet is sent)."""
    for addr in addrs:
        try:
            end = tcp_endpoint(split_addr(addr)[0])
        except ValueError:
            continue
        if end is None or ":" in end[0]:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((end[0], end[1]))
                return str(s.getsockname()[0])
            except OSError:
                continue
    return None


def announceable(listen: Iterable[multiaddr.Multiaddr], peer_id: str, toward: Iterable[str]) -> list[str]:
    """The listen addresses others can dial, with /p2p/<peer_id>: an unspecified address (0.0.0.0) becomes the
    address of the interface that reaches the swarm (`toward`: the bootstrap peers), or 127.0.0.1 without one."""
    out: list[str] = []
    for ma in listen:
        text = str(ma)
        if is_unspecified(ma):
            ip = source_ip_toward(toward) or "127.0.0.1"
            text = text.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1)
        full = text if "/p2p/" in text else f"{text}/p2p/{peer_id}"
        if full not in out:
            out.append(full)
    return out
