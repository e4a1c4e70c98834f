"""Multiaddrs as the swarm uses them: splitting off the peer id, telling circuit addresses from direct ones, TCP
from QUIC ones (and which to dial first), and choosing what a peer may announce (never 0.0.0.0, which every dialer
tries in vain)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

import multiaddr
from libp2p.peer.peerinfo import info_from_p2p_addr

CIRCUIT = "/p2p-circuit"
QUIC = "/quic-v1"


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


def is_quic(addr: str) -> bool:
    """A direct QUIC address (`/ip4/…/udp/PORT/quic-v1`; py-libp2p names an inbound connection's `…/quic`)."""
    return not is_circuit(addr) and (QUIC in addr or addr.endswith("/quic") or "/quic/" in addr)


def quic_twin(addr: str) -> str | None:
    """The QUIC listen address beside a TCP one: the same IP, the same port number (UDP's own; 0 stays 0)."""
    end = tcp_endpoint(split_addr(addr)[0])
    if end is None:
        return None
    family = "ip6" if ":" in end[0] else "ip4"
    return f"/{family}/{end[0]}/udp/{end[1]}/quic-v1"


def with_quic(listen: Iterable[str]) -> list[str]:
    """`listen` plus the QUIC twin of each TCP address in it (a peer reachable over both transports)."""
    out = list(listen)
    for addr in list(out):
        twin = quic_twin(addr)
        if twin is not None and twin not in out:
            out.append(twin)
    return out


def dial_order(addrs: Iterable[multiaddr.Multiaddr]) -> tuple[list[multiaddr.Multiaddr], list[multiaddr.Multiaddr]]:
    """(first, fallback): the TCP (and any other non-QUIC) addresses are dialled first and the QUIC ones only when
    those fail — py-libp2p's QUIC (aioquic, pure Python) costs a hidden state's trip several times TCP's CPU — or
    QUIC first when it is all there is."""
    addrs = list(addrs)
    quic = [a for a in addrs if is_quic(str(a))]
    other = [a for a in addrs if not is_quic(str(a))]
    return (other, quic) if other else (quic, [])


def is_unspecified(ma: multiaddr.Multiaddr) -> bool:
    ip = next((ma.value_for_protocol(p) for p in ("ip4", "ip6") if _has(ma, p)), None)
    return ip is not None and ipaddress.ip_address(ip).is_unspecified


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
        if is_unspecified(ma) and text.startswith("/ip4/"):
            ip = source_ip_toward(toward) or "127.0.0.1"
            text = text.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1)
        full = text if "/p2p/" in text else f"{text}/p2p/{peer_id}"
        if full not in out:
            out.append(full)
    return out
