"""What the head holds locally: the target's ends, its tokenizer, the drafter, end-of-sequence ids."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsd.shard_store import HeadModule, Manifest, Store
from dsd.shard_store.writer import tokenizer_end_ids

from .draft_batch import JointDrafts
from .drafters import (
    QUANT_MODES,
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    check_quant_device,
    quantize_draft_model,
)
from .engine import Drafter
from .sampling import GumbelNoise, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class HeadSetup:
    """What the head holds locally: the target's ends (None for a federated server), its identity and a drafter."""

    head: HeadModule | None
    model_id: str
    num_layers: int
    drafter: Drafter | None
    vocab_size: int = 0


DRAFT_HELP = "ngram, a draft model STORE, or STORE+ngram (also ngram+STORE: prompt lookup when it matches, the model otherwise)"


def parse_draft(draft: str) -> tuple[str | None, bool]:
    """(draft model store or None, whether prompt lookup is used) of a `--draft` value; ValueError if malformed."""
    if draft == "ngram":
        return None, True
    store, ngram = draft, False
    if draft.endswith("+ngram"):
        store, ngram = draft[: -len("+ngram")], True
    elif draft.startswith("ngram+"):
        store, ngram = draft[len("ngram+") :], True
    if not store or store == "ngram" or store.startswith("ngram+") or store.endswith("+ngram"):
        raise ValueError(f"--draft must be one of: {DRAFT_HELP}; got {draft!r}")
    if not ngram and "+" in draft and not Path(draft).exists():
        raise ValueError(f"--draft must be one of: {DRAFT_HELP}; got {draft!r} (no such store)")
    return store, ngram


def load_drafter(
    draft: str | None, params: SamplingParams, seed: int, *, vocab_size: int, tokenizer: Any, quant: str = "none",
    device: torch.device | None = None, dtype: torch.dtype | None = None,
) -> Drafter | None:
    """The drafter a `--draft` value names (see `parse_draft`), or None (no drafting).

    The draft model loads on `device` in `dtype` (default: the CPU, its store's dtype). `quant`
    ("none" or "int8") is applied to it after loading: int8 is CPU-only and computes in float32,
    so it loads the draft in float32 whatever `dtype` says. A quantized draft store (q4k: the draft GGUF's
    own blocks) is held as it is and computes in bf16 on the packed kernels, whatever `dtype` says; with int8
    its stored weights are dequantized to float32 first and quantized again (on this CPU torch's dynamic int8
    steps faster than the packed kernels: bench/draft_formats.py). A draft with another vocabulary is refused.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown draft quantization {quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if not draft:
        return None
    store, ngram = parse_draft(draft)
    if store is None:
        if quant != "none":
            raise ValueError(f"draft quantization {quant} needs a draft model store; ngram has no model")
        return NgramDrafter()
    check_quant_device(quant, device)
    dstore = Store(Path(store))
    if dstore.manifest.weights and quant == "none":
        model = dstore.load_full(device=device)
    else:
        floats = torch.float32 if quant == "int8" else dtype
        model = quantize_draft_model(dstore.load_full(device=device, dtype=floats, dequantize=quant == "int8"), quant)
    drafter = ModelDrafter(model, params, GumbelNoise(seed))
    drafter.check_compatible(vocab_size, tokenizer, dstore.load_tokenizer())
    return HybridDrafter(drafter) if ngram else drafter


def request_drafter(drafter: Drafter | None, params: SamplingParams, seed: int,
                    joint: JointDrafts | None = None) -> Drafter | None:
    """A drafter like `drafter` for one more generation: its own sampling settings, Gumbel noise (the
    generation's seed: the engine hands over its own noise object too) and draft cache, the loaded draft
    model's weights shared. A long-lived head (`dsd-node serve`) loads the draft once and runs concurrent
    generations with different settings; the stateless n-gram drafter is shared as is. With `joint` the
    generation's cache is its part of the head's one shared tree, its forwards joined with the others'."""
    tree = None if joint is None else joint.session()
    if isinstance(drafter, HybridDrafter):
        return HybridDrafter(ModelDrafter(drafter.model.model, params, GumbelNoise(seed), tree), drafter.ngram)
    if isinstance(drafter, ModelDrafter):
        return ModelDrafter(drafter.model, params, GumbelNoise(seed), tree)
    return drafter


def draft_model(drafter: Drafter | None) -> torch.nn.Module | None:
    """The draft model a drafter runs (None: model-free, the n-gram drafter)."""
    if isinstance(drafter, HybridDrafter):
        return drafter.model.model
    return drafter.model if isinstance(drafter, ModelDrafter) else None


def load_head_setup(
    target_store: Path, draft: str | None, params: SamplingParams, seed: int, *, load_head: bool = True,
    quant: str = "none", device: torch.device | None = None, dtype: torch.dtype | None = None,
    weights: str | None = None,
) -> tuple[HeadSetup, Any]:
    """The target's ends (unless `load_head` is False), its tokenizer and the drafter (its model quantized by
    `quant`), on `device` in compute `dtype` (default: the CPU, each store's dtype; see
    `dsd.shard_store.devices.resolve_placement` for the `--device` / `--dtype` options); `weights` is the route's
    format (a quantized one gives the head int8 ends: `Store.load_head`)."""
    store = Store(target_store)
    tokenizer = store.load_tokenizer()
    head = store.load_head(device=device, dtype=dtype, weights=weights) if load_head else None
    vocab_size = int(head.vocab_size) if head is not None else int(store.manifest.vocab_size)
    drafter = load_drafter(draft, params, seed, vocab_size=vocab_size, tokenizer=tokenizer, quant=quant,
                           device=device, dtype=dtype)
    setup = HeadSetup(head=head, model_id=store.manifest.model_id, num_layers=int(store.manifest.num_layers),
                      drafter=drafter, vocab_size=vocab_size)
    return setup, tokenizer


class PromptError(ValueError):
    """A prompt that cannot be turned into token ids (bad ids, no tokenizer for text)."""


def encode_prompt(tokenizer: Any, *, text: str | None = None, ids: str | None = None, chat: bool = False) -> list[int]:
    """Token ids of a prompt given as text (optionally in the chat template) or as comma-separated ids."""
    if ids is not None:
        try:
            return [int(x) for x in ids.split(",") if x.strip()]
        except ValueError:
            raise PromptError("--prompt-ids must be comma-separated integers") from None
    if tokenizer is None:
        raise PromptError("this store has no tokenizer; use --prompt-ids")
    if chat:
        return chat_ids(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, ready for the assistant's turn; the `tools`
    (OpenAI function definitions) rendered as the template shows them — PromptError if it does not."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template")
    ids = list(tokenizer.apply_chat_template(messages, tools=list(tools) or None, add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    if tools and ids == chat_ids(tokenizer, messages):
        raise PromptError("this model's chat template does not show tools to the model")
    return ids


def chat_end_of_turn(tokenizer: Any) -> set[int]:
    """The special token the chat template puts right after an assistant turn (e.g. <|im_end|>), if any."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return set()
    marker = "dsdmarker"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # templates can refuse such a conversation; then there is nothing to add
        return set()
    after = text[text.rfind(marker) + len(marker):]
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    special |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    first = next((tok for tok in sorted(special, key=len, reverse=True) if tok and after.lstrip().startswith(tok)), None)
    return {int(tokenizer.convert_tokens_to_ids(first))} if first else set()


def eos_ids(tokenizer: Any, manifest: Manifest) -> frozenset[int]:
    """Every token id that ends generation: the store's (its generation config's list, kept at convert
    time), the config's eos, the tokenizer's eos and end-of-text tokens, and the chat template's end of turn."""
    ids = set(manifest.eos_token_ids) | _config_ids(manifest.config.get("eos_token_id"))
    ids |= tokenizer_end_ids(tokenizer) | chat_end_of_turn(tokenizer)
    return frozenset(i for i in ids if 0 <= i < manifest.vocab_size)


def _config_ids(value: Any) -> set[int]:
    values = value if isinstance(value, list) else [value] if value is not None else []
    return {int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)}
