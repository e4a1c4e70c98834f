"""Tiny random Llama / Qwen2 causal LMs built in the test (no downloads), a tiny byte-level BPE tokenizer, and
the references: transformers' greedy output, a noisy copy of a model (a draft that often disagrees)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

TINY_VOCAB = 300


TINY_HIDDEN = 64


TINY_LAYERS = 5


TINY_SEED = 0


_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
] * 20


def tiny_config(family: str, *, layers: int = TINY_LAYERS, tie: bool | None = None, **overrides: object):
    """A tiny config of `family` ("llama" or "qwen2"): GQA (4 heads, 2 KV), rope_theta 12345,
    init range 0.2 so logits are O(1). Qwen2 has attention bias and tied embeddings by default
    (like Qwen2.5-Coder), Llama untied."""
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, object] = dict(
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        rope_theta=12345.0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        common["tie_word_embeddings"] = False if tie is None else tie
        common.update(overrides)
        return LlamaConfig(**common)
    if family == "qwen2":
        common["tie_word_embeddings"] = True if tie is None else tie
        common.update(overrides)
        return Qwen2Config(**common)
    raise ValueError(f"no tiny config for family {family!r}")


def tiny_tokenizer():
    """A byte-level BPE tokenizer (<= TINY_VOCAB ids, specials <pad>=0 <s>=1 </s>=2) trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def make_tiny_model(family: str, *, seed: int = TINY_SEED, layers: int = TINY_LAYERS, **overrides: object):
    """A tiny random causal LM of `family` in eval mode, deterministic for a given seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, layers=layers, **overrides)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_tiny_model(family: str, folder: Path, *, with_tokenizer: bool = True, **kwargs: object) -> Path:
    """Build a tiny model (see make_tiny_model) and save it as an HF folder, optionally with a tokenizer."""
    model = make_tiny_model(family, **kwargs)
    model.save_pretrained(folder)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return folder


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_chat_model(root: Path, model_id: str) -> Path:
    """The tiny Qwen2 (seed 0) with `CHAT_TEMPLATE` in its tokenizer, as an HF folder `root/hf` and a store
    `root/store` of `model_id`: what a service test serves."""
    from dsd.shard_store import convert

    hf = save_tiny_model("qwen2", root / "hf")
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(hf)
    convert(hf, root / "store", model_id=model_id)
    return root


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: `n` greedy tokens of an HF causal LM after `prompt` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def noisy_copy(model: torch.nn.Module, noise: float, seed: int = 0) -> torch.nn.Module:
    """The target with Gaussian noise (`noise` × each tensor's std) on its decoder layers: a draft that
    agrees with the target often but not always, and whose misses are often its 2nd or 3rd choice."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if ".layers." in name:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return out.eval()
