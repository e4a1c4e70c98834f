"""A route session's traffic counters are the bytes the head really moved: two in-process block peers
on 127.0.0.1, a head whose transport streams count every byte read and written under the framing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from dsd.discovery.host import P2PNode
from dsd.node.peer.dispatch import InferDispatcher
from dsd.node.route.legs import ReturnLegs
from dsd.node.route.session import open_route_session
from dsd.node.server.block import BlockServer
from dsd.protocol import Hop
from dsd.protocol.ids import INFER_PROTOCOL
from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]


class Counted:
    """A transport stream that counts the bytes read from and written to it (everything else passes through)."""

    def __init__(self, inner: Any, tally: dict[str, int]) -> None:
        self._inner = inner
        self._tally = tally

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def read(self, n: int | None = None) -> bytes:
        data = await self._inner.read(n)
        self._tally["read"] += len(data)
        return data

    async def write(self, data: bytes) -> Any:
        result = await self._inner.write(data)
        self._tally["written"] += len(data)
        return result


def test_traffic_counts_every_byte_on_both_streams(tiny_qwen2_store: Path) -> None:
    store = Store(tiny_qwen2_store)
    head_module = store.load_head()
    tally = {"read": 0, "written": 0}

    def embed(tokens: list[int]):
        with torch.inference_mode():
            return head_module.embed(torch.tensor([tokens]))[0].to(torch.float32).numpy()

    async def main():
        with trio.fail_after(90):
            async with P2PNode(create_new_key_pair()) as a, P2PNode(create_new_key_pair()) as b:
                for node, (start, end) in ((a, (0, 3)), (b, (3, 5))):
                    node.set_handler(INFER_PROTOCOL, InferDispatcher(BlockServer(node, store, start, end), ReturnLegs()))
                hops = [Hop(a.peer_id, tuple(a.addrs), 0, 3), Hop(b.peer_id, tuple(b.addrs), 3, 5)]
                async with P2PNode(create_new_key_pair(), stream_wrapper=lambda s: Counted(s, tally)) as head:
                    legs = ReturnLegs()
                    head.set_handler(INFER_PROTOCOL, InferDispatcher(None, legs))
                    async with open_route_session(head, legs, hops, model="tiny-qwen2", max_len=64) as session:
                        prompt = [1, 17, 42, 99, 5, 17, 42]
                        out = await session.forward(embed(prompt), start=0, commit=0)
                        assert out.shape[0] == len(prompt)
                        out = await session.forward(embed([7, 8, 9]), start=len(prompt), commit=len(prompt))
                        assert out.shape[0] == 3
                        assert await session.truncate(8) == 8
                    return session

    session = trio.run(main)
    assert tally["read"] > 10 * 64 * 2  # the two results' hidden states (10 rows of 64, >= 2 bytes each) went through it
    assert session.traffic.received == tally["read"]
    assert session.traffic.sent == tally["written"]
