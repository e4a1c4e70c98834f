"""Runtime modules built from a store: the head (embeddings, final norm, lm_head) and a layer span.

Both reuse transformers' own decoder-layer, RMSNorm and rotary classes; only the glue (positions,
causal or token-tree mask, per-span cache) lives here. A module computes where its weights are
(`device`, `dtype`): inputs from anywhere are moved and cast to it, outputs stay there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .errors import StoreError
from .families import FamilyAdapter
from .joint_attention import PREFIX, joint_segments, registered, rows_apart
from .kv_cache import JointCache, SpanCache
from .quant import QUANT_FORMATS, Int4Linear, Int8Embedding, Int8Linear, format_of_dtype
from .rotary_table import RotaryTable
from .tree_windows import check_parents, is_chain, tree_mask, tree_position_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class HeadModule(nn.Module):
    """The two ends of the model the head peer holds: token embedding in, final norm + lm_head out."""

    def __init__(
        self,
        embed_tokens: nn.Embedding | Int8Embedding,
        norm: nn.Module,
        lm_head: nn.Linear | Int8Linear,
        config: PretrainedConfig,
        adapter: FamilyAdapter,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        self.config = config
        self.embed_scale = adapter.embed_scale(config)
        self.logit_softcap = adapter.logit_softcap(config)
        self.vocab_size = int(embed_tokens.num_embeddings)
        self.hidden_size = int(embed_tokens.embedding_dim)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its final norm's; int8 ends compute in it too)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the head computes."""
        return self.norm.weight.device

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] (any device) -> hidden states [b, t, h] on the head's device; ids outside the
        vocabulary are a StoreError."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise StoreError("embed: input_ids must be an int64/int32 tensor")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise StoreError(f"embed: input_ids must have shape [batch, tokens>0], got {tuple(input_ids.shape)}")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise StoreError(f"embed: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})")
        hidden = self.embed_tokens(input_ids.to(device=self.device, dtype=torch.long))
        if self.embed_scale is not None:  # as transformers does it: the scale rounded to the weights' dtype first
            hidden = hidden * torch.tensor(self.embed_scale).to(hidden.dtype)
        return hidden

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [b, t, h] from the last span (any device) -> logits [b, t, V] on the head's device
        (final norm, lm_head, then the family's soft cap if it has one)."""
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise StoreError(f"logits: hidden must be [batch, tokens, {self.hidden_size}], got {tuple(hidden.shape)}")
        logits = self.lm_head(self.norm(hidden.to(device=self.device, dtype=self.dtype)))
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


@dataclass(frozen=True)
class SpanWindow:
    """One session's window for a step shared with other sessions (`SpanModule.step_each`): its hidden states
    [1, t, hidden] at positions start_pos.., its cache, and `commit`/`parents`/`keep` as `SpanModule.step` takes them."""

    hidden: torch.Tensor
    start_pos: int
    cache: SpanCache
    commit: int | None = None
    parents: Sequence[int] | torch.Tensor | None = None
    keep: Sequence[int] | None = None

    def commit_cache(self) -> None:
        """Commit the cache's last window as `SpanModule.step` does first: keep the path `keep`, else truncate to
        `commit` (None: leave the cache as it is)."""
        if self.commit is not None:
            self.cache.keep(self.commit, list(self.keep) if self.keep else [])


class SpanModule(nn.Module):
    """Decoder layers [start, end): hidden states + positions + this span's KV cache -> hidden states."""

    def __init__(
        self,
        adapter: FamilyAdapter,
        config: PretrainedConfig,
        start: int,
        end: int,
        layers: list[nn.Module],
        weights: str | None = None,
    ) -> None:
        super().__init__()
        self._weights = weights  # the format its loader packed (None: read from its modules)
        if len(layers) != end - start:
            raise StoreError(f"span [{start}, {end}) needs {end - start} layers, got {len(layers)}")
        self.adapter = adapter
        self.config = config
        self.start = start
        self.end = end
        self.hidden_size = int(config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = adapter.new_rotary(config).to(next(self.layers.parameters()).device)
        # a quantized span is batch-invariant: rows attend apart, each position's cos/sin alike in any window
        # (float spans compute what transformers computes; a benchmark may switch it to measure its cost)
        self.batch_invariant = self.weights in QUANT_FORMATS
        self._rotary = RotaryTable(adapter, self.rotary_emb)
        if not str(config._attn_implementation).startswith(PREFIX):  # attention per session in a joint step
            config._attn_implementation = registered(config._attn_implementation)
        self._layer_types = adapter.layer_kinds(config)[start:end]
        self._sliding_window = getattr(config, "sliding_window", None)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype of the span (inputs are cast to it)."""
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where the span computes (inputs are moved there; its caches fill there)."""
        return next(self.parameters()).device

    @property
    def weights(self) -> str:
        """The span's weight format: as its loader packed it (int8, int4, q4k: `quant.py`), else its float dtype's."""
        if self._weights is not None:
            return self._weights
        for m in self.layers.modules():
            if isinstance(m, Int8Linear):
                return "int8"
            if isinstance(m, Int4Linear):
                return "int4"
        return format_of_dtype(self.dtype)

    def sub(self, start: int, end: int) -> SpanModule:
        """Layers [start, end) of this span as a span of their own, sharing the weights (no copy)."""
        if (start, end) == (self.start, self.end):
            return self
        if not self.start <= start < end <= self.end:
            raise StoreError(f"[{start}, {end}) is not inside this span [{self.start}, {self.end})")
        layers = list(self.layers)[start - self.start : end - self.start]
        return SpanModule(self.adapter, self.config, start, end, layers, self._weights)

    def new_cache(self, max_length: int | None = None) -> SpanCache:
        """An empty KV cache for this span (optionally refusing to grow past max_length positions); its
        buffers are allocated on the span's device in its dtype, as the layers hand it keys and values."""
        return SpanCache(self.start, self.end, max_length=max_length)

    def _mask(
        self, kind: str, start_pos: int, t: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> torch.Tensor | None:
        """Additive mask [1, 1, t, start_pos+t] on `device`: causal over cache + window, plus the sliding window."""
        if kind == "full_attention" and t == 1:
            return None  # one query sees every cached position
        q_pos = torch.arange(start_pos, start_pos + t, device=device)[:, None]
        k_pos = torch.arange(start_pos + t, device=device)[None, :]
        allowed = k_pos <= q_pos
        if kind == "sliding_attention":
            if not self._sliding_window:
                raise StoreError("sliding_attention layer but config.sliding_window is not set")
            allowed &= k_pos > q_pos - int(self._sliding_window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def _tree_mask(self, kind: str, start_pos: int, parents: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Additive ancestor-only mask of a tree window for one attention kind."""
        window = None
        if kind == "sliding_attention":
            if not self._sliding_window:
                raise StoreError("sliding_attention layer but config.sliding_window is not set")
            window = int(self._sliding_window)
        return tree_mask(start_pos, parents, hidden.dtype, sliding_window=window, device=hidden.device)

    def step(
        self,
        hidden: torch.Tensor,
        start_pos: int,
        cache: SpanCache,
        *,
        commit: int | None = None,
        parents: Sequence[int] | torch.Tensor | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One window of a session, in inference mode: first commit the cache's last window (with
        `keep`, its accepted path, root first, after `commit` = that window's start; without, a
        truncation to `commit`; commit None leaves the cache as it is), then run `hidden` at
        positions start_pos.. (a token tree with `parents`).

        What a block peer does with every `Forward`, and a head serving a span itself with every window.
        """
        with torch.inference_mode():
            SpanWindow(hidden, start_pos, cache, commit, parents, keep).commit_cache()
            return self(hidden, start_pos, cache, parents)

    def step_each(self, windows: Sequence[SpanWindow]) -> list[torch.Tensor | Exception]:
        """Several sessions' windows as one step where they can be, each its own output or error: every window's
        cache is committed (a commit that fails is that window's error), the rest run as one step (`forward_many`),
        and if that step fails (a cache refusing its window) they run one by one, so one bad window fails only
        itself. How a block peer's batcher and a serving head's own span run their joint steps."""
        out: list[torch.Tensor | Exception | None] = [None] * len(windows)
        with torch.inference_mode():
            ready = []
            for i, w in enumerate(windows):
                try:
                    w.commit_cache()
                    ready.append(i)
                except Exception as exc:
                    out[i] = exc
            joint = None
            if len(ready) > 1:
                try:
                    joint = self.forward_many([windows[i] for i in ready])
                except Exception:
                    joint = None
            for k, i in enumerate(ready):
                if joint is not None:
                    out[i] = joint[k]
                    continue
                w = windows[i]
                try:
                    out[i] = self.forward(w.hidden, w.start_pos, w.cache, w.parents)
                except Exception as exc:
                    out[i] = exc
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, start_pos: int, cache: SpanCache, parents: Sequence[int] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the window through the span, appending its K/V.

        parents None: a chain at positions start_pos..start_pos+t-1 (causal mask). Otherwise a token
        tree (see shard_store.tree_windows): node i at start_pos + depth(i), attending to the cache and its
        ancestors only; every node's K/V is appended and `cache.keep` later commits one path.
        """
        tree = self._check_window(hidden, start_pos, cache, parents)
        b, t, _ = hidden.shape
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if tree is None:
            position_ids = torch.arange(start_pos, start_pos + t, device=hidden.device).unsqueeze(0).expand(b, t)
        else:
            position_ids = tree_position_ids(start_pos, tree, device=hidden.device).expand(b, t)
        masks = {kind: self._window_mask(kind, start_pos, t, tree, hidden) for kind in set(self._layer_types)}
        cache.begin(t, tree)
        return self._run_layers(hidden, position_ids, masks, [cache], cache)

    @torch.no_grad()
    def forward_many(self, windows: Sequence[SpanWindow]) -> list[torch.Tensor]:
        """Several sessions' windows as one step: the projections and MLPs run over their stacked rows (the
        weights are read once), attention per session against its own cache (`joint_attention`: the caches side by
        side, split back by session; the block-diagonal mask keeps a kernel that sees them all exact too). Each
        output equals `forward` of its window alone within float rounding."""
        if len(windows) == 1:
            w = windows[0]
            return [self.forward(w.hidden, w.start_pos, w.cache, w.parents)]
        if len({id(w.cache) for w in windows}) != len(windows):
            raise StoreError("span forward_many: two windows of one cache in the same step")
        trees = [self._check_window(w.hidden, w.start_pos, w.cache, w.parents) for w in windows]
        if any(w.hidden.shape[0] != 1 for w in windows):
            raise StoreError("span forward_many: every window must be a batch of 1")
        sizes = [int(w.hidden.shape[1]) for w in windows]
        hidden = torch.cat([w.hidden for w in windows], dim=1).to(device=self.device, dtype=self.dtype)
        device = hidden.device
        position_ids = torch.cat([
            torch.arange(w.start_pos, w.start_pos + t, device=device) if tree is None
            else tree_position_ids(w.start_pos, tree, device=device)[0]
            for w, t, tree in zip(windows, sizes, trees, strict=True)
        ]).unsqueeze(0)
        masks = {}
        for kind in set(self._layer_types):
            blocks = [self._window_mask(kind, w.start_pos, t, tree, hidden, explicit=True)
                      for w, t, tree in zip(windows, sizes, trees, strict=True)]
            masks[kind] = torch.block_diag(*[m[0, 0] for m in blocks]).unsqueeze(0).unsqueeze(0)
            outside = torch.block_diag(*[torch.ones_like(m[0, 0], dtype=torch.bool) for m in blocks])
            masks[kind].masked_fill_(~outside, torch.finfo(hidden.dtype).min)
        caches = [w.cache for w in windows]
        keys = [c.length + t for c, t in zip(caches, sizes, strict=True)]
        try:
            for w, t, tree in zip(windows, sizes, trees, strict=True):
                w.cache.begin(t, tree)
        except StoreError:
            for c in caches:
                c.abort()
            raise
        with joint_segments(sizes, keys):
            out = self._run_layers(hidden, position_ids, masks, caches, JointCache(caches, sizes))
        return list(out.split(sizes, dim=1))

    def _check_window(
        self, hidden: torch.Tensor, start_pos: int, cache: SpanCache, parents: Sequence[int] | torch.Tensor | None
    ) -> list[int] | None:
        """StoreError unless the window fits this span and its cache; its tree (None for a chain, or a tree that is
        exactly a chain: same mask, positions and kernels)."""
        if not isinstance(cache, SpanCache) or (cache.start, cache.end) != (self.start, self.end):
            raise StoreError(f"span [{self.start}, {self.end}) needs a cache from its own new_cache()")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise StoreError(f"span forward: hidden must be [batch, tokens, {self.hidden_size}], got {shape}")
        t = hidden.shape[1]
        if t == 0:
            raise StoreError("span forward: empty window (0 tokens)")
        if start_pos != cache.length:
            raise StoreError(
                f"span forward: start_pos {start_pos} != cache length {cache.length} "
                "(truncate the cache first, or send the missing positions)"
            )
        if parents is None:
            return None
        tree = check_parents(parents)
        if len(tree) != t:
            raise StoreError(f"span forward: tree has {len(tree)} parents but the window has {t} tokens")
        return None if is_chain(tree) else tree

    def _window_mask(
        self, kind: str, start_pos: int, t: int, tree: list[int] | None, hidden: torch.Tensor, explicit: bool = False
    ) -> torch.Tensor | None:
        """The additive mask [1, 1, t, start_pos + t] of a chain or a tree window for one attention kind (None where
        none is needed, unless `explicit`)."""
        if tree is not None:
            return self._tree_mask(kind, start_pos, tree, hidden)
        mask = self._mask(kind, start_pos, t, hidden.dtype, hidden.device)
        if mask is None and explicit:
            return torch.zeros((1, 1, t, start_pos + t), dtype=hidden.dtype, device=hidden.device)
        return mask

    def _run_layers(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, masks: dict[str, torch.Tensor | None],
        caches: Sequence[SpanCache], cache: SpanCache | JointCache,
    ) -> torch.Tensor:
        """The layers over `hidden`, appending to `caches` (begun), which commit after the last layer or forget
        the window if one fails."""
        kinds = set(self._layer_types)
        rotations = (self._rotary.rotate(hidden, position_ids, kinds) if self.batch_invariant
                     else self.adapter.rotate(self.rotary_emb, hidden, position_ids, kinds))
        try:
            with rows_apart(self.batch_invariant):
                for layer, kind in zip(self.layers, self._layer_types, strict=True):
                    hidden = layer(
                        hidden,
                        attention_mask=masks[kind],
                        position_ids=position_ids,
                        cache=cache,
                        use_cache=True,
                        position_embeddings=rotations[kind],
                    )
        except BaseException:
            for c in caches:
                c.abort()
            raise
        for c in caches:
            c.commit()
        return hidden
