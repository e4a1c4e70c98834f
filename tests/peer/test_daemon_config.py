"""The daemon's start-up choices: --blocks parsing and how many layers --memory-gb allows."""

from __future__ import annotations

import pytest

from dsd.node.peer.config import parse_blocks
from dsd.node.peer.loading import blocks_that_fit
from dsd.shard_store import Store


def test_parse_blocks() -> None:
    assert parse_blocks("0:3", 5) == (0, 3)
    for bad in ("3:3", "4:9", "x", "1-2", "-1:2"):
        with pytest.raises(ValueError, match="blocks"):
            parse_blocks(bad, 5)


def test_memory_budget_sets_the_number_of_layers(tiny_qwen2_store) -> None:
    store = Store(tiny_qwen2_store)
    layer = store.span_nbytes(0, 1)
    assert blocks_that_fit(store, None) == 5
    assert blocks_that_fit(store, 2.5 * layer / 2**30) == 2
    assert blocks_that_fit(store, 100.0) == 5
    with pytest.raises(ValueError, match="less than one layer"):
        blocks_that_fit(store, 0.5 * layer / 2**30)
