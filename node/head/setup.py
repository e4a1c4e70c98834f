"""What the head holds locally: the target's ends, its tokenizer, the drafter, end-of-sequence ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsd.shard_store import HeadModule, Store

from .drafters import ModelDrafter, NgramDrafter
from .engine import Drafter
from .sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class HeadSetup:
    """What the head holds locally: the target's ends (None for a federated server), its identity and a drafter."""

    head: HeadModule | None
    model_id: str
    num_layers: int
    drafter: Drafter | None
    vocab_size: int = 0


def load_drafter(draft: str | None, params: SamplingParams, seed: int, *, vocab_size: int, tokenizer: Any) -> Drafter | None:
    """`ngram`, a draft-model store path, or None (no drafting); a draft with another vocabulary is refused."""
    if not draft:
        return None
    if draft == "ngram":
        return NgramDrafter()
    dstore = Store(Path(draft))
    drafter = ModelDrafter(dstore.load_full(), params, torch.Generator().manual_seed(seed + 1))
    drafter.check_compatible(vocab_size, tokenizer, dstore.load_tokenizer())
    return drafter


def load_head_setup(
    target_store: Path, draft: str | None, params: SamplingParams, seed: int, *, load_head: bool = True
) -> tuple[HeadSetup, Any]:
    """The target's ends (unless `load_head` is False), its tokenizer and the drafter."""
    store = Store(target_store)
    tokenizer = store.load_tokenizer()
    head = store.load_head() if load_head else None
    vocab_size = int(head.vocab_size) if head is not None else int(store.manifest.vocab_size)
    drafter = load_drafter(draft, params, seed, vocab_size=vocab_size, tokenizer=tokenizer)
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
        msgs = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer(text)["input_ids"])


def eos_ids(tokenizer, store_config: dict) -> frozenset[int]:
    ids = store_config.get("eos_token_id")
    out = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return frozenset(int(i) for i in out)
