"""Tiny random causal LMs of every supported family built in the test (no downloads), a tiny byte-level BPE tokenizer, and
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


# Each family's tiny config turns its quirks on, so a family's test exercises them: Llama 3 rope scaling
# (its low-frequency band bent at original_max_position_embeddings 16) and tied embeddings; Mistral's sliding
# window on every layer (6 < a test's prompt + generation); Qwen3's q/k norms with a head_dim that is not
# hidden/heads; Gemma 2's embedding scale, attention and final-logit soft caps, alternating sliding/global
# layers and pre/post norms; Gemma 3's sliding/global pattern with a local rope base; Phi-3's fused qkv and
# gate_up with partial rotary; Mixtral's and Qwen3-MoE's experts (4, two per token; Qwen3-MoE with a dense
# first layer).
FAMILY_QUIRKS: dict[str, dict[str, object]] = {
    "llama": {"tie_word_embeddings": False},
    "llama3": {
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 12345.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    },
    "qwen2": {"tie_word_embeddings": True},
    "qwen2-sliding": {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 6},
    "mistral-full": {"tie_word_embeddings": False, "sliding_window": None},
    "qwen3": {"tie_word_embeddings": True, "head_dim": 24},
    "gemma2": {
        "initializer_range": 0.02,  # embeddings are scaled by sqrt(hidden) = 8: 0.2 makes every output one token
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma3_text": {
        "initializer_range": 0.02,
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 12345.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    },
    "phi3": {"tie_word_embeddings": False, "partial_rotary_factor": 0.5, "pad_token_id": 0},
    "mixtral": {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "mlp_only_layers": [0], "norm_topk_prob": True,
    },
}
"""Tiny-config overrides per test family name; "llama3", "mistral-full" and "qwen2-sliding" (layers from the
third on slide) are variants of llama, mistral and qwen2."""


def family_of(name: str) -> str:
    """The model_type of a test family name ("llama3" -> "llama", "mistral-full" -> "mistral")."""
    return {"llama3": "llama", "mistral-full": "mistral", "qwen2-sliding": "qwen2"}.get(name, name)


def tiny_config(family: str, *, layers: int = TINY_LAYERS, tie: bool | None = None, **overrides: object):
    """A tiny config of a test family (see FAMILY_QUIRKS) from transformers' AutoConfig: GQA (4 heads, 2 KV),
    rope_theta 12345, init range 0.2 so logits are O(1). Qwen2 has attention bias and tied embeddings by
    default (like Qwen2.5-Coder), Llama untied."""
    from transformers import AutoConfig

    if family not in FAMILY_QUIRKS:
        raise ValueError(f"no tiny config for family {family!r}")
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
    common.update(FAMILY_QUIRKS[family])
    if "rope_parameters" in common:
        common.pop("rope_theta")
    if tie is not None:
        common["tie_word_embeddings"] = tie
    if isinstance(common.get("layer_types"), list):
        common["layer_types"] = list(common["layer_types"])[:layers]  # type: ignore[index]
    common.update(overrides)
    return AutoConfig.for_model(family_of(family), **common)


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
    """A tiny random causal LM of a test family in eval mode, deterministic for a given seed, with the
    attention kernel the store picks for the family (eager where logits are soft-capped)."""
    from transformers import AutoModelForCausalLM

    from dsd.shard_store.families import adapter_for

    torch.manual_seed(seed)
    config = tiny_config(family, layers=layers, **overrides)
    config._attn_implementation = adapter_for(config.model_type).attn_implementation(config)
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
