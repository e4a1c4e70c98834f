"""A NAT testbed in network namespaces: an "internet" bridge with public hosts, and home networks each behind a
router that masquerades (optionally `--random-fully`, a symmetric NAT). Built by `NatTestbed`, removed by `close`.

Names carry a random suffix, so parallel tests never share a namespace; traffic stays between the testbed's own
addresses (TEST-NET-3 on the bridge, 192.168.N.0/24 at home). Needs root, `ip` and `iptables`.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

BRIDGE_NET = "203.0.113"  # TEST-NET-3: never routed on the real internet
CLONE_NEWNET = 0x40000000


def nat_testbed_missing() -> str | None:
    """Why a NAT testbed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iptables)"
    return None


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class Host:
    """One machine of the testbed: its namespace and the address it has on its own network."""

    name: str
    netns: str
    ip: str
    public: bool


@dataclass
class NatTestbed:
    """Namespaces of one test: call `public` and `home` to add machines, `close` (or `with`) to remove them all."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, Host] = field(default_factory=dict)
    _next_public: int = 10
    _next_home: int = 1

    def __post_init__(self) -> None:
        self.inet = self._netns("inet")
        _sh("ip", "-n", self.inet, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.inet, "link", "set", "br0", "up")
        _sh("ip", "-n", self.inet, "link", "set", "lo", "up")

    def __enter__(self) -> NatTestbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns(self, role: str) -> str:
        name = f"dsdt{self.tag}{role}"
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _on_bridge(self, ns: str, ip: str, ifname: str) -> None:
        """A veth from `ns` (named `ifname`) to the internet bridge, with `ip`/24."""
        peer = f"b{self.tag}{len(self.namespaces)}"
        _sh("ip", "link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.inet)
        _sh("ip", "-n", self.inet, "link", "set", peer, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
        _sh("ip", "-n", ns, "link", "set", ifname, "up")

    def public(self, name: str) -> Host:
        """A machine with a public address on the bridge."""
        ns = self._netns(name)
        ip = f"{BRIDGE_NET}.{self._next_public}"
        self._next_public += 1
        self._on_bridge(ns, ip, "eth0")
        self.hosts[name] = Host(name, ns, ip, True)
        return self.hosts[name]

    def home(self, name: str, *, symmetric: bool = False) -> Host:
        """A machine behind its own home router (port-preserving MASQUERADE, or `--random-fully` if symmetric)."""
        n = self._next_home
        self._next_home += 1
        router, ns = self._netns(f"r{n}"), self._netns(name)
        self._on_bridge(router, f"{BRIDGE_NET}.{100 + n}", "wan")
        lan, ip = f"192.168.{n}", f"192.168.{n}.2"
        _sh("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        _sh("ip", "-n", router, "link", "set", "lan", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1")
        _sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masq = ["-j", "MASQUERADE"] + (["--random-fully"] if symmetric else [])
        ipt = ["ip", "netns", "exec", router, "iptables"]
        _sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", *masq)
        for chain in ("FORWARD", "INPUT"):  # DROP, not REJECT: a router's RST would kill the other side's punch
            _sh(*ipt, "-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _sh(*ipt, "-A", chain, "-i", "wan", "-j", "DROP")
        self.hosts[name] = Host(name, ns, ip, False)
        return self.hosts[name]

    def close(self) -> None:
        """Remove every namespace of the testbed (their veths and NAT tables go with them)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def enter_netns(name: str) -> None:
    """Move this (single-threaded, freshly forked) process into the network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)
