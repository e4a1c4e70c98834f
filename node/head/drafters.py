"""Drafters for the head: a model-free n-gram (prompt lookup) drafter and a draft model.

Both take the full token context (committed tokens, possibly extended by
still-unverified drafts when the head drafts ahead) and return up to γ draft
tokens plus, for the model drafter, the warped draft distributions q that
lossless verification needs. After a rejection the head simply calls again
with the shorter, corrected context: the model drafter keeps the KV cache of
the longest common prefix and crops the rest, so rollback costs nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .sampling import SamplingParams, sample, softmax, warp

__all__ = ["NgramDrafter", "ModelDrafter", "check_vocab_compatible"]


class NgramDrafter:
    """Prompt-lookup drafting: copy what followed the latest earlier match of the context's tail.

    Tries the longest suffix n-gram first (max_ngram down to min_ngram). If the
    copied continuation is shorter than γ, the lookup repeats on the extended
    context. May return fewer than γ tokens (none when nothing matches).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_lookback: int = 4096) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
        if not isinstance(max_lookback, int) or max_lookback < 2:
            raise ValueError(f"max_lookback must be an integer >= 2, got {max_lookback!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_lookback = max_lookback

    def _lookup(self, ctx: list[int], want: int) -> list[int]:
        n_ctx = len(ctx)
        lo = max(0, n_ctx - self.max_lookback)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ctx[n_ctx - n :]
            last = tail[-1]
            # Latest earlier occurrence whose continuation starts inside the context.
            for s in range(n_ctx - n - 1, lo - 1, -1):
                if ctx[s + n - 1] == last and ctx[s : s + n] == tail:
                    return ctx[s + n : s + n + want]
        return []

    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], None]:
        """Up to γ draft tokens continuing `context`; q is None (deterministic drafter)."""
        if not isinstance(gamma, int) or gamma < 0:
            raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
        ctx = [int(t) for t in context]
        out: list[int] = []
        while len(out) < gamma:
            got = self._lookup(ctx, gamma - len(out))
            if not got:
                break
            out.extend(got)
            ctx.extend(got)
        return out, None


def _tokenizer_vocab(tok: Any) -> dict[str, int]:
    if not hasattr(tok, "get_vocab"):
        raise TypeError(f"tokenizer {type(tok).__name__} has no get_vocab()")
    return dict(tok.get_vocab())


def check_vocab_compatible(
    target_vocab_size: int,
    draft_vocab_size: int,
    target_tokenizer: Any = None,
    draft_tokenizer: Any = None,
) -> None:
    """Raise ValueError unless the draft can propose tokens in the target's vocabulary.

    Sizes (logit rows) must match; when both tokenizers are given their
    token -> id maps must be identical.
    """
    if int(target_vocab_size) != int(draft_vocab_size):
        raise ValueError(
            f"draft model vocabulary ({draft_vocab_size} logits) differs from the target's "
            f"({target_vocab_size}): a draft model must share the target's tokenizer and vocabulary"
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    tv, dv = _tokenizer_vocab(target_tokenizer), _tokenizer_vocab(draft_tokenizer)
    if tv == dv:
        return
    only_t = sorted(set(tv) - set(dv))
    only_d = sorted(set(dv) - set(tv))
    moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])
    detail = []
    if only_t:
        detail.append(f"{len(only_t)} tokens only in the target's (e.g. {only_t[:3]!r})")
    if only_d:
        detail.append(f"{len(only_d)} tokens only in the draft's (e.g. {only_d[:3]!r})")
    if moved:
        detail.append(f"{len(moved)} tokens with different ids (e.g. {moved[:3]!r})")
    raise ValueError(
        "draft tokenizer differs from the target's tokenizer: " + "; ".join(detail)
        + "; a draft model must share the target's tokenizer"
    )


def _crop_cache(cache: Any, keep: int) -> None:
    current = cache.get_seq_length()
    if current > keep:
        # Negative = number of tokens to remove (accepted by old and new transformers).
        cache.crop(-(current - keep))


class ModelDrafter:
    """Drafts with a transformers causal LM, keeping its own KV cache across calls.

    `propose(context, γ)` reuses the cached longest common prefix with
    `context`, crops the rest, feeds only the new tokens, then drafts γ tokens
    (argmax when greedy, else sampled from `warp(logits, params)` with
    `generator`). Returned q rows are the warped distributions when sampling
    and the untempered softmax when greedy (informative for adaptive
    verification; the greedy verifier ignores q).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise TypeError(f"{type(model).__name__} is not a causal LM with an output embedding")
        self.model = model.eval()
        self.params = params
        self.generator = generator
        self._cache: Any = None
        self._cached: list[int] = []
        # transformers 5.x renamed `past_key_values` to `cache`; the cache object is updated in place.
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    @property
    def vocab_size(self) -> int:
        """Number of logit rows the draft model produces."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def cached_tokens(self) -> list[int]:
        """Tokens whose keys/values are in the draft cache (for tests and diagnostics)."""
        return list(self._cached)

    def check_compatible(
        self, target_vocab_size: int, target_tokenizer: Any = None, draft_tokenizer: Any = None
    ) -> None:
        """Refuse (ValueError) a target whose vocabulary or tokenizer differs from the draft's."""
        check_vocab_compatible(target_vocab_size, self.vocab_size, target_tokenizer, draft_tokenizer)

    def reset(self) -> None:
        """Drop the draft cache (the next call recomputes the whole context)."""
        self._cache = None
        self._cached = []

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        if self._cache is None:
            self._cache = self._new_cache()
        device = self.model.get_output_embeddings().weight.device
        try:
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=device),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: self._cache},
            )
        except BaseException:
            self.reset()  # a forward that failed midway may have updated only some layers
            raise
        self._cached.extend(ids)
        return out.logits[0, -1].float().cpu()

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        if self.params.greedy:
            return int(torch.argmax(logits)), softmax(logits)
        q = warp(logits, self.params)
        return sample(q, self.generator), q

    @torch.inference_mode()
    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor]:
        """Draft γ tokens after `context` (all committed tokens, maybe plus unverified drafts)."""
        if not isinstance(gamma, int) or gamma < 0:
            raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
        ctx = [int(t) for t in context]
        if not ctx:
            raise ValueError("context must hold at least one token")
        vocab = self.vocab_size
        bad = [t for t in ctx if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"context tokens {bad[:5]} are outside the draft vocabulary [0, {vocab})")
        if gamma == 0:
            return [], torch.zeros(0, vocab)
        lcp = 0
        limit = min(len(self._cached), len(ctx) - 1)  # always feed >= 1 token to get logits
        while lcp < limit and self._cached[lcp] == ctx[lcp]:
            lcp += 1
        if self._cache is not None:
            if lcp == 0:
                self.reset()
            else:
                _crop_cache(self._cache, lcp)
                del self._cached[lcp:]
        logits = self._forward(ctx[lcp:])
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        for j in range(gamma):
            tok, q = self._choose(logits)
            drafts.append(tok)
            rows.append(q)
            if j + 1 < gamma:
                logits = self._forward([tok])
        return drafts, torch.stack(rows)
