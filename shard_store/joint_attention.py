"""Attention per session inside a joint step (`SpanModule.forward_many`): the layers see several sessions' caches
side by side, and this kernel splits the step's queries and keys back into sessions so each attends over its own
prefix only — as much work as each session's step alone, instead of every query row against every session's keys
(which transformers' CPU attention also repeats per query head).

A span's layers call it through transformers' attention registry under `dsd_sdpa` / `dsd_eager` (the family's own
kernel, see `FamilyAdapter.attn_implementation`, prefixed): outside a joint step it is that kernel, unchanged. A
quantized span runs its layers inside `rows_apart()` and attends row by row instead (`row_attention`), so its rows give
the same bits alone, in a window, in a tree or in a joint step; float spans keep the family's batched kernel (they
compute what transformers computes).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .row_attention import row_attention

PREFIX = "dsd_"
# (query rows, key positions) of each session in the joint step running in this thread, or None outside one.
_SEGMENTS: ContextVar[tuple[tuple[int, int], ...] | None] = ContextVar("dsd_joint_segments", default=None)
# whether the layers running in this thread attend row by row (a quantized span's step)
_ROWS: ContextVar[bool] = ContextVar("dsd_rows_apart", default=False)


@contextmanager
def rows_apart(on: bool = True) -> Iterator[None]:
    """While open (and `on`), this thread's attention computes each query row on its own (`row_attention`)."""
    token = _ROWS.set(on)
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextmanager
def joint_segments(rows: Sequence[int], keys: Sequence[int]) -> Iterator[None]:
    """While open, this thread's attention splits queries by `rows` and keys by `keys`, session by session."""
    token = _SEGMENTS.set(tuple(zip(rows, keys, strict=True)))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def _per_session(base: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    shared = None if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        # eager is each family's own (soft caps, scaling), in the module's modeling file
        kernel = shared or sys.modules[type(module).__module__].eager_attention_forward
        if _ROWS.get():
            kernel = row_attention
        segments = _SEGMENTS.get()
        if segments is None:
            return kernel(module, query, key, value, attention_mask, **kwargs)
        outs, r, c = [], 0, 0
        for rows, keys in segments:
            mask = None if attention_mask is None else attention_mask[:, :, r : r + rows, c : c + keys]
            out, _ = kernel(module, query[:, :, r : r + rows], key[:, :, c : c + keys], value[:, :, c : c + keys],
                            mask, **kwargs)
            outs.append(out)
            r, c = r + rows, c + keys
        return torch.cat(outs, dim=1), None

    return attention


def registered(base: str) -> str:
    """The name of `base`'s per-session kernel in transformers' attention registry (registered on first use)."""
    from transformers import AttentionInterface

    name = PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _per_session(base))
    return name
