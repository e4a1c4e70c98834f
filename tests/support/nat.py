"""`dsd-node` processes on the machines of a NAT testbed (network namespaces): daemons and commands, stopped and the
namespaces removed after."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsd.node.testnet.nat_testbed import NatTestbed, nat_testbed_missing, upnp_gateway_missing
from dsd.node.testnet.processes import stop_processes, wait_ready
from support.processes import ForkServer

PORT = 4001  # every machine has its own namespace, so each may listen on the same port


def need_nat_testbed(upnp: bool = False) -> None:
    """Skip where namespaces cannot be made (not root); fail where the README test command should have installed
    what the testbed needs (missing, the NAT tests must not pass)."""
    why = nat_testbed_missing()
    if why == "needs root (network namespaces)":
        pytest.skip(why)
    why = why or (upnp_gateway_missing() if upnp else None)
    if why is not None:
        pytest.fail(f"the NAT testbed cannot be built: {why}")


class NatSwarm:
    """`dsd-node` processes on the machines of a NatTestbed: daemons with `start`, commands with `run`."""

    def __init__(self, tb: NatTestbed, state: Path) -> None:
        self.tb, self.state, self.procs = tb, state, []

    def start(self, machine: str, *args: str) -> dict:
        host = self.tb.hosts[machine]
        ready = self.state / f"{machine}.json"
        proc = ForkServer.session().start(machine, ["start", "--listen", f"/ip4/{host.ip}/tcp/{PORT}",
                                                    "--identity", str(self.state / f"{machine}.key"),
                                                    "--ready-file", str(ready), *args], self.state, netns=host.netns)
        self.procs.append(proc)
        return {**wait_ready(ready, proc, 120), "log": proc.log}

    def run(self, machine: str, *args: str, timeout: float = 240):
        host = self.tb.hosts[machine]
        return ForkServer.session().run([*args, "--listen", f"/ip4/{host.ip}/tcp/{PORT}"], timeout, netns=host.netns)

    def stop(self) -> None:
        stop_processes(list(reversed(self.procs)))


@contextlib.contextmanager
def swarm_on(tb: NatTestbed, state: Path) -> Iterator[NatSwarm]:
    """A NatSwarm on `tb` whose processes are stopped after (the testbed is the caller's to close)."""
    swarm = NatSwarm(tb, state)
    try:
        yield swarm
    finally:
        swarm.stop()


def generate(swarm: NatSwarm, boot: str, store: Path, prompt: list[int], n: int = 16, *args: str) -> dict:
    """`generate --json` (dsd, ngram drafts) from the head's machine, with `args` besides; its report."""
    out = swarm.run("head", "generate", "--bootstrap", boot, "--store", str(store), "--draft", "ngram",
                    "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n), "--mode", "dsd", "--json",
                    *args)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def route_peers(swarm: NatSwarm, boot: str, want: set[str]) -> dict[str, dict]:
    """`route --json` from the head's machine, until it lists every peer of `want`; its peers by id."""
    deadline = time.monotonic() + 60
    while True:
        out = swarm.run("head", "route", "--bootstrap", boot, "--model", "tiny-qwen2", "--json")
        assert out.returncode in (0, 1) and out.stdout, out.stderr[-3000:]
        listed = {p["peer_id"]: p for p in json.loads(out.stdout)["peers"]}
        if want <= set(listed) or time.monotonic() > deadline:
            assert want <= set(listed), listed
            return listed
        time.sleep(1)


def links(report: dict) -> list[str | None]:
    """How each leg of a generation's route travelled: the head's to each remote hop, then the return leg."""
    return [h["link"] for h in report["hops"] if not h["local"]] + [report["return_link"]]
