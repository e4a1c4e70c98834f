"""Windows that straddle a chunk boundary of `RouteBackend` on a real 6-peer testnet (three replicas
per span): a window longer than a chunk, and failovers whose replay ends inside a window that
crosses a multiple of the chunk size (128 and 256 at the default size), must still verify the
whole window: greedy output equals the target's alone."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import trio
from support.heads import swarm_of
from support.models import hf_greedy
from support.processes import cli_testnet
from transformers import AutoModelForCausalLM

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams
from dsd.node.peer.host import head_node
from dsd.node.route.backend import RouteBackend
from dsd.node.route.open import open_route_client
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
N_NEW = 12
GAMMA = 3




@pytest.fixture(scope="module")
def testnet(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    with cli_testnet(tmp_path_factory.mktemp("replay"), "--store", str(tiny_qwen2_root / "store"), "--peers", "6", "--replicas", "3",
                     "--record-ttl", "6") as info:
        yield info


def prompt_of(length: int) -> list[int]:
    """A fixed prompt of `length` tokens (ids 5..294 of the tiny vocabulary)."""
    return [1] + [(37 * i + 11) % 290 + 5 for i in range(length - 1)]


def reference(hf_dir: Path, prompt: list[int]) -> list[int]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval(), prompt, N_NEW)


class KillingBackend(RouteBackend):
    """Kills a hop of the route just before the first draft window that straddles `boundary` goes out."""

    def __init__(self, *args, boundary: int, victim: str | None, testnet: dict, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.boundary = boundary
        self.victim = victim
        self.testnet = testnet
        self.straddled: tuple[int, int] | None = None

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int) -> None:
        if self.straddled is None and start > 0 and start < self.boundary < start + len(tokens):
            self.straddled = (start, start + len(tokens))
            if self.victim is not None:
                hops = self.session.hops
                victim = hops[0] if self.victim == "first" else hops[-1]
                os.kill(next(p["pid"] for p in self.testnet["peers"] if p["peer_id"] == victim.peer_id), signal.SIGKILL)
        await super().submit(tokens, start=start, commit=commit, epoch=epoch)


async def generate(testnet: dict, store: Store, prompt: list[int], *, chunk: int, boundary: int, victim: str | None):
    async with head_node([testnet["bootstrap"]]) as (node, legs):
        async with open_route_client(node, legs, swarm_of(node, MODEL, 5), max_len=320) as client:
            backend = KillingBackend(store.load_head(), client, timeout_s=60, replay_chunk=chunk,
                                     boundary=boundary, victim=victim, testnet=testnet)
            drafter = ModelDrafter(store.load_full(), SamplingParams())
            # sd, not dsd: every window then holds exactly GAMMA + 1 tokens (a ready dsd window may hold fewer).
            engine = HeadEngine(backend, drafter, GenerationConfig(mode="sd", max_new_tokens=N_NEW, gamma=GAMMA))
            result = await engine.run(prompt)
            return result, backend.straddled, list(client.events)


def test_a_window_longer_than_a_chunk_is_verified_whole(testnet: dict, tiny_qwen2_root: Path) -> None:
    """Chunks of 3 tokens: every draft window (4 tokens) goes out in two chunks, no failover."""
    store = Store(tiny_qwen2_root / "store")
    prompt = prompt_of(10)
    result, straddled, events = trio.run(lambda: generate(testnet, store, prompt, chunk=3, boundary=12, victim=None))
    assert straddled is not None and events == []
    assert result.tokens == reference(tiny_qwen2_root / "hf", prompt)


@pytest.mark.parametrize(
    ("chunk", "boundary", "victim"),
    [(128, 128, "first"), (128, 256, "last"), (3, 21, "last")],
    ids=["straddles-128", "straddles-256", "window-longer-than-chunk"],
)
def test_failover_inside_a_window_that_straddles_a_chunk_boundary(
    testnet: dict, tiny_qwen2_root: Path, chunk: int, boundary: int, victim: str
) -> None:
    """The prompt ends 2 tokens before `boundary`, so the first draft window crosses it; its peer dies."""
    store = Store(tiny_qwen2_root / "store")
    prompt = prompt_of(boundary - 2)
    result, straddled, events = trio.run(
        lambda: generate(testnet, store, prompt, chunk=chunk, boundary=boundary, victim=victim)
    )
    assert straddled is not None and straddled[0] < boundary < straddled[1]
    assert len(events) == 1
    assert result.tokens == reference(tiny_qwen2_root / "hf", prompt)
