"""The draft model's KV cache as a tree of token contexts, so several continuations advance in one forward.

Every cache column holds one token and points at its parent column (−1 for the
first token of the sequence). A context (a list of token ids) is a path from the
root; `extend(contexts)` feeds, in ONE forward pass, every token of every context
that is not in the tree yet, each attending only to its own ancestors (an additive
4D mask, position = depth), and returns the next-token logits of each context.
`settle(context)` keeps only the path of `context` (compacting the cache with
`index_select`), so plain chain drafting goes on from there as before.

This is how the head drafts the next window for several likely outcomes of the
window in flight at the cost of one batched draft step per token (outcome
pre-drafting, `node/head/outcomes.py`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from dsd.shard_store.families import FAMILIES, FamilyAdapter


class DraftCache:
    """A causal LM plus its KV cache organised as a token tree (CPU or any device the model is on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: Any = None
        self.tokens: list[int] = []  # token of each cache column
        self.parents: list[int] = []  # parent column of each cache column (-1: sequence start)
        self.depths: list[int] = []  # position id of each column
        self._children: list[dict[int, int]] = []  # column -> {token: child column}
        self._roots: dict[int, int] = {}  # first tokens of sequences -> column
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        """Forget everything (the next forward recomputes its whole context)."""
        self.cache = None
        self.tokens, self.parents, self.depths, self._children, self._roots = [], [], [], [], {}

    def is_chain(self) -> bool:
        """True when the columns form one path in order (no branches held)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def match(self, context: Sequence[int]) -> list[int]:
        """Columns of the longest prefix of `context` held in the tree, in order."""
        cols: list[int] = []
        nxt = self._roots
        for tok in context:
            col = nxt.get(int(tok))
            if col is None:
                break
            cols.append(col)
            nxt = self._children[col]
        return cols

    def settle(self, context: Sequence[int]) -> int:
        """Keep only the columns of the longest held prefix of `context` (in path order); returns its length."""
        cols = self.match(context)
        if len(cols) == len(self.tokens) and cols == list(range(len(cols))):
            return len(cols)  # already exactly that chain
        if not cols:
            self.reset()
            return 0
        if cols == list(range(len(cols))):
            self._crop(len(cols))
        else:
            self._select(cols)
        toks = [self.tokens[c] for c in cols]
        self.tokens, self.parents, self.depths = toks, list(range(-1, len(cols) - 1)), list(range(len(cols)))
        self._reindex()
        return len(cols)

    def keep(self, contexts: Sequence[Sequence[int]]) -> None:
        """Keep only the columns on the held prefixes of `contexts` (a shared tree's live generations), in order."""
        cols = sorted({col for ctx in contexts for col in self.match([int(t) for t in ctx])})
        if len(cols) == len(self.tokens):
            return
        if not cols:
            self.reset()
            return
        self._select(cols)
        index = {col: i for i, col in enumerate(cols)}
        self.parents = [index[self.parents[c]] if self.parents[c] >= 0 else -1 for c in cols]
        self.tokens = [self.tokens[c] for c in cols]
        self.depths = [self.depths[c] for c in cols]
        self._reindex()

    def extend(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Next-token logits [len(contexts), V] of each context, feeding all missing tokens in one forward.

        Contexts sharing a missing prefix share its nodes. A context that is already fully
        held has its last token fed again (logits are not kept per column), which costs one
        duplicate column; callers normally pass contexts that end in a new token.
        """
        if not contexts:
            raise ValueError("extend needs at least one context")
        new_tokens: list[int] = []
        new_parents: list[int] = []  # parent column (existing) or -(k + 2) for the k-th new node
        ends: list[int] = []  # per context: index into the new nodes, or -(col + 1) if already held
        pending: dict[tuple[int, int], int] = {}  # (parent key, token) -> new node index
        for ctx in contexts:
            if not ctx:
                raise ValueError("a context must hold at least one token")
            cols = self.match(ctx)
            if len(cols) == len(ctx):
                cols = cols[:-1]  # its logits are needed: feed its last token again as a new node
            parent_key = cols[-1] if cols else -1
            node = -1
            for tok in ctx[len(cols):]:
                key = (parent_key, int(tok))
                node = pending.get(key, -1)
                if node < 0:
                    node = len(new_tokens)
                    pending[key] = node
                    new_tokens.append(int(tok))
                    new_parents.append(parent_key)
                parent_key = -(node + 2)
            ends.append(node)
        return self._forward(new_tokens, new_parents, ends)

    # --- internals ----------------------------------------------------------

    def _forward(self, tokens: list[int], parents: list[int], rows: list[int]) -> torch.Tensor:
        """Run new nodes (parents: column >= 0, -1 = sequence start, -(k+2) = new node k), add them, and
        return the logits of the new nodes listed in `rows` (the lm_head runs on those rows only)."""
        past = len(self.tokens)
        n = len(tokens)
        cols = [p if p >= -1 else past + (-p - 2) for p in parents]
        depths = [0] * n
        for i, c in enumerate(cols):  # a new node's parent may be an earlier new node
            depths[i] = 0 if c < 0 else (self.depths[c] + 1 if c < past else depths[c - past] + 1)
        kwargs: dict[str, Any] = {}
        if not self._continues_chain(cols):
            kwargs["attention_mask"] = self._masks(cols, past, depths)
            kwargs["position_ids"] = torch.tensor([depths], dtype=torch.long, device=self._device)
        if self.cache is None:
            from transformers import DynamicCache

            self.cache = DynamicCache()  # full layers for every kind: a sliding layer's cache could not be cropped back
        decoder = getattr(self.model, "model", None)
        try:
            ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
            if decoder is not None:
                hidden = decoder(input_ids=ids, use_cache=True, **kwargs, **{self._cache_kwarg: self.cache})[0]
                logits = self.model.get_output_embeddings()(hidden[0, rows])
                cap = FamilyAdapter.logit_softcap(self.model.config)
                if cap is not None:  # what the model's own forward does after its lm_head (Gemma 2)
                    logits = torch.tanh(logits / cap) * cap
            else:
                logits = self.model(input_ids=ids, use_cache=True, **kwargs, **{self._cache_kwarg: self.cache}).logits[0, rows]
        except BaseException:
            self.reset()  # a forward that failed midway may have updated only some layers
            raise
        for tok, c, d in zip(tokens, cols, depths, strict=True):
            self._add(tok, c, d)
        return logits.float().cpu()

    @property
    def _device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _continues_chain(self, cols: list[int]) -> bool:
        """True when the new nodes extend the held chain in order: a plain causal forward is exact then."""
        past = len(self.tokens)
        if not self.is_chain():
            return False
        return all(c == past + i - 1 for i, c in enumerate(cols))

    def _masks(self, cols: list[int], past: int, depths: list[int]) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive 4D mask: each new node sees its ancestors (held or new) and itself; a sliding layer also
        only the keys less than its window deep above it. One mask when every layer is of one kind, else one
        per kind (what transformers takes for models with `layer_types`)."""
        n = len(cols)
        visible = torch.zeros(n, past + n, dtype=torch.bool)
        for i, c in enumerate(cols):
            visible[i, past + i] = True
            while c >= 0:
                if c >= past:
                    visible[i, c] = True
                    c = cols[c - past]
                else:
                    visible[i, self._ancestors(c)] = True
                    break
        config = self.model.config
        adapter = FAMILIES.get(str(config.model_type))  # a draft of another family: one full mask
        masks = dict.fromkeys(set(adapter.layer_kinds(config)) if adapter else {"full_attention"}, visible)
        if "sliding_attention" in masks:
            q = torch.tensor(depths)
            k = torch.cat([torch.tensor(self.depths, dtype=torch.long), q])
            masks["sliding_attention"] = visible & (k[None, :] > q[:, None] - int(config.sliding_window))
        dtype = self.model.get_input_embeddings().weight.dtype
        out = {}
        for kind, allowed in masks.items():
            mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=self._device)
            out[kind] = mask.masked_fill_(~allowed.to(self._device), torch.finfo(dtype).min)
        return next(iter(out.values())) if len(out) == 1 else out

    def _ancestors(self, col: int) -> list[int]:
        """`col` and every column above it."""
        out = []
        while col >= 0:
            out.append(col)
            col = self.parents[col]
        return out

    def _add(self, token: int, parent: int, depth: int) -> None:
        col = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self._children.append({})
        (self._roots if parent < 0 else self._children[parent]).setdefault(token, col)

    def _reindex(self) -> None:
        self._children = [{} for _ in self.tokens]
        self._roots = {}
        for col, (tok, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            (self._roots if parent < 0 else self._children[parent]).setdefault(tok, col)

    def _crop(self, keep: int) -> None:
        current = self.cache.get_seq_length()
        if current > keep:
            self.cache.crop(-(current - keep))  # negative: tokens to drop (transformers >= 5)

    def _select(self, cols: list[int]) -> None:
        index = torch.tensor(cols, dtype=torch.long)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            idx = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)
