"""Peers that leave (issue 56), over real daemons on loopback (tiny random Qwen2, 5 layers: 0:3, and 3:5 twice):

- a peer stopped once drains: the generation it serves finishes on it, a new session sent to it is refused with
  "draining" and the head plans around it at once, blaming and blacklisting no one; the peer then exits cleanly;
- a peer killed with no replica leaves a hole: the head waits for the swarm to heal (saying what it waits for), a
  fresh peer started with `--blocks auto` ends up in the hole, and the generation resumes where it was, exact;
- `dsd-node stop` stops a peer gracefully and waits for it to exit.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from support.models import hf_greedy
from support.processes import DaemonSwarm, cli

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import NgramDrafter
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.generation import RouteTarget, generate_over_swarm, swarm_watch
from dsd.node.peer.host import head_node
from dsd.node.testnet.processes import pid_alive
from dsd.protocol import Hop
from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
LAYERS = 5
PROMPT = [1, 17, 42, 99, 5, 17, 42, 99]
N_NEW = 24
SLOW = ("--wan-latency-ms", "40")  # every frame a peer sends waits 40 ms: a generation takes a few seconds


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonSwarm, dict]]:
    with DaemonSwarm(tmp_path_factory.mktemp("leaving")) as net:
        store = tiny_qwen2_root / "store"
        peers = {name: net.peer(name, store, blocks, "--record-ttl", "6", *SLOW)
                 for name, blocks in (("first", "0:3"), ("last", "3:5"), ("spare", "3:5"))}
        net.wait_route(MODEL, LAYERS)
        yield net, peers


def hop(peer: dict) -> Hop:
    return Hop(peer["peer_id"], tuple(peer["addrs"]), peer["start"], peer["end"])


def wait_exit(peer: dict, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pid_alive(peer["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(peer["pid"]), f"{peer['name']} still running {timeout_s:.0f} s after it was stopped"


def test_a_draining_peer_finishes_its_sessions_and_new_ones_go_elsewhere_unblamed(swarm, tiny_qwen2_root: Path,
                                                                                  tiny_qwen2_hf) -> None:
    net, peers = swarm
    store = Store(tiny_qwen2_root / "store")
    expected = hf_greedy(tiny_qwen2_hf, PROMPT, N_NEW)
    through_last = [hop(peers["first"]), hop(peers["last"])]
    out: dict[str, object] = {}

    async def main() -> None:
        async with head_node([net.bootstrap]) as (node, legs):
            setup = HeadSetup(store.load_head(), MODEL, LAYERS, NgramDrafter())
            watch = swarm_watch(node, setup)
            started = trio.Event()

            def on_tokens(toks: list[int]) -> None:
                if not started.is_set():
                    started.set()

            async def running() -> None:  # on `last` when it is told to leave
                out["running"] = await generate_over_swarm(
                    node, legs, watch, setup, PROMPT, GenerationConfig(mode="ar", max_new_tokens=N_NEW),
                    target=RouteTarget(hops=through_last), on_tokens=on_tokens)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(running)
                await started.wait()
                os.kill(peers["last"]["pid"], signal.SIGTERM)
                await trio.sleep(0.5)  # the signal is taken: `last` drains
                assert "running" not in out, "the generation ended before the peer was stopped: make it longer"
                out["new"] = await generate_over_swarm(  # sent to `last` on purpose: refused, planned around
                    node, legs, watch, setup, PROMPT, GenerationConfig(mode="ar", max_new_tokens=4),
                    target=RouteTarget(hops=through_last))
            out["banned"] = set(watch.exclusions(()))  # blacklisted or banned

    trio.run(main)
    running, new = out["running"], out["new"]
    assert running.tokens == expected and running.transport.failovers == []  # finished on the draining peer
    assert new.tokens == expected[:4]
    (event,) = new.transport.failovers
    assert event.blamed == [] and "is leaving the swarm" in event.verdict, event
    assert event.new_route == [peers["first"]["peer_id"], peers["spare"]["peer_id"]]
    assert peers["last"]["peer_id"] not in out["banned"]  # not blacklisted: it told us it was going
    wait_exit(peers["last"])
    log = Path(peers["last"]["log"]).read_text()
    assert "draining: refusing new sessions; 1 open may finish within 30 s" in log, log[-3000:]
    assert "drained: every session finished" in log and "shut down cleanly" in log
    assert "this peer is leaving the swarm" in log  # the refusal of the new session


def test_a_hole_is_waited_for_and_the_generation_resumes_when_a_fresh_peer_takes_it(
    swarm, tiny_qwen2_root: Path, tiny_qwen2_hf, caplog: pytest.LogCaptureFixture
) -> None:
    """After the test above only `spare` serves 3:5: it is killed mid-generation, and 3 s later a peer is started with
    `--blocks auto`: it takes 3:5 although the dead peer's record is still listed (it does not answer a ping); the
    generation waits for the hole to heal and then resumes, exact."""
    net, peers = swarm
    store_dir = tiny_qwen2_root / "store"
    store = Store(store_dir)
    expected = hf_greedy(tiny_qwen2_hf, PROMPT, N_NEW)
    out: dict[str, object] = {}

    async def main() -> None:
        async with head_node([net.bootstrap]) as (node, legs):
            setup = HeadSetup(store.load_head(), MODEL, LAYERS, NgramDrafter())
            killed = trio.Event()

            def on_tokens(toks: list[int]) -> None:
                if not killed.is_set():
                    os.kill(peers["spare"]["pid"], signal.SIGKILL)
                    killed.set()

            async def heal() -> None:
                await killed.wait()
                await trio.sleep(3.0)
                out["fresh"] = await trio.to_thread.run_sync(  # the dead peer's record is still listed (TTL 6 s)
                    lambda: net.peer("fresh", store_dir, "auto", "--num-blocks", "2", "--record-ttl", "6",
                                     "--rebalance-s", "1", *SLOW))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(heal)
                out["report"] = await generate_over_swarm(node, legs, swarm_watch(node, setup), setup, PROMPT,
                                                          GenerationConfig(mode="ar", max_new_tokens=N_NEW),
                                                          on_tokens=on_tokens)

    with caplog.at_level("WARNING"):
        trio.run(main)
    fresh, report = out["fresh"], out["report"]
    assert (fresh["start"], fresh["end"]) == (3, 5)  # `auto` counts live peers only: the dead one's record misleads not
    assert report.tokens == expected
    (event,) = report.transport.failovers
    assert event.blamed == [peers["spare"]["peer_id"]] and event.new_route[-1] == fresh["peer_id"]
    assert event.seconds >= 3.0
    assert any("no live peer serves blocks 3-4" in r.getMessage() and "waiting up to" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records][-20:]


def test_dsd_node_stop_drains_a_peer_and_waits_for_it_to_exit(swarm, tmp_path: Path) -> None:
    """Last: `dsd-node stop READY_FILE` on the peer that took the hole above; a file that is no peer's is refused."""
    net, _ = swarm
    out = cli("stop", str(net.state / "fresh.json"), timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "draining (new sessions go elsewhere" in out.stdout and out.stdout.strip().endswith("stopped")
    log = Path(net.state / "logs" / "fresh.log").read_text()
    assert "received SIGTERM" in log and "shut down cleanly" in log
    again = cli("stop", str(net.state / "fresh.json"), timeout=30)
    assert again.returncode == 1 and "is not running" in again.stderr
    (tmp_path / "bad.json").write_text("{}")
    bad = cli("stop", str(tmp_path / "bad.json"), timeout=30)
    assert bad.returncode == 2 and "cannot read a peer's pid" in bad.stderr
