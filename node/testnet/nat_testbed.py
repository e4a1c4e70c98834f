"""A NAT testbed in network namespaces: an "internet" bridge with public hosts, and home networks each behind a
router that masquerades (optionally `--random-fully`, a symmetric NAT) and may run a UPnP gateway (miniupnpd). Built
by `NatTestbed`, removed by `close`.

Names carry a random suffix, so parallel tests never share a namespace; traffic stays between the testbed's own
addresses (TEST-NET-3 on the bridge, 192.168.N.0/24 at home). Needs root, `ip` and `iptables`; UPnP gateways need
`miniupnpd` (nftables backend) and `nft`. miniupnpd refuses to map ports on a reserved external address, TEST-NET-3
included, so a testbed with UPnP gateways puts its bridge on `UPNP_BRIDGE_NET`, a range that looks public: the
namespaces have no route out of the testbed, so no packet to it can leave the machine.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field

BRIDGE_NET = "203.0.113"  # TEST-NET-3: never routed on the real internet
UPNP_BRIDGE_NET = "11.0.113"  # looks public to miniupnpd; only ever inside the testbed's own namespaces
CLONE_NEWNET = 0x40000000
UPNP_MODES = ("forward", "refuse", "lie")  # a gateway that maps and forwards; refuses every mapping; maps, never forwards
UPNP_TABLE = "dsdupnp"


def nat_testbed_missing() -> str | None:
    """Why a NAT testbed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iptables)"
    return None


def upnp_gateway_missing() -> str | None:
    """Why a testbed router cannot run a UPnP gateway here, or None."""
    for tool, package in (("miniupnpd", "miniupnpd-nftables"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install {package})"
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
    router: str | None = None  # the home router's namespace
    wan_ip: str | None = None  # the home router's address on the bridge (what the NAT shows outside)


@dataclass
class NatTestbed:
    """Namespaces of one test: call `public` and `home` to add machines, `close` (or `with`) to remove them all."""

    bridge_net: str = BRIDGE_NET
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, Host] = field(default_factory=dict)
    gateways: dict[str, subprocess.Popen] = field(default_factory=dict)  # home machine -> its router's miniupnpd
    _files: list[str] = field(default_factory=list)
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
        ip = f"{self.bridge_net}.{self._next_public}"
        self._next_public += 1
        self._on_bridge(ns, ip, "eth0")
        self.hosts[name] = Host(name, ns, ip, True)
        return self.hosts[name]

    def firewall(self, name: str, *rule: str) -> None:
        """Run `iptables RULE` in machine `name`'s own namespace (a filter of its own: drop a transport, a path)."""
        _sh("ip", "netns", "exec", self.hosts[name].netns, "iptables", *rule)

    def home(self, name: str, *, symmetric: bool = False, upnp: str | None = None) -> Host:
        """A machine behind its own home router (port-preserving MASQUERADE, or `--random-fully` if symmetric), the
        router running a UPnP gateway when `upnp` names one of `UPNP_MODES`."""
        if upnp is not None and upnp not in UPNP_MODES:
            raise ValueError(f"upnp must be one of {UPNP_MODES}, got {upnp!r}")
        n = self._next_home
        self._next_home += 1
        router, ns = self._netns(f"r{n}"), self._netns(name)
        wan_ip = f"{self.bridge_net}.{100 + n}"
        self._on_bridge(router, wan_ip, "wan")
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
        # what a port mapping forwards passes the router's filter, as on a home router (none without a gateway)
        _sh(*ipt, "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT")
        for chain in ("FORWARD", "INPUT"):  # DROP, not REJECT: a router's RST would kill the other side's punch
            _sh(*ipt, "-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _sh(*ipt, "-A", chain, "-i", "wan", "-j", "DROP")
        self.hosts[name] = Host(name, ns, ip, False, router, wan_ip)
        if upnp is not None:
            self.add_gateway(name, upnp)
        return self.hosts[name]

    def add_gateway(self, name: str, mode: str = "forward") -> None:
        """Start a UPnP gateway (miniupnpd) on the router in front of home machine `name`: its rules in an nftables
        table of their own; a "lie" gateway's forwarding chain is never jumped to (mappings listed, nothing
        forwarded), a "refuse" one denies every mapping."""
        if mode not in UPNP_MODES:
            raise ValueError(f"a gateway's mode is one of {UPNP_MODES}, got {mode!r}")
        router = self.hosts[name].router
        if router is None or name in self.gateways:
            raise ValueError(f"{name} has no router or its router already runs a gateway")
        lan = self.hosts[name].ip.rsplit(".", 1)[0]
        why = upnp_gateway_missing()
        if why is not None:
            raise RuntimeError(f"a UPnP gateway cannot run here: {why}")
        hook = "" if mode == "lie" else "jump prerouting_miniupnpd;"
        rules = (f"table inet {UPNP_TABLE} {{\n"
                 f"  chain forward {{ type filter hook forward priority 0; policy accept; jump miniupnpd; }}\n"
                 f"  chain miniupnpd {{ }}\n"
                 f"  chain prerouting {{ type nat hook prerouting priority -100; policy accept; {hook} }}\n"
                 f"  chain postrouting {{ type nat hook postrouting priority 100; policy accept; "
                 f"jump postrouting_miniupnpd; }}\n"
                 f"  chain prerouting_miniupnpd {{ }}\n"
                 f"  chain postrouting_miniupnpd {{ }}\n}}\n")
        done = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"nft rules for the UPnP gateway failed: {done.stderr.strip()}")
        rule = "deny 0-65535 0.0.0.0/0 0-65535" if mode == "refuse" else f"allow 1024-65535 {lan}.0/24 1024-65535"
        conf = "\n".join([
            "ext_ifname=wan", "listening_ip=lan", "http_port=0", "enable_upnp=yes", "enable_natpmp=yes",
            "secure_mode=yes", "system_uptime=yes", f"uuid={uuid.uuid4()}", f"upnp_table_name={UPNP_TABLE}",
            f"upnp_nat_table_name={UPNP_TABLE}", "upnp_forward_chain=miniupnpd",
            "upnp_nat_chain=prerouting_miniupnpd", "upnp_nat_postrouting_chain=postrouting_miniupnpd",
            rule, "deny 0-65535 0.0.0.0/0 0-65535", ""])
        folder = tempfile.mkdtemp(prefix=f"{router}-")
        self._files.append(folder)
        path = os.path.join(folder, "miniupnpd.conf")
        with open(path, "w") as f:
            f.write(conf)
        proc = subprocess.Popen(["ip", "netns", "exec", router, "miniupnpd", "-d", "-f", path, "-P",
                                 os.path.join(folder, "miniupnpd.pid")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.gateways[name] = proc

    def remove_gateway(self, name: str) -> None:
        """Stop the gateway in front of `name` and drop its rules: the router forgets every mapping (as one that
        restarts with UPnP off)."""
        proc = self.gateways.pop(name)
        _stop(proc)
        subprocess.run(["ip", "netns", "exec", self.hosts[name].router, "nft", "delete", "table", "inet", UPNP_TABLE],
                       capture_output=True)

    def mappings(self, name: str) -> str:
        """The UPnP gateway's forwarding rules in front of `name` (nft's listing of its chain; empty: no mapping)."""
        router = self.hosts[name].router
        done = subprocess.run(["ip", "netns", "exec", router, "nft", "list", "chain", "inet", UPNP_TABLE,
                               "prerouting_miniupnpd"], capture_output=True, text=True)
        return "\n".join(line.strip() for line in done.stdout.splitlines() if "dnat" in line)

    def close(self) -> None:
        """Stop the UPnP gateways, remove every namespace of the testbed (their veths and NAT tables go with them)."""
        for proc in self.gateways.values():
            _stop(proc)
        self.gateways.clear()
        for folder in self._files:
            shutil.rmtree(folder, ignore_errors=True)
        self._files.clear()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def enter_netns(name: str) -> None:
    """Move this (single-threaded, freshly forked) process into the network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)
