"""Token-tree windows over real daemons on loopback (tiny random Qwen2): a ring of 3 block peers and
a federated worker. Every node of a tree window must equal the whole model run on its root-to-node
path as a chain, and committing a path with `keep` must leave every peer's KV cache as if only that
path had been seen (checked by the windows after it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from support.processes import daemon
from support.trees import path_to

from dsd.node.peer.host import head_node
from dsd.node.route.session import open_route_session
from dsd.node.testnet.processes import stop_processes, wait_ready
from dsd.protocol import Ack, CloseSession, DraftWindow, Hop, OpenSession, TopKResult
from dsd.protocol.ids import FEDERATED_PROTOCOL
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
SPANS = [(0, 2), (2, 4), (4, 5)]
VOCAB = 300
TOL = 1e-4  # fp32 (|hidden| ~ 30): a tree and its chains differ by ~5e-5; a wrong mask, position or kept row by O(10)

# (parents of a tree window, the node whose root path the head accepts; None = none accepted)
ROUNDS = [
    ([-1, 0, 0, 1, 1, 2, -1, 6, 3], 8),  # path 0, 1, 3, 8: rows 3 and 8 move down inside the caches
    ([-1, -1, -1, 0, 3, 4, 1], 5),  # path 0, 3, 4, 5
    ([-1, 0, 1, 2], 1),  # a chain sent as parents: path 0, 1 is a prefix, nothing moves
    ([-1, 0, 0], None),  # every node rejected: commit alone truncates
    ([-1, -1], 1),  # path 1: the second candidate for the next token
]


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """Three block peers splitting the 5 layers and one federated worker (no DHT: routes are given)."""
    state = tmp_path_factory.mktemp("trees")
    store = str(tiny_qwen2_root / "store")
    roles = {f"peer{i}": ["--blocks", f"{s}:{e}"] for i, (s, e) in enumerate(SPANS)}
    roles["worker"] = ["--federated", "--topk-codec", "fp32"]
    procs = []
    try:
        for name, extra in roles.items():
            procs.append(daemon(name, ["start", "--store", store, *extra, "--identity", str(state / f"{name}.key"),
                                      "--ready-file", str(state / f"{name}.json"), "--threads", "1",
                                      "--max-len", "64"], state))
        yield {p.name: wait_ready(state / f"{p.name}.json", p, 120) for p in procs}
    finally:
        stop_processes(list(reversed(procs)))


class Whole:
    """The whole model in this process (store head + one span of every layer): the chain reference."""

    def __init__(self, store_dir: Path) -> None:
        store = Store(store_dir)
        self.head = store.load_head()
        self.span = store.load_span(0, 5)

    def embed(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.head.embed(torch.tensor([ids]))[0].numpy()

    def hidden(self, ids: list[int]) -> np.ndarray:
        """Last-layer hidden states [len(ids), 64] of `ids` run as one chain on a fresh cache."""
        with torch.no_grad():
            return self.span(self.head.embed(torch.tensor([ids])), 0, self.span.new_cache())[0].numpy()

    def probs(self, ids: list[int]) -> np.ndarray:
        """Next-token distribution (temperature 1) after the chain `ids`."""
        with torch.no_grad():
            logits = self.head.logits(torch.from_numpy(self.hidden(ids)).unsqueeze(0))[0, -1]
        return torch.softmax(logits.double(), -1).numpy()




def dense(reply: TopKResult) -> np.ndarray:
    """A top-K answer as [positions, VOCAB] probabilities (K = VOCAB here, so nothing is missing)."""
    ids, p = reply.arrays()
    out = np.zeros((reply.positions, VOCAB))
    np.put_along_axis(out, ids, p, axis=1)
    return out


def test_ring_runs_tree_windows_and_keeps_accepted_paths(swarm: dict, tiny_qwen2_root: Path) -> None:
    whole = Whole(tiny_qwen2_root / "store")
    hops = [Hop(swarm[f"peer{i}"]["peer_id"], tuple(swarm[f"peer{i}"]["addrs"]), s, e) for i, (s, e) in enumerate(SPANS)]
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, VOCAB, 7).tolist()
    worst = {"tree node vs its path": 0.0, "after keep vs only the path": 0.0}

    def diff(key: str, got: np.ndarray, want: np.ndarray) -> None:
        assert got.shape == want.shape
        worst[key] = max(worst[key], float(np.abs(got - want).max()))

    async def main() -> None:
        async with head_node([]) as (node, legs):
            async with open_route_session(node, legs, hops, model=MODEL, max_len=64) as session:
                await session.forward(whole.embed(prefix), start=0, commit=0)
                committed, start = list(prefix), len(prefix)
                commit: int | None = None
                keep: list[int] | None = None
                for parents, accept in ROUNDS:
                    # The tree goes out with the previous round's verdict: commit = its start, keep = its path.
                    tokens = rng.integers(3, VOCAB, len(parents)).tolist()
                    out = await session.forward(whole.embed(tokens), start=start, commit=commit, parents=parents, keep=keep)
                    assert out.shape == (len(parents), 64)
                    for n in range(len(parents)):
                        diff("tree node vs its path", out[n], whole.hidden(committed + [tokens[j] for j in path_to(parents, n)])[-1])
                    path = path_to(parents, accept)
                    committed += [tokens[j] for j in path]
                    commit, keep, start = start, path or None, start + len(path)
                tail = rng.integers(3, VOCAB, 3).tolist()
                out = await session.forward(whole.embed(tail), start=start, commit=commit, keep=keep)
            committed += tail
            diff("after keep vs only the path", out, whole.hidden(committed)[-3:])
            # A session over the same ring that only ever saw the accepted tokens, as one chain.
            async with open_route_session(node, legs, hops, model=MODEL, max_len=64) as plain:
                chain = await plain.forward(whole.embed(committed), start=0, commit=0)
            diff("after keep vs only the path", out, chain[-3:])
            assert np.abs(out).max() > 1.0  # not a comparison of near-zero states

    trio.run(main)
    print(f"\nring tree checks, max |hidden diff|: {worst}")
    assert all(v <= TOL for v in worst.values()), worst


def test_federated_worker_answers_a_tree_per_node_and_keeps_paths(swarm: dict, tiny_qwen2_root: Path) -> None:
    whole = Whole(tiny_qwen2_root / "store")
    worker = swarm["worker"]
    rng = np.random.default_rng(9)
    prefix = rng.integers(3, VOCAB, 6).tolist()
    sid = "tree-worker"
    worst = 0.0

    async def main() -> None:
        nonlocal worst
        async with head_node([]) as (node, _legs):
            stream = await node.open(worker["peer_id"], worker["addrs"], FEDERATED_PROTOCOL)
            with trio.fail_after(60):
                await stream.send(OpenSession(sid, MODEL, 0, 5, 64, ()))
                assert isinstance(await stream.receive(), Ack)
                await stream.send(DraftWindow(sid, 0, 0, None, tuple(prefix), 1, 1.0, rows=1))
                assert isinstance(await stream.receive(), TopKResult)
                committed, start = list(prefix), len(prefix)
                commit: int | None = None
                keep: tuple[int, ...] | None = None
                for parents, accept in ROUNDS:
                    tokens = tuple(rng.integers(3, VOCAB, len(parents)).tolist())
                    await stream.send(DraftWindow(sid, 1, start, commit, tokens, VOCAB, 1.0, parents=tuple(parents), keep=keep))
                    reply = await stream.receive()
                    assert isinstance(reply, TopKResult) and (reply.start, reply.positions) == (start, len(parents))
                    got = dense(reply)
                    for n in range(len(parents)):
                        want = whole.probs(committed + [tokens[j] for j in path_to(parents, n)])
                        worst = max(worst, float(np.abs(got[n] - want).max()))
                    path = path_to(parents, accept)
                    committed += [tokens[j] for j in path]
                    commit, keep, start = start, tuple(path) or None, start + len(path)
                await stream.send(DraftWindow(sid, 1, start, commit, (7, 8), VOCAB, 1.0, keep=keep))
                reply = await stream.receive()
                assert isinstance(reply, TopKResult)
                got = dense(reply)
                for i in range(2):
                    worst = max(worst, float(np.abs(got[i] - whole.probs(committed + [7, 8][: i + 1])).max()))
                await stream.send(CloseSession(sid))
            await stream.close()

    trio.run(main)
    print(f"\nworker tree checks, max |prob diff|: {worst:.3g}")
    assert worst <= TOL
