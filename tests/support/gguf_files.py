"""Write a tiny model of any supported family as an F32 GGUF the way llama.cpp's converter
(convert_hf_to_gguf.py) does, so that transformers' own GGUF loader reads it back.

Tensor names come from transformers itself (`get_gguf_hf_weights_map`, which asks gguf's
`TensorNameMap`), and each value transform is the inverse of the `TENSOR_PROCESSORS` entry that
undoes it on load: llama.cpp permutes Llama q/k rows for its rotary layout, stores Gemma's norms
as 1 + w, and stacks MoE experts into `ffn_{gate,up,down}_exps`. The metadata mirrors what
llama.cpp's converter writes per architecture (`_llama_cpp_keys`), plus the few quirks its
converter leaves out written under their standard gguf keys (`_stated_quirks`), so that a file
states everything its model computes with and a converter can see what a loader would drop.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

# llama.cpp's converter writes Mistral and Mixtral (MistralForCausalLM, MixtralForCausalLM) as "llama".
GGUF_ARCH = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
}


def write_tiny_gguf(model: torch.nn.Module, path: Path, tokenizer: Any = None, *, name: str | None = None,
                    types: dict[str, str] | None = None) -> None:
    """Write `model` (and optionally its byte-level BPE `tokenizer`) as an F32 GGUF at `path`; `types` stores each
    tensor whose name contains a key in that GGML type instead (Q4_K by `q4_k_blocks`, Q4_0/Q4_1/Q8_0 by gguf's own
    quantizer, any other type as random bytes of the right size: a file only `plan_q4k` reads)."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    tensors = gguf_tensors(model, arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or f"tiny {cfg.model_type}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in {**_llama_cpp_keys(cfg, arch), **_stated_quirks(cfg, arch)}.items():
        _add(writer, f"{arch}.{key}", value)
    if tokenizer is not None:
        write_tokenizer(writer, tokenizer)
    for tensor_name, array in tensors.items():
        kind = next((t for key, t in (types or {}).items() if key in tensor_name and array.ndim == 2), None)
        if kind is None:
            writer.add_tensor(tensor_name, array)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(tensor_name, quantized_blocks(array, kind), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_q4k_gguf(path: Path, *, layers: int = 4, seed: int = 5) -> Path:
    """A tiny Qwen2 (hidden 256: whole Q4_K super-blocks) with a tokenizer as a GGUF whose linears hold Q4_K, Q4_0 and
    Q8_0 blocks, as a Q4_K_M file's do: what `convert --weights q4k` and `models prepare` take. Returns `path`."""
    from .models import make_tiny_model, tiny_tokenizer

    model = make_tiny_model("qwen2", layers=layers, hidden_size=256, intermediate_size=256, seed=seed)
    write_tiny_gguf(model, path, tiny_tokenizer(),
                    types={"attn_q": "Q4_K", "attn_k": "Q4_0", "ffn_": "Q4_K", "attn_v": "Q8_0"})
    return path


def quantized_blocks(array: np.ndarray, kind: str) -> np.ndarray:
    """A float [n, k] array as the raw bytes of GGML type `kind` ([n, bytes per row])."""
    import gguf

    if kind == "Q4_K":
        return q4_k_blocks(array)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize(array.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(array.shape[0], array.shape[1] // block * size), dtype=np.uint8)


def q4_k_blocks(array: np.ndarray) -> np.ndarray:
    """A float [n, k] array (k a multiple of 256) as Q4_K blocks, laid out as llama.cpp's block_q4_K (fp16 d and
    dmin, twelve bytes of 6-bit sub-scales and sub-mins, 128 bytes of nibbles): min-max per sub-block of 32,
    w ≈ d·sc·q − dmin·m (gguf reads it back; it has no Q4_K quantizer of its own)."""
    x = array.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(axis=-1), 0.0), np.maximum(x.max(axis=-1), 0.0)
    scale, mins = (hi - lo) / 15.0, -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = np.maximum(d.astype(np.float32), 1e-8), np.maximum(dmin.astype(np.float32), 1e-8)
    sc = np.clip(np.round(scale / df[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dminf[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((x + offset[..., None]) / np.maximum(step, 1e-8)[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = q.reshape(-1, 4, 2, 32)
    nibbles = (qs[:, :, 0, :] | (qs[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, nibbles],
                            axis=1)
    return blocks.reshape(array.shape[0], -1)


def _add(writer: Any, key: str, value: Any) -> None:
    """Add one metadata value with the type llama.cpp uses for it (u32 counts, f32 reals, bool arrays)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _rope(cfg: Any, kind: str = "full_attention") -> dict[str, Any]:
    """The rope parameters of one attention kind (Gemma 3 keeps one dict per kind)."""
    params = dict(cfg.rope_parameters or {})
    return dict(params[kind]) if kind in params else params


def _head_dim(cfg: Any) -> int:
    """The per-head width the model computes with."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _llama_cpp_keys(cfg: Any, arch: str) -> dict[str, Any]:
    """The `<arch>.*` keys llama.cpp's converter writes for this model (TextModel.set_gguf_parameters and
    the per-architecture overrides of LlamaModel, Qwen2MoeModel, Phi3MiniModel, Gemma2Model, Gemma3Model)."""
    rope = _rope(cfg)
    keys: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        # llama.cpp writes it for "llama" only (elsewhere the token list's length says it); a file without a
        # tokenizer needs it, and transformers reads it for every architecture
        "vocab_size": cfg.vocab_size,
    }
    if getattr(cfg, "head_dim", None):  # only when config.json states it
        keys["attention.key_length"] = keys["attention.value_length"] = int(cfg.head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        keys["expert_count"] = int(experts)
        keys["expert_used_count"] = int(cfg.num_experts_per_tok)
    if arch == "llama":
        keys["rope.dimension_count"] = _head_dim(cfg)
    elif arch == "qwen3moe":
        keys["expert_feed_forward_length"] = int(cfg.moe_intermediate_size)
    elif arch == "phi3":
        keys["rope.scaling.original_context_length"] = int(cfg.original_max_position_embeddings)
        factor = float(rope.get("partial_rotary_factor", 1.0))
        keys["rope.dimension_count"] = int(factor * cfg.hidden_size) // cfg.num_attention_heads
        keys["attention.sliding_window"] = int(cfg.sliding_window or 0)  # 0: none (Phi-4)
    elif arch == "gemma2":
        del keys["rope.freq_base"]  # Gemma2Model writes no rope base: llama.cpp assumes 10000
        keys["attention.key_length"] = keys["attention.value_length"] = int(cfg.head_dim)
        keys["attn_logit_softcapping"] = float(cfg.attn_logit_softcapping)
        keys["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
        keys["attention.sliding_window"] = int(cfg.sliding_window)
    elif arch == "gemma3":
        if cfg.final_logit_softcapping:
            keys["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
        if cfg.sliding_window:
            keys["attention.sliding_window"] = int(cfg.sliding_window)
    return keys


def _stated_quirks(cfg: Any, arch: str) -> dict[str, Any]:
    """Quirks llama.cpp's converter does not write, under the standard gguf keys that carry them: a
    Mistral's sliding window (written as plain "llama"), Gemma 2's rope base, Gemma 3's local rope base and
    layer pattern (llama.cpp hard-codes 10000 and every sixth layer global). Without them the file would
    silently describe another model; with them a loader that ignores the key can be caught."""
    keys: dict[str, Any] = {}
    if arch == "llama" and getattr(cfg, "sliding_window", None):
        keys["attention.sliding_window"] = int(cfg.sliding_window)
    if arch == "gemma2":
        keys["rope.freq_base"] = float(_rope(cfg)["rope_theta"])
    if arch == "gemma3":
        keys["rope.freq_base_swa"] = float(_rope(cfg, "sliding_attention")["rope_theta"])
        keys["attention.sliding_window_pattern"] = [k == "sliding_attention" for k in cfg.layer_types]
    return keys


def gguf_tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, transformed the way llama.cpp stores them."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    cfg = model.config
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={})
    to_gguf: dict[str, str] = {}
    for gguf_name, hf_name in get_gguf_hf_weights_map(model, processor, model_type=arch).items():
        to_gguf.setdefault(hf_name, gguf_name)
    tensors: dict[str, np.ndarray] = {}
    for key, tensor in model.state_dict().items():
        value = tensor.detach().float()
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensors.update(_expert_stacks(gguf, key, value))
            continue
        if key not in to_gguf:
            raise ValueError(f"{cfg.model_type}: llama.cpp's {arch!r} architecture has no tensor for {key}")
        name = to_gguf[key]
        name = name if name.endswith((".weight", ".bias")) else f"{name}.weight"
        tensors[name] = _as_stored(cfg, arch, name, value).numpy()
    rope = _rope(cfg)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        tensors[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = _llama3_rope_factors(cfg, rope)
    return tensors


def _as_stored(cfg: Any, arch: str, name: str, value: torch.Tensor) -> torch.Tensor:
    """The inverse of transformers' tensor processor for `arch`: what llama.cpp stores for `value`."""
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
        return _permute(value, heads)
    if arch in ("gemma2", "gemma3") and "norm.weight" in name:
        return value + 1  # Gemma's RMSNorm scales by (1 + w); llama.cpp stores 1 + w
    return value


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: interleave each head's two rotary halves (undone on load)."""
    shape = weights.shape
    return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _expert_stacks(gguf: Any, key: str, value: torch.Tensor) -> dict[str, np.ndarray]:
    """A layer's stacked experts as llama.cpp's ffn_{gate,up,down}_exps: gate_up [E, 2I, H] splits into its
    gate and up halves (Qwen2MoeTensorProcessor puts them back side by side), down [E, H, I] stays."""
    bid = int(key.split(".")[2])

    def name(tensor: Any) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"

    if key.endswith("down_proj"):
        return {name(gguf.MODEL_TENSOR.FFN_DOWN_EXP): value.numpy()}
    gate, up = value.chunk(2, dim=1)
    return {
        name(gguf.MODEL_TENSOR.FFN_GATE_EXP): gate.contiguous().numpy(),
        name(gguf.MODEL_TENSOR.FFN_UP_EXP): up.contiguous().numpy(),
    }


def _llama3_rope_factors(cfg: Any, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: Llama 3 rope scaling as per-frequency divisors."""
    dim = _head_dim(cfg)
    base = float(rope["rope_theta"])
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_tokenizer(writer: Any, tokenizer: Any) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model (tokens, types, merges, special ids)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    added = {a["id"]: a["content"] for a in spec["added_tokens"]}
    tokens = [""] * len(tokenizer)
    for text, i in spec["model"]["vocab"].items():
        tokens[i] = text
    for i, text in added.items():
        tokens[i] = text
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")  # the pre-tokenizer llama.cpp names for a plain byte-level split
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])  # 3: control, 1: normal
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
