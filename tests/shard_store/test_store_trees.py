"""Token-tree windows through a 3-span split of tiny Llama / Qwen2 stores: every node must equal
its root-to-node path run as a plain chain, committing a path must leave the caches exactly as
if only that path had been seen, and bad parents / paths are refused naming what is wrong.

The exact checks run in float64: in float32 this tiny model (|hidden| ~ 28) already differs by
~1e-5 between a chain run in one window and token by token, so float32 gets the spans-test bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from support.trees import leaves, path_to

from dsd.shard_store import (
    MAX_TREE_NODES,
    HeadModule,
    SpanModule,
    Store,
    StoreError,
    check_parents,
    check_path,
    tree_depths,
    tree_mask,
    tree_position_ids,
)

SPANS = [(0, 1), (1, 4), (4, 5)]
PREFIX = 9
EXACT = 1e-5  # float64: real differences are ~1e-15, a wrong mask or position is O(0.1)
FP32_TOL = 1e-4  # same bound as tests/shard_store/test_store_spans.py


class Pipeline:
    """The head and the three spans in route order, each span with its own cache."""

    def __init__(self, head: HeadModule, spans: list[SpanModule]) -> None:
        self.head = head
        self.spans = spans
        self.caches = [s.new_cache() for s in spans]

    @classmethod
    def from_store(cls, store_dir: Path, dtype: torch.dtype) -> Pipeline:
        store = Store(store_dir)
        return cls(store.load_head().to(dtype), [store.load_span(s, e).to(dtype) for s, e in SPANS])

    @property
    def length(self) -> int:
        lengths = {c.length for c in self.caches}
        assert len(lengths) == 1
        return lengths.pop()

    def step(self, ids: torch.Tensor, parents: object = None) -> torch.Tensor:
        pos = self.length
        hidden = self.head.embed(ids)
        for span, cache in zip(self.spans, self.caches, strict=True):
            hidden = span(hidden, pos, cache, parents)
        return self.head.logits(hidden)

    def keep(self, prefix_len: int, rows: Sequence[int]) -> None:
        for cache in self.caches:
            cache.keep(prefix_len, rows)

    def truncate(self, n: int) -> None:
        for cache in self.caches:
            cache.truncate(n)


def random_parents(gen: torch.Generator, n: int) -> list[int]:
    """A random topologically ordered tree: half the nodes extend the previous node (depth), half
    hang off a random earlier node or the committed token (width)."""
    parents = []
    for i in range(n):
        if i > 0 and torch.rand((), generator=gen).item() < 0.5:
            parents.append(i - 1)
        else:
            parents.append(int(torch.randint(-1, i, (), generator=gen)))
    return parents






@pytest.fixture(params=["llama", "qwen2"])
def store_dir(request: pytest.FixtureRequest, tiny_store) -> Path:
    return tiny_store(request.param)


def _trees(gen: torch.Generator) -> list[list[int]]:
    trees = [random_parents(gen, 31), random_parents(gen, 31), random_parents(gen, int(torch.randint(2, 31, (), generator=gen)))]
    trees.append([-1] * 7)  # seven candidates for the next token only
    trees.append([-1, 0, 1, 2, -1, 4, 5, 6])  # two chains
    trees.append([-1])
    return trees


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, EXACT), (torch.float32, FP32_TOL)])
def test_every_tree_node_matches_its_path_run_as_a_chain(store_dir: Path, dtype: torch.dtype, tol: float) -> None:
    pipe = Pipeline.from_store(store_dir, dtype)
    gen = torch.Generator().manual_seed(11)
    pipe.step(torch.randint(0, 300, (1, PREFIX), generator=gen))
    worst, checked = 0.0, 0
    for parents in _trees(gen):
        n = len(parents)
        tokens = torch.randint(0, 300, (1, n), generator=gen)
        got = pipe.step(tokens, parents)
        assert got.shape[:2] == (1, n)
        assert pipe.length == PREFIX + n  # every node's K/V was appended
        assert got.abs().max().item() > 1.0  # not a comparison of near-zero tensors
        for leaf in leaves(parents):  # every node lies on some leaf's path
            path = path_to(parents, leaf)
            pipe.truncate(PREFIX)
            want = pipe.step(tokens[:, path])
            worst = max(worst, (got[0, path] - want[0]).abs().max().item())
            checked += len(path)
        pipe.truncate(PREFIX)
    print(f"{store_dir.parent.name} {dtype}: max |logit diff| tree vs path chains {worst:.3g} over {checked} node checks")
    assert worst <= tol


def test_committed_path_leaves_the_caches_as_if_only_the_path_was_seen(store_dir: Path) -> None:
    dtype = torch.float64
    tree_pipe = Pipeline.from_store(store_dir, dtype)
    chain_pipe = Pipeline.from_store(store_dir, dtype)
    gen = torch.Generator().manual_seed(23)
    prefix = torch.randint(0, 300, (1, PREFIX), generator=gen)
    tree_pipe.step(prefix)
    chain_pipe.step(prefix)
    worst, moved = 0.0, 0
    for round_ in range(5):
        parents = random_parents(gen, 31)
        tokens = torch.randint(0, 300, (1, 31), generator=gen)
        start = tree_pipe.length
        got = tree_pipe.step(tokens, parents)
        if round_ == 2:
            path: list[int] = []  # every drafted node rejected
        else:  # the deepest-numbered leaf: its path is not a prefix of the window, so rows move
            path = path_to(parents, leaves(parents)[-1 - round_ % 2])
            moved += path != list(range(len(path)))
            want = chain_pipe.step(tokens[:, path])
            worst = max(worst, (got[0, path] - want[0]).abs().max().item())
        tree_pipe.keep(start, path)
        assert tree_pipe.length == chain_pipe.length == start + len(path)
        bonus = torch.randint(0, 300, (1, 1), generator=gen)  # the corrected / bonus token
        worst = max(worst, (tree_pipe.step(bonus) - chain_pipe.step(bonus)).abs().max().item())
    tail = torch.randint(0, 300, (1, 4), generator=gen)
    worst = max(worst, (tree_pipe.step(tail) - chain_pipe.step(tail)).abs().max().item())
    assert moved >= 2
    assert worst <= EXACT


def test_keep_of_a_prefix_path_equals_truncate(tiny_llama_store: Path) -> None:
    a = Pipeline.from_store(tiny_llama_store, torch.float32)
    b = Pipeline.from_store(tiny_llama_store, torch.float32)
    ids = torch.arange(3, 15).unsqueeze(0)
    a.step(ids[:, :6])
    b.step(ids[:, :6])
    a.step(ids[:, 6:], parents=[-1, 0, 1, 2, 3, 4])
    b.step(ids[:, 6:])
    a.keep(6, [0, 1, 2])
    b.truncate(9)
    tail = torch.tensor([[40, 41]])
    assert torch.equal(a.step(tail), b.step(tail))


def test_chain_as_explicit_parents_equals_none_exactly(store_dir: Path) -> None:
    a = Pipeline.from_store(store_dir, torch.float32)
    b = Pipeline.from_store(store_dir, torch.float32)
    c = Pipeline.from_store(store_dir, torch.float32)
    gen = torch.Generator().manual_seed(5)
    for size in (PREFIX, 6, 1, 4):
        ids = torch.randint(0, 300, (1, size), generator=gen)
        chain = list(range(-1, size - 1))
        want = a.step(ids)
        assert torch.equal(b.step(ids, chain), want)
        assert torch.equal(c.step(ids, torch.tensor(chain)), want)


def test_tree_mask_positions_and_depths() -> None:
    parents = [-1, 0, 0, 1, -1, 4]
    assert tree_depths(parents) == [0, 1, 1, 2, 0, 1]
    assert tree_position_ids(3, parents).tolist() == [[3, 4, 4, 5, 3, 4]]
    mask = tree_mask(3, parents, torch.float32)
    assert mask.shape == (1, 1, 6, 9)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ]
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    # a chain's tree mask is the causal mask
    n, committed = 5, 4
    causal = torch.arange(committed + n)[None, :] <= torch.arange(committed, committed + n)[:, None]
    assert torch.equal(tree_mask(committed, list(range(-1, n - 1)), torch.float32)[0, 0] == 0, causal)
    # sliding window 2: a node sees keys at positions > its own - 2 only
    slid = tree_mask(3, parents, torch.float32, sliding_window=2)[0, 0] == 0
    assert slid.int().tolist()[3] == [0, 0, 0, 0, 1, 0, 1, 0, 0]  # node 3 at position 5: its parent at 4, itself


def test_bad_parents_are_refused_naming_the_bad_index(tiny_llama_store: Path) -> None:
    with pytest.raises(StoreError, match=r"parents\[3\]: 7 is not -1 or an earlier node in \[0, 3\)"):
        check_parents([-1, 0, 1, 7])
    with pytest.raises(StoreError, match=r"parents\[1\]: -2 "):
        check_parents([-1, -2])
    with pytest.raises(StoreError, match=r"parents\[2\]: 2 "):  # itself: a cycle
        check_parents([-1, 0, 2])
    with pytest.raises(StoreError, match=r"parents\[1\]: 3 "):  # forward reference
        check_parents([-1, 3, 0, 1])
    with pytest.raises(StoreError, match=r"parents\[0\]: 0 "):
        check_parents([0])
    with pytest.raises(StoreError, match="tree parents: has 32 nodes, at most 31 are allowed"):
        check_parents([-1] * 32, max_nodes=31)
    with pytest.raises(StoreError, match=f"has {MAX_TREE_NODES + 1} nodes"):
        check_parents([-1] * (MAX_TREE_NODES + 1))
    with pytest.raises(StoreError, match="empty"):
        check_parents([])
    with pytest.raises(StoreError, match=r"parents\[1\]: must be an int, got bool"):
        check_parents([-1, True])
    with pytest.raises(StoreError, match=r"parents\[1\]: must be an int, got float"):
        check_parents([-1, 0.0])
    with pytest.raises(StoreError, match="list of ints"):
        check_parents("-1 0")
    assert check_parents(torch.tensor([-1, 0, 0])) == [-1, 0, 0]
    assert check_parents([-1] * 31, max_nodes=31) == [-1] * 31

    store = Store(tiny_llama_store)
    span = store.load_span(0, 2)
    cache = span.new_cache()
    span(torch.randn(1, 4, 64), 0, cache)
    for parents, match in [
        ([-1, 0, 5], r"parents\[2\]: 5"),
        ([-1, 1, 0], r"parents\[1\]: 1"),
        ([-1, 0], "2 parents but the window has 3 tokens"),
        ([-1] * (MAX_TREE_NODES + 1), "at most"),
    ]:
        with pytest.raises(StoreError, match=match):
            span(torch.randn(1, 3, 64), 4, cache, parents)
        assert cache.length == 4  # a refused window leaves the cache as it was
    span(torch.randn(1, 3, 64), 4, cache, [-1, 0, 0])
    assert cache.length == 7


def test_keep_refuses_what_is_not_an_accepted_path(tiny_qwen2_store: Path) -> None:
    span = Store(tiny_qwen2_store).load_span(1, 3)
    cache = span.new_cache()
    with pytest.raises(StoreError, match="no intact window"):
        cache.keep(0, [0])
    span(torch.randn(1, 5, 64), 0, cache)
    parents = [-1, 0, 0, 1, -1]
    span(torch.randn(1, 5, 64), 5, cache, parents)
    for prefix_len, rows, match in [
        (5, [0, 2, 3], r"rows\[2\]: 3 is not a child of node 2 \(its parent is 1\)"),
        (5, [1], r"rows\[0\]: 1 is not a child of the committed token"),
        (5, [0, 5], r"rows\[1\]: 5 is outside the last window's nodes \[0, 5\)"),
        (5, [0, -1], r"rows\[1\]: -1 is outside"),
        (4, [0], "prefix length 4 != the last window's start 5"),
        (-1, [0], "non-negative int"),
    ]:
        with pytest.raises(StoreError, match=match):
            cache.keep(prefix_len, rows)
        assert cache.length == 10  # refused: nothing moved
    assert check_path(parents, 5, [0, 1, 3]) == [0, 1, 3]
    cache.keep(5, torch.tensor([0, 1, 3]))
    assert cache.length == 8
    with pytest.raises(StoreError, match="no intact window"):  # a window is kept once
        cache.keep(5, [0])
    span(torch.randn(1, 3, 64), 8, cache, [-1, -1, 1])
    cache.truncate(9)
    with pytest.raises(StoreError, match="no intact window"):  # truncated into: rows are gone
        cache.keep(8, [0])
    cache.keep(6, [])  # no rows: truncate
    assert cache.length == 6
