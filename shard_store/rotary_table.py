"""Rotary cos/sin per absolute position, each computed once in a block of fixed shape, so a position's values never
depend on the window it arrives in.

A family's rotary module computes cos and sin for a window's positions in one call; an elementwise cos runs a
vectorized path over most of a tensor and a scalar one over its tail, and which elements fall in the tail depends on
the window's length and the thread split. Here positions come in aligned blocks of `BLOCK`, each block computed by
the same call shape whatever window first needs it, and windows gather their rows from the blocks: a row at position
p has the same cos and sin in a one-row step, a chain window, a tree or a joint step. Rope types whose frequencies
depend on the call (dynamic NTK, longrope) are computed per call, as the family does.
"""

from __future__ import annotations

import torch
from torch import nn

from .families import FamilyAdapter

BLOCK = 64  # positions per block: one call of this shape computes each block
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies fixed at construction


class RotaryTable:
    """cos/sin of a span's rotary module per attention kind, dtype and block of positions, grown as positions come."""

    def __init__(self, adapter: FamilyAdapter, rotary: nn.Module) -> None:
        self.adapter = adapter
        self.rotary = rotary
        types = getattr(rotary, "rope_type", "default")
        self.static = all(r in STATIC_ROPE for r in (types.values() if isinstance(types, dict) else [types]))
        self._blocks: dict[tuple[str, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def rotate(self, hidden: torch.Tensor, position_ids: torch.Tensor,
               kinds: set[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [b, t, d] for each attention kind, as `FamilyAdapter.rotate` gives them."""
        if not self.static:
            return self.adapter.rotate(self.rotary, hidden, position_ids, kinds)
        lo, hi = int(position_ids.min()) // BLOCK, int(position_ids.max()) // BLOCK
        out = {}
        for kind in kinds:
            blocks = [self._block(kind, hidden, k) for k in range(lo, hi + 1)]
            index = (position_ids - lo * BLOCK).reshape(-1)
            cos, sin = (torch.cat([blk[j] for blk in blocks]).index_select(0, index) for j in (0, 1))
            out[kind] = (cos.view(*position_ids.shape, -1), sin.view(*position_ids.shape, -1))
        return out

    def _block(self, kind: str, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block k's (cos, sin) [BLOCK, d] for `kind` in the hidden states' dtype, computed on first use."""
        key = (kind, hidden.dtype, k)
        if key not in self._blocks:
            positions = torch.arange(k * BLOCK, (k + 1) * BLOCK, device=hidden.device)[None]
            cos, sin = self.adapter.rotate(self.rotary, hidden[:1, :1], positions, {kind})[kind]
            self._blocks[key] = (cos[0], sin[0])
        return self._blocks[key]
