"""Drafters for the head: a model-free n-gram (prompt lookup) drafter, a draft model, and a hybrid of both.

All take the full token context (committed tokens, possibly extended by
still-unverified drafts when the head drafts ahead) and return up to γ draft
tokens plus, for the model drafter, the warped draft distributions q. When
sampling, the model drafter proposes at position pos the Gumbel-max draw
argmax(log q + G_pos) with the verifier's noise (`use_noise`): an exact draw
from q, coupled with the target's own draw at pos. After a rejection the head
simply calls again with the shorter, corrected context: the model drafter keeps the KV cache of
the longest common prefix and crops the rest, so rollback costs nothing.
A draft model may be int8-quantized (`quantize_draft_model`) to draft faster
on a CPU; verification is unchanged, so the output stays the target's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .draft_cache import DraftCache
from .sampling import GumbelNoise, SamplingParams, softmax, warp

if TYPE_CHECKING:
    from .draft_batch import SessionTree

__all__ = [
    "NgramDrafter",
    "ModelDrafter",
    "HybridDrafter",
    "QUANT_MODES",
    "quantize_draft_model",
    "check_quant_device",
    "check_vocab_compatible",
]

QUANT_MODES = ("none", "int8")


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


def _out_features(linear: Any) -> int:
    """Output rows of an nn.Linear or of its dynamic-quantized replacement (whose `weight` is a method)."""
    rows = getattr(linear, "out_features", None)
    return int(rows) if rows is not None else int(linear.weight.shape[0])


def check_quant_device(quant: str, device: torch.device | str | None) -> None:
    """ValueError when `quant` cannot run on `device`: int8 drafting is torch's CPU-only dynamic quantization."""
    dev = torch.device("cpu" if device is None else device)
    if quant == "int8" and dev.type != "cpu":
        raise ValueError(f"--draft-quant int8 is CPU-only (torch dynamic quantization) but the draft would run on {dev}; "
                         "use --draft-quant none there (or --device cpu)")


def quantize_draft_model(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """Apply `quant` ("none" or "int8") to a draft model in place and return it.

    int8 is torch's dynamic quantization (qint8 weights, per output channel;
    activations quantized on the fly) of every nn.Linear, lm_head included. A
    tied lm_head gets its own int8 copy: the input embedding keeps its float32
    weights (checked), so only the draft's logits change, never its inputs.
    A non-float32 model is cast to float32 first (the int8 kernels take float32).
    Activation scales are taken per forward call, so a draft can depend slightly
    on how the context was fed (prefill or token by token): acceptance may
    move, the verified output cannot.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown draft quantization {quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if quant == "none":
        return model
    check_quant_device(quant, model.get_input_embeddings().weight.device)
    engines = set(torch.backends.quantized.supported_engines) - {"none"}
    if not engines:
        raise ValueError(f"this torch build ({torch.__version__}) has no quantized CPU engine for int8 drafting")
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError as exc:
        raise ValueError(f"int8 drafting needs torch.ao.quantization.quantize_dynamic ({exc})") from None
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model.float()
    embedding = model.get_input_embeddings().weight
    with warnings.catch_warnings():
        # torch marks its eager quantization API deprecated (moving to torchao) but it works and is what we need.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*quantize_per_(tensor|channel)")
        quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    kept = model.get_input_embeddings().weight
    if kept is not embedding or kept.dtype != torch.float32:
        raise RuntimeError("int8 quantization changed the draft's input embedding")
    if any(type(m) is torch.nn.Linear for m in model.modules()):
        raise RuntimeError("int8 quantization left some nn.Linear layers of the draft in float")
    return model.eval()


class ModelDrafter:
    """Drafts with a transformers causal LM, keeping its own KV cache across calls (as a token tree).

    `propose(context, γ)` keeps the longest cached prefix of `context`, feeds only
    the new tokens, then drafts γ tokens (argmax when greedy, else the token at
    position pos is argmax(log warp(logits, params) + G_pos) with `noise`, the
    generation's Gumbel noise). `step_many(contexts)` drafts one
    token after each of several contexts in one batched forward (outcome
    pre-drafting); `dists_many(contexts)` returns their next-token distributions
    without choosing (token-tree expansion: the frontier of a tree in one forward);
    `settle(context)` drops every cached branch but that context's.
    Returned q rows are the warped distributions when sampling and the untempered
    softmax when greedy (informative for adaptive verification and for choosing
    outcome branches; the greedy verifier ignores q). With `tree` (a serving head's
    `JointDrafts.session()`) its forwards join every other generation's (`draft_batch.py`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: SamplingParams,
        noise: GumbelNoise | None = None,
        tree: SessionTree | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise TypeError(f"{type(model).__name__} is not a causal LM with an output embedding")
        self.model = model.eval()
        self.params = params
        self.use_noise(GumbelNoise(0) if noise is None else noise)
        self._tree: DraftCache | SessionTree = DraftCache(self.model) if tree is None else tree  # own, or a serving head's shared one

    def use_noise(self, noise: GumbelNoise) -> None:
        """Draw sampled drafts with `noise`: the engine hands over its own, so drafts are coupled with the
        target's draws (same seed) and a position's noise is computed once for both."""
        if not isinstance(noise, GumbelNoise):
            raise TypeError(f"noise must be a GumbelNoise, got {type(noise).__name__}")
        self.noise = noise

    @property
    def vocab_size(self) -> int:
        """Number of logit rows the draft model produces."""
        return _out_features(self.model.get_output_embeddings())

    @property
    def cached_tokens(self) -> list[int]:
        """Tokens whose keys/values are in the draft cache, in cache order (for tests and diagnostics)."""
        return list(self._tree.tokens)

    @property
    def load(self) -> float:
        """What one more drafted row costs the head's other generations, in their tokens (0 drafting alone)."""
        return float(getattr(self._tree, "load", 0.0))

    def emitted(self, tokens: int) -> None:
        """Tell a shared draft tree this generation emitted `tokens` tokens (its rate weighs the others' rows)."""
        told = getattr(self._tree, "emitted", None)
        if told is not None:
            told(tokens)

    def check_compatible(
        self, target_vocab_size: int, target_tokenizer: Any = None, draft_tokenizer: Any = None
    ) -> None:
        """Refuse (ValueError) a target whose vocabulary or tokenizer differs from the draft's."""
        check_vocab_compatible(target_vocab_size, self.vocab_size, target_tokenizer, draft_tokenizer)

    def reset(self) -> None:
        """Drop the draft cache (the next call recomputes the whole context)."""
        self._tree.reset()

    def settle(self, context: Sequence[int]) -> None:
        """Keep only the cached prefix of `context` (drops pre-drafted branches that did not come true)."""
        self._tree.settle([int(t) for t in context])

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        """q of one row: the untempered softmax when greedy, else the warped distribution drafts come from."""
        return softmax(logits) if self.params.greedy else warp(logits, self.params)

    def _choose(self, logits: torch.Tensor, pos: int) -> tuple[int, torch.Tensor]:
        """The draft token at absolute position `pos` and its q row."""
        q = self._dist(logits)
        if self.params.greedy:
            return int(torch.argmax(logits)), q
        return int(torch.argmax(torch.log(q) + self.noise(pos, q.shape[-1]))), q  # as coupled_token, on q

    def _check(self, context: Sequence[int]) -> list[int]:
        ctx = [int(t) for t in context]
        if not ctx:
            raise ValueError("context must hold at least one token")
        vocab = self.vocab_size
        bad = [t for t in ctx if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"context tokens {bad[:5]} are outside the draft vocabulary [0, {vocab})")
        return ctx

    @torch.inference_mode()
    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor]:
        """Draft γ tokens after `context` (all committed tokens, maybe plus unverified drafts)."""
        if not isinstance(gamma, int) or gamma < 0:
            raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
        ctx = self._check(context)
        if gamma == 0:
            return [], torch.zeros(0, self.vocab_size)
        self._tree.settle(ctx[:-1])  # keep the cached prefix; the last token is fed to get logits
        logits = self._tree.extend([ctx])[0]
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        for j in range(gamma):
            tok, q = self._choose(logits, len(ctx) + j)
            drafts.append(tok)
            rows.append(q)
            if j + 1 < gamma:
                logits = self._tree.extend([ctx + drafts])[0]
        return drafts, torch.stack(rows)

    @torch.inference_mode()
    def step_many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[int, torch.Tensor]]:
        """One drafted token (and its q row) after each context, all in one batched forward."""
        ctxs = [self._check(c) for c in contexts]
        logits = self._tree.extend(ctxs)
        return [self._choose(row, len(ctx)) for row, ctx in zip(logits, ctxs, strict=True)]

    @torch.inference_mode()
    def dists_many(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The draft's next-token distribution after each context, q rows [len(contexts), V] as `propose`
        returns them, in one batched forward over the cached token tree (nothing is sampled)."""
        ctxs = [self._check(c) for c in contexts]
        logits = self._tree.extend(ctxs)
        return torch.stack([self._dist(row) for row in logits])


class HybridDrafter:
    """Prompt lookup when the context's tail repeats earlier text, the draft model otherwise.

    Each call takes one source: the n-gram drafter's continuation when its
    lookup matches (an n-gram of at least `ngram.min_ngram` tokens, so at least
    one token to copy), else the model drafter's proposal. Lookup proposals
    return one-hot q rows at the copied tokens: verification and adaptive τ
    treat a one-hot row exactly as they treat q=None (a deterministic draft,
    like `NgramDrafter`), and a window mixing both sources keeps the model's
    real q for the model's tokens. The model drafter needs no resync when the
    lookup served some calls: it compares its cached tokens with every context
    it gets and feeds the tokens it has not seen in one forward.
    """

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter | None = None) -> None:
        if not isinstance(model, ModelDrafter):
            raise TypeError(f"model must be a ModelDrafter, got {type(model).__name__}")
        self.model = model
        self.ngram = ngram if ngram is not None else NgramDrafter(max_ngram=4, min_ngram=3)
        self.ngram_proposals = 0
        self.model_proposals = 0
        self.ngram_tokens = 0
        self.model_tokens = 0

    @property
    def vocab_size(self) -> int:
        """Number of logit rows the draft model produces."""
        return self.model.vocab_size

    @property
    def cached_tokens(self) -> list[int]:
        """Tokens in the draft model's cache."""
        return self.model.cached_tokens

    def check_compatible(
        self, target_vocab_size: int, target_tokenizer: Any = None, draft_tokenizer: Any = None
    ) -> None:
        """Refuse (ValueError) a target whose vocabulary or tokenizer differs from the draft model's."""
        self.model.check_compatible(target_vocab_size, target_tokenizer, draft_tokenizer)

    def settle(self, context: Sequence[int]) -> None:
        """Drop the model's pre-drafted branches but `context`'s."""
        self.model.settle(context)

    def step_many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[int, torch.Tensor]]:
        """One token after each context: the lookup's where it matches (a one-hot q row), else the
        model's, all model contexts in one batched forward."""
        out: list[tuple[int, torch.Tensor] | None] = [None] * len(contexts)
        need: list[int] = []
        for i, ctx in enumerate(contexts):
            copied, _ = self.ngram.propose(ctx, 1)
            if copied and 0 <= copied[0] < self.vocab_size:
                out[i] = (copied[0], torch.zeros(self.vocab_size).index_fill_(0, torch.tensor(copied[:1]), 1.0))
                self.ngram_proposals += 1
                self.ngram_tokens += 1
            else:
                need.append(i)
        if need:
            for i, row in zip(need, self.model.step_many([contexts[i] for i in need]), strict=True):
                out[i] = row
            self.model_proposals += 1
            self.model_tokens += len(need)
        return [row for row in out if row is not None]

    def reset(self) -> None:
        """Drop the draft model's cache (the counts are kept)."""
        self.model.reset()

    def use_noise(self, noise: GumbelNoise) -> None:
        """The draft model's sampled drafts use `noise` (lookup drafts are deterministic)."""
        self.model.use_noise(noise)

    @property
    def load(self) -> float:
        return self.model.load

    def emitted(self, tokens: int) -> None:
        self.model.emitted(tokens)

    def source_counts(self) -> dict[str, int]:
        """How many proposals (calls) and tokens each source supplied, for reports."""
        return {
            "ngram_proposals": self.ngram_proposals,
            "model_proposals": self.model_proposals,
            "ngram_tokens": self.ngram_tokens,
            "model_tokens": self.model_tokens,
        }

    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor]:
        """Up to γ draft tokens after `context` and their q rows [n, V], from one source."""
        if not isinstance(gamma, int) or gamma < 0:
            raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
        copied, _ = self.ngram.propose(context, gamma)
        vocab = self.vocab_size
        if copied:
            bad = [t for t in copied if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"context tokens {bad[:5]} are outside the draft vocabulary [0, {vocab})")
            self.ngram_proposals += 1
            self.ngram_tokens += len(copied)
            q = torch.zeros(len(copied), vocab).scatter_(1, torch.tensor(copied)[:, None], 1.0)
            return copied, q
        drafts, q = self.model.propose(context, gamma)
        if drafts:
            self.model_proposals += 1
            self.model_tokens += len(drafts)
        return drafts, q
