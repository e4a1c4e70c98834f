"""dsd's pipeline over real daemons on loopback (tiny random Qwen2, 5 layers as 0:2, 2:4, 4:5, a spare 4:5,
25 ms emulated links): windows sent ahead of the verdict they bet on, dropped by epoch when the bet
fails, with the head serving the last layers itself, and through a failover with a window ahead in
flight. Greedy output equals HF generate token for token every time."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import trio
from support.heads import generate_on, swarm_of
from support.models import hf_greedy
from support.processes import DaemonSwarm

from dsd.discovery.survey import survey
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.host import head_node
from dsd.node.route.backend import RouteBackend
from dsd.node.route.open import open_route_client
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
LAYERS = 5
PROMPTS = [[1, 17, 42, 99, 5, 17, 42, 99], [1, 250, 3, 3, 3, 3, 8]]
N_NEW = 24
WAN = ("--wan-latency-ms", "25")


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonSwarm, dict]]:
    with DaemonSwarm(tmp_path_factory.mktemp("pipeline")) as net:
        store = tiny_qwen2_root / "store"
        procs = {name: net.spawn(name, "--store", str(store), "--blocks", blocks, "--bootstrap", net.bootstrap,
                                 "--threads", "1", "--record-ttl", "6", *WAN)
                 for name, blocks in (("a", "0:2"), ("b", "2:4"), ("c", "4:5"), ("c2", "4:5"))}
        peers = {name: net.ready(proc) for name, proc in procs.items()}
        net.wait_route(MODEL, LAYERS)
        yield net, peers


def _cfg(**kw) -> GenerationConfig:
    return GenerationConfig(mode="dsd", max_new_tokens=N_NEW, gamma=4, tree_nodes=0, ahead_min=0.0, **kw)


def test_windows_go_ahead_and_output_is_exact(swarm, tiny_qwen2_root: Path, tiny_qwen2_hf, noisy_draft) -> None:
    """A draft equal to the target: windows ride ahead of their verdicts. A noisy draft: many bets fail and
    the windows sent on them are dropped. The head serving the last layers runs the same windows."""
    net, _ = swarm
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    reports: dict[tuple[str, bool], list] = {}

    async def main() -> None:
        async with head_node([net.bootstrap]) as (node, legs):
            for prompt in PROMPTS:
                expected = hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
                for kind, model in (("self", store.load_full()), ("noisy", noisy_draft)):
                    for local in (False, True):
                        setup = HeadSetup(head, MODEL, LAYERS, ModelDrafter(model, SamplingParams()))
                        report = await generate_on(node, legs, setup, prompt, _cfg(pipeline=3),
                                                     local_span=store.load_span(4, 5) if local else None)
                        assert report.tokens == expected, (kind, local, prompt)
                        reports.setdefault((kind, local), []).append(report)

    trio.run(main)
    for local in (False, True):
        assert sum(r.result.pipelined_rounds for r in reports["self", local]) > 0
        assert sum(r.result.pipelined_wasted for r in reports["noisy", local]) > 0


class KillAhead(RouteBackend):
    """Kills the route's last hop (SIGKILL) just before the first window sent ahead goes out."""

    def __init__(self, *args, pids: dict[str, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pids = pids
        self.killed: str | None = None

    async def _submit_ahead(self, tokens: Sequence[int], start: int, commit: int, epoch: int,
                            parents: Sequence[int] | None, keep: Sequence[int] | None) -> None:
        if self.killed is None:
            self.killed = self.session.hops[-1].peer_id
            os.kill(self.pids[self.killed], signal.SIGKILL)
        await super()._submit_ahead(tokens, start, commit, epoch, parents, keep)


def test_a_route_that_cannot_open_is_retried_then_failed_over(swarm, tiny_qwen2_root: Path, tiny_qwen2_hf,
                                                               tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first hop given is a peer nobody can reach: the open is retried once, then failed over (the peer
    blamed, a new plan over the live peers), and the generation completes exactly instead of failing."""
    from dsd.discovery.identity import load_or_create_identity, peer_id_of
    from dsd.protocol import Hop

    net, _ = swarm
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[1]
    ghost = peer_id_of(load_or_create_identity(tmp_path / "ghost.key"))

    async def main() -> tuple[list[int], list[list[str]]]:
        async with head_node([net.bootstrap]) as (node, legs):
            hops = list((await survey(node, MODEL, LAYERS)).plan.protocol_hops())
            hops[0] = Hop(ghost, ("/ip4/127.0.0.1/tcp/9",), hops[0].start, hops[0].end)
            async with open_route_client(node, legs, swarm_of(node, MODEL, LAYERS), max_len=128, hops=hops) as client:
                backend = RouteBackend(store.load_head(), client, timeout_s=60)
                drafter = ModelDrafter(store.load_full(), SamplingParams())
                result = await HeadEngine(backend, drafter, _cfg()).run(prompt)
                return result.tokens, [e.blamed for e in client.events]

    with caplog.at_level("WARNING", logger="dsd.node.route.client"):
        tokens, blamed = trio.run(main)
    assert sum("retrying once on the same peers" in r.getMessage() for r in caplog.records) == 1
    assert blamed == [[ghost]]
    assert tokens == hf_greedy(tiny_qwen2_hf, prompt, N_NEW)


def test_failover_with_a_window_ahead_replays_the_oldest_and_stays_exact(swarm, tiny_qwen2_root: Path,
                                                                         tiny_qwen2_hf) -> None:
    """The last hop dies as a window goes ahead: the client moves to the spare 4:5 peer, the backend replays
    the committed tokens and the oldest window, the window sent ahead is dropped, and the output is exact."""
    net, peers = swarm
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[0]
    pids = {info["peer_id"]: info["pid"] for info in peers.values()}

    async def main() -> tuple[list[int], KillAhead]:
        async with head_node([net.bootstrap]) as (node, legs):
            view = await survey(node, MODEL, LAYERS)
            async with open_route_client(node, legs, swarm_of(node, MODEL, LAYERS), max_len=128, hops=list(view.plan.protocol_hops())) as client:
                backend = KillAhead(store.load_head(), client, timeout_s=60, pids=pids)
                drafter = ModelDrafter(store.load_full(), SamplingParams())
                result = await HeadEngine(backend, drafter, _cfg()).run(prompt)
                return result.tokens, backend

    tokens, backend = trio.run(main)
    assert backend.killed is not None and backend.replays >= 1
    assert tokens == hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
