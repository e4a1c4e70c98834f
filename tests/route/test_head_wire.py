"""The head's own wire codec (`RouteTarget.wire`, what `bench/wire_codecs.py` compares): over real daemons on
loopback, a head sending int8 hidden states puts about a quarter of the exact codec's bytes per row on its uplink
while the peers (exact) send back the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from support.heads import generate_on
from support.processes import DaemonSwarm

from dsd.node.head.config import GenerationConfig
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.host import head_node
from dsd.protocol import WireFormat
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
LAYERS = 5
PROMPT = [1, 17, 42, 99, 5, 17, 42, 99, 3, 8, 250, 3]
N_NEW = 8


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSwarm]:
    with DaemonSwarm(tmp_path_factory.mktemp("head-wire")) as net:
        store = tiny_qwen2_root / "store"
        net.peer("a", store, "0:3", "--record-ttl", "6")
        net.peer("b", store, "3:5", "--record-ttl", "6")
        net.wait_route(MODEL, LAYERS)
        yield net


def test_the_heads_codec_sets_what_it_sends_and_leaves_what_the_peers_send(swarm: DaemonSwarm,
                                                                           tiny_qwen2_root: Path) -> None:
    store = Store(tiny_qwen2_root / "store")
    setup = HeadSetup(store.load_head(), MODEL, LAYERS, None)
    cfg = GenerationConfig(mode="ar", max_new_tokens=N_NEW)

    async def main() -> dict[str, tuple[int, int, list[int]]]:
        out = {}
        async with head_node([swarm.bootstrap]) as (node, legs):
            for name, wire in (("exact", None), ("int8", WireFormat("int8")), ("raw", WireFormat("raw"))):
                report = await generate_on(node, legs, setup, PROMPT, cfg, wire=wire)
                out[name] = (report.transport.bytes_sent, report.transport.bytes_received, report.result.tokens)
        return out

    got = trio.run(main)
    (exact_sent, exact_received, exact_tokens), (int8_sent, int8_received, _) = got["exact"], got["int8"]
    assert got["raw"] == got["exact"]  # the fp32 head's exact codec is raw: the same bytes and tokens
    rows = len(PROMPT) + N_NEW - 1  # the prompt, then each new token but the last goes to the first peer
    assert exact_sent - int8_sent >= 150 * rows  # a row of 64 fp32 values (256 B) becomes 64 bytes and a scale
    assert 0.9 * exact_received <= int8_received <= 1.1 * exact_received  # the peers still send raw fp32
    assert len(exact_tokens) == N_NEW
