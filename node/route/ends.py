"""The head's end of a ring where hidden states enter it: tokens embedded, then run through the layers the head
serves itself when those are the model's first ones. One function for the route, its audits and their blame."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dsd.shard_store import HeadModule, SpanModule


def rows_into_route(
    head: HeadModule, first: SpanModule | None, cache: Any, tokens: Sequence[int], start: int, commit: int | None,
    parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
) -> np.ndarray:
    """A window's hidden states as they leave the head: embedded, and through `first` (the head's own first layers,
    with its KV `cache`, committing as a peer does) if the head serves them; float32 [tokens, hidden]."""
    with torch.inference_mode():
        hidden = head.embed(torch.tensor([list(tokens)], dtype=torch.long))
    if first is not None:
        hidden = first.step(hidden, start, cache, commit=commit, parents=parents, keep=keep)
    return hidden[0].to("cpu").to(torch.float32).numpy()
