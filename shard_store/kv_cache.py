"""Per-span KV cache: appends a window's keys/values, truncates back exactly (rejected chain drafts)
and keeps an accepted root-to-node path of a token-tree window (compaction in place)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import StoreError
from .tree_windows import check_path


class SpanCache:
    """Keys/values of decoder layers [start, end) for one sequence batch.

    Buffers grow by doubling and `truncate` only moves the length, so dropping rejected drafts is
    O(1) and exact: entries >= length are never read again. Transformers' attention calls
    `update(k, v, layer_idx)` with the absolute layer index; the cache maps it to its own slot.
    The last window (start, size, parents) is remembered so `keep` can check an accepted path.
    """

    def __init__(self, start: int, end: int, max_length: int | None = None) -> None:
        if not 0 <= start < end:
            raise StoreError(f"cache span [{start}, {end}) is empty or negative")
        if max_length is not None and max_length <= 0:
            raise StoreError(f"cache max_length must be positive, got {max_length}")
        self.start = start
        self.end = end
        self.max_length = max_length
        self._keys: list[torch.Tensor | None] = [None] * (end - start)
        self._values: list[torch.Tensor | None] = [None] * (end - start)
        self._length = 0
        self._pending = 0  # tokens of the window being appended (0 outside a forward)
        self._pending_parents: list[int] | None = None
        # (start, nodes, parents or None for a chain) of the last appended window while it is intact
        self._window: tuple[int, int, list[int] | None] | None = None

    @property
    def length(self) -> int:
        """Number of committed positions held (the next window must start here)."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers (allocated capacity, not just the used length)."""
        total = 0
        for buf in (*self._keys, *self._values):
            if buf is not None:
                total += buf.numel() * buf.element_size()
        return total

    def truncate(self, n: int) -> None:
        """Drop every entry at position >= n; n > length is an error."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StoreError(f"cache truncate length must be a non-negative int, got {n!r}")
        if n > self._length:
            raise StoreError(f"cannot truncate cache to {n}: it holds only {self._length} positions")
        if n < self._length:
            self._window = None
        self._length = n

    def keep(self, prefix_len: int, rows: Sequence[int]) -> None:
        """Commit an accepted path of the last window: keep positions [0, prefix_len) plus the given
        window rows (node indices from the window's start, root first), dropping every other row.

        With rows, prefix_len must be the last window's start and rows a root-to-node path of it;
        the rows are copied down inside the buffers (no recomputation) and the length becomes
        prefix_len + len(rows). Without rows this is truncate(prefix_len).
        """
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
            raise StoreError(f"cache keep prefix length must be a non-negative int, got {prefix_len!r}")
        if hasattr(rows, "tolist"):
            rows = rows.tolist()
        if isinstance(rows, Sequence) and len(rows) == 0:
            self.truncate(prefix_len)
            return
        if self._window is None:
            raise StoreError("cache keep: no intact window to keep rows from (it was truncated or already kept)")
        start, nodes, parents = self._window
        if prefix_len != start:
            raise StoreError(f"cache keep: prefix length {prefix_len} != the last window's start {start}")
        path = check_path(parents, nodes, rows)
        if path != list(range(len(path))):  # a prefix of the window is already in place
            self._copy_rows(start, path)
        self._length = start + len(path)
        self._window = None

    @torch.inference_mode()
    def _copy_rows(self, start: int, path: list[int]) -> None:
        """Move the path's rows to [start, start + len(path)) in every buffer (inference tensors need inference mode)."""
        for bufs in (self._keys, self._values):
            for buf in bufs:
                if buf is not None:
                    index = torch.tensor(path, dtype=torch.long, device=buf.device) + start
                    buf[:, :, start : start + len(path)] = buf.index_select(2, index)

    def begin(self, tokens: int, parents: list[int] | None = None) -> None:
        """Start appending a window of `tokens` positions (called by SpanModule before its layers run);
        `parents` is the checked tree of the window, None for a chain."""
        if self.max_length is not None and self._length + tokens > self.max_length:
            raise StoreError(
                f"cache full: {self._length} + {tokens} positions exceed max_length {self.max_length}"
            )
        self._pending = tokens
        self._pending_parents = parents

    def commit(self) -> None:
        """Make the window appended since begin() part of the cache."""
        self._window = (self._length, self._pending, self._pending_parents)
        self._length += self._pending
        self._pending = 0
        self._pending_parents = None

    def abort(self) -> None:
        """Forget a half-appended window (a layer failed): the cache stays at its old length."""
        self._pending = 0
        self._pending_parents = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this window's K/V for absolute layer `layer_idx`; return K/V over the whole prefix."""
        slot = layer_idx - self.start
        if not 0 <= slot < len(self._keys):
            raise StoreError(f"layer {layer_idx} is outside this cache's span [{self.start}, {self.end})")
        t = key_states.shape[-2]
        if t != self._pending:
            raise StoreError(f"cache got {t} positions for layer {layer_idx}, expected {self._pending}")
        need = self._length + t
        self._keys[slot] = buf_k = self._fit(self._keys[slot], key_states, need)
        self._values[slot] = buf_v = self._fit(self._values[slot], value_states, need)
        buf_k[:, :, self._length : need] = key_states
        buf_v[:, :, self._length : need] = value_states
        return buf_k[:, :, :need], buf_v[:, :, :need]

    def _fit(self, buf: torch.Tensor | None, new: torch.Tensor, need: int) -> torch.Tensor:
        """Return a buffer shaped like `new` with capacity >= need, keeping the committed prefix."""
        b, heads, _, dim = new.shape
        if buf is not None:
            if buf.shape[0] != b or buf.shape[1] != heads or buf.shape[3] != dim or buf.dtype != new.dtype:
                raise StoreError(
                    f"cache holds batch/heads/dim/dtype {tuple(buf.shape[:2])}/{buf.shape[3]}/{buf.dtype}, "
                    f"got {(b, heads)}/{dim}/{new.dtype}"
                )
            if buf.shape[2] >= need:
                return buf
        capacity = max(need, 2 * (buf.shape[2] if buf is not None else 0), 16)
        if self.max_length is not None:
            capacity = max(need, min(capacity, self.max_length))
        grown = torch.empty((b, heads, capacity, dim), dtype=new.dtype, device=new.device)
        if buf is not None and self._length:
            grown[:, :, : self._length] = buf[:, :, : self._length]
        return grown

    def __repr__(self) -> str:
        return f"SpanCache(span=[{self.start}, {self.end}), length={self._length}, nbytes={self.nbytes})"


class JointCache:
    """The caches of several sessions stepping as one window (`SpanModule.forward_many`): a layer's keys and values
    for the stacked rows are split by session, appended to each session's own cache, and handed back side by side
    (each session's whole prefix, then the next's), which the step's block-diagonal mask keeps apart."""

    def __init__(self, caches: Sequence[SpanCache], sizes: Sequence[int]) -> None:
        if len(caches) != len(sizes) or not caches:
            raise StoreError(f"a joint cache needs one window size per cache, got {len(sizes)} for {len(caches)}")
        self.caches, self.sizes = list(caches), list(sizes)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each session's rows into its cache; the keys/values over every session's prefix, side by side."""
        parts = [c.update(k, v, layer_idx) for c, k, v in zip(self.caches, key_states.split(self.sizes, dim=-2),
                                                               value_states.split(self.sizes, dim=-2), strict=True)]
        return torch.cat([k for k, _ in parts], dim=-2), torch.cat([v for _, v in parts], dim=-2)
