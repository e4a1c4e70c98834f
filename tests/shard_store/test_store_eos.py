"""Generation ends on every id the model ends on: the generation config's list (kept in the manifest at
convert time), the tokenizer's eos and end-of-text tokens, and the chat template's end of turn."""

from __future__ import annotations

from pathlib import Path

from support.models import make_tiny_model, tiny_tokenizer

from dsd.node.head.setup import chat_end_of_turn, eos_ids
from dsd.shard_store import Store, convert

CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _store(tmp_path: Path, generation_eos: list[int] | None, tokenizer=None) -> Store:
    model = make_tiny_model("qwen2", layers=2, vocab_size=320)  # room for added special tokens
    if generation_eos is not None:
        model.generation_config.eos_token_id = generation_eos
    model.save_pretrained(tmp_path / "hf")
    (tokenizer or tiny_tokenizer()).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", model_id="tiny-eos")
    return Store(tmp_path / "store")


def test_two_generation_eos_ids_are_kept_and_used(tmp_path: Path) -> None:
    store = _store(tmp_path, [2, 7])
    assert {2, 7} <= set(store.manifest.eos_token_ids)  # the generation config lists both
    assert {2, 7} <= eos_ids(store.load_tokenizer(), store.manifest)


def test_end_of_text_and_chat_end_of_turn_tokens_end_generation(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.chat_template = CHAT
    store = _store(tmp_path, None, tok)
    loaded = store.load_tokenizer()
    im_end, endoftext = loaded.convert_tokens_to_ids("<|im_end|>"), loaded.convert_tokens_to_ids("<|endoftext|>")
    assert chat_end_of_turn(loaded) == {im_end}
    assert {im_end, endoftext} <= set(store.manifest.eos_token_ids)  # known end-of-text specials, at convert time
    assert {2, im_end, endoftext} <= eos_ids(loaded, store.manifest)
    assert loaded.convert_tokens_to_ids("<|im_start|>") not in eos_ids(loaded, store.manifest)
