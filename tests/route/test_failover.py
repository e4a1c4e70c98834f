"""Failover on a real 4-peer testnet with two replicas per span: a peer SIGKILLed in the middle of
a greedy generation is replaced and the output is exactly the uninterrupted one; when no replica
is left, generation stops with an error naming the missing blocks and keeps the tokens so far."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import trio
from support.heads import swarm_of
from support.models import hf_greedy
from support.processes import cli_testnet
from transformers import AutoModelForCausalLM

from dsd.discovery.announce import fetch_records
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import NgramDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.peer.host import head_node
from dsd.node.route.backend import RouteBackend
from dsd.node.route.errors import RouteGaveOut
from dsd.node.route.open import open_route_client
from dsd.node.testnet.processes import pid_alive
from dsd.protocol.deadlines import DeadlineRule
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
N_NEW = 64
PROMPT = [1, 17, 42, 99, 5, 17, 42, 99, 7]




@pytest.fixture(scope="module")
def replicated(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    with cli_testnet(tmp_path_factory.mktemp("replicated"), "--store", str(tiny_qwen2_root / "store"), "--peers", "4", "--replicas", "2", "--record-ttl", "6") as info:
        yield info


@pytest.fixture(scope="module")
def expected(tiny_qwen2_root: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    return hf_greedy(model, PROMPT, N_NEW)


async def wait_for_records(testnet: dict, peer_ids: set[str], timeout_s: float = 30) -> None:
    """Until a fresh head finds a live record of every peer in `peer_ids` (after the DHT was frozen past
    the records' TTL, the peers republish within a refresh period or two)."""
    async with head_node([testnet["bootstrap"]]) as (node, _):
        with trio.fail_after(timeout_s):
            while not peer_ids <= {r.peer_id for r in await fetch_records(node, MODEL, 5)}:
                await trio.sleep(0.3)


def pid_of(testnet: dict, peer_id: str) -> int:
    return next(p["pid"] for p in testnet["peers"] if p["peer_id"] == peer_id)


async def run_with_kills(testnet: dict, store: Store, kill_after: dict[int, str],
                         sig: int | tuple[int, ...] = signal.SIGKILL, freeze_first: int | None = None, rule=None):
    """Generate greedily; after the given numbers of tokens, send the route's hop at the given position `sig` (each of
    them, in turn) (SIGSTOPping `freeze_first` just before)."""
    head = store.load_head()
    killed: list[str] = []
    killed_at: list[float] = []
    gaps: list[float] = []  # seconds from a kill to the next accepted tokens
    async with head_node([testnet["bootstrap"]]) as (node, legs):
        async with open_route_client(node, legs, swarm_of(node, MODEL, 5), max_len=256, rule=rule) as client:
            engine = HeadEngine(RouteBackend(head, client, timeout_s=60), NgramDrafter(),
                                GenerationConfig(mode="dsd", max_new_tokens=N_NEW, gamma=3))
            produced = 0

            def on_tokens(toks: list[int]) -> None:
                nonlocal produced
                produced += len(toks)
                if killed and len(gaps) < len(killed):
                    gaps.append(time.monotonic() - killed_at[-1])
                for threshold, which in list(kill_after.items()):
                    if produced >= threshold:
                        del kill_after[threshold]
                        hops = client.session.hops
                        victim = hops[0] if which == "first" else hops[-1]
                        if freeze_first is not None:
                            os.kill(freeze_first, signal.SIGSTOP)
                        for i, one in enumerate(sig if isinstance(sig, tuple) else (sig,)):
                            if i:
                                time.sleep(0.3)  # a signal sent again before the first is read counts once
                            os.kill(pid_of(testnet, victim.peer_id), one)
                        killed_at.append(time.monotonic())
                        killed.append(victim.peer_id)

            try:
                result = await engine.run(PROMPT, on_tokens=on_tokens)
            except RouteGaveOut as exc:
                return None, exc, engine.result.tokens, client.events, killed
            for event, gap in zip(client.events, gaps, strict=False):
                print(f"\nfailover: blamed {[p[-8:] for p in event.blamed]}, new route in {event.seconds:.2f} s, "
                      f"signal to next tokens {gap:.2f} s")
            return result, None, engine.result.tokens, client.events, killed


def test_a_peer_stopped_twice_mid_generation_ends_its_sessions_at_once_and_is_not_blamed(
    replicated: dict, tiny_qwen2_root: Path, expected: list[int]
) -> None:
    """SIGTERM then SIGTERM again (drain, then "now") with the bootstrap DHT node frozen: the peer's withdrawal waits on
    it, and its sessions must end at once all the same, with "draining": the head plans around the peer without pings
    or blame (the rest of the generation takes well under a second)."""
    store = Store(tiny_qwen2_root / "store")
    boot = next(p["pid"] for p in replicated["peers"] if p["role"] == "bootstrap")
    try:
        result, error, _, events, stopped = trio.run(run_with_kills, replicated, store, {12: "first"},
                                                     (signal.SIGTERM, signal.SIGTERM), boot)
    finally:
        os.kill(boot, signal.SIGCONT)
    assert error is None, error
    assert result.tokens == expected
    assert len(events) == 1 and events[0].blamed == [] and "is leaving the swarm" in events[0].verdict, events
    assert stopped[0] not in events[0].new_route
    peer = next(p for p in replicated["peers"] if p["peer_id"] == stopped[0])
    deadline = time.monotonic() + 20
    while pid_alive(peer["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(peer["pid"])
    log = Path(peer["log"]).read_text()
    assert "received SIGTERM" in log and "received SIGTERM again: ending the open sessions now" in log
    assert "shut down cleanly" in log
    # The next tests share this swarm: its records expired while the bootstrap was frozen (TTL 6 s).
    trio.run(wait_for_records, replicated, {p["peer_id"] for p in replicated["peers"]
                                            if p["role"] != "bootstrap" and p["peer_id"] != stopped[0]})


def test_killed_peer_is_replaced_and_output_is_unchanged(replicated: dict, tiny_qwen2_root: Path, expected: list[int]) -> None:
    store = Store(tiny_qwen2_root / "store")
    result, error, _, events, killed = trio.run(run_with_kills, replicated, store, {16: "last"})
    assert error is None, error
    assert result.tokens == expected
    assert len(events) == 1
    assert events[0].blamed == killed
    assert killed[0] not in events[0].new_route
    assert events[0].seconds < 30


def test_no_replacement_stops_with_missing_blocks_and_keeps_the_prefix(replicated: dict, tiny_qwen2_root: Path, expected: list[int]) -> None:
    """Runs after the test above: the span that lost a replica loses its other one too."""
    store = Store(tiny_qwen2_root / "store")
    result, error, progress, _, killed = trio.run(run_with_kills, replicated, store, {8: "last"}, signal.SIGKILL, None,
                                                  DeadlineRule(hole_wait_s=3.0))
    assert result is None
    assert isinstance(error, RouteGaveOut) and error.failure.verdict == "no_route"
    assert error.failure.missing_blocks == [3, 4] and error.failure.blamed == killed
    assert "3-4" in str(error) and "no peer took over their blocks within 3 s" in str(error)
    assert 8 <= len(progress) < N_NEW
    assert progress == expected[: len(progress)]
