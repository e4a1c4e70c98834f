"""Attention one query row at a time over exactly the keys it sees, so a row's numbers never depend on its window.

A quantized span computes in bfloat16 and rounds its attention output to bf16.
Computed by a batched kernel, a row's scores and sums are blocked, vectorized and split across threads by the shape of
the whole window, so the same row rounds differently in a one-row `ar` step, in a chain window, in a token tree or
beside other sessions' rows; at bf16's precision the two likeliest tokens are often tied, and that rounding decided
the text (docs/quantization.md, "Batch-invariant spans"). Here every row makes the same calls with the same shapes
whatever else the step holds: its visible keys (a slice of the cache for a chain or a sliding window, the prompt and
its ancestors gathered in order for a tree node), its scores q·k, soft cap, softmax and weighted values in float32,
rounded to the module's dtype once. Nothing in a row's calls sees another row, so no kernel's blocking, thread split
or vector tail can make the row's bits depend on the window.

The visible keys come from the step's additive mask (0 where a row may look, the dtype's minimum elsewhere); the
mask is not added, it only chooses the keys.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import StoreError


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *, scaling: float | None = None, softcap: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [b, heads, t, d], key/value [b, kv heads, n, d] -> [b, t, heads, d]
    in the query's dtype, each row computed on its own (see the module docstring)."""
    if kwargs.get("s_aux") is not None:
        raise StoreError("row attention does not take attention sinks (s_aux): this family is not supported")
    b, heads, t, d = query.shape
    kv_heads, n = int(key.shape[1]), int(key.shape[2])
    if heads % kv_heads:
        raise StoreError(f"row attention: {heads} query heads do not share {kv_heads} key/value heads evenly")
    groups = heads // kv_heads
    scale = float(scaling if scaling is not None else getattr(module, "scaling", d ** -0.5))
    keys, values = key.float(), value.float()
    out = torch.empty((b, t, heads, d), dtype=query.dtype, device=query.device)
    for s in range(b):
        for i, seen in enumerate(visible_keys(attention_mask, s, t, n)):
            k = keys[s, :, seen] if isinstance(seen, slice) else keys[s].index_select(1, seen)
            v = values[s, :, seen] if isinstance(seen, slice) else values[s].index_select(1, seen)
            scores = torch.matmul(query[s, :, i].float().view(kv_heads, groups, d), k.transpose(1, 2)) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[s, i] = torch.matmul(torch.softmax(scores, dim=-1), v).view(heads, d)
    return out, None


def visible_keys(mask: torch.Tensor | None, batch: int, t: int, n: int) -> list[slice | torch.Tensor]:
    """Per query row of sequence `batch`, the keys it sees: a slice where they are one run (a chain, a sliding
    window), else their indices in order (a tree node: the prompt, then its ancestors); no mask: every key."""
    if mask is None:
        return [slice(0, n)] * t
    rows = mask[batch if mask.shape[0] > 1 else 0, 0]
    if tuple(rows.shape) != (t, n):
        raise StoreError(f"row attention: mask rows {tuple(rows.shape)} do not match {t} queries and {n} keys")
    allowed = rows if rows.dtype == torch.bool else rows == 0
    count = allowed.sum(dim=-1)
    first = allowed.to(torch.uint8).argmax(dim=-1)
    last = n - 1 - allowed.flip(-1).to(torch.uint8).argmax(dim=-1)
    runs = (last - first + 1 == count).tolist()
    out: list[slice | torch.Tensor] = []
    for i, (c, f, run) in enumerate(zip(count.tolist(), first.tolist(), runs, strict=True)):
        if c == 0:
            raise StoreError(f"row attention: query row {i} may see no key")
        out.append(slice(f, f + c) if run else allowed[i].nonzero().flatten())
    return out
