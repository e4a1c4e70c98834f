"""A random-weight model written straight into a q4k store, layer by layer: a real large config served without the
weights (no machine here holds an 8B model in fp32, and none need exist to measure what serving it costs).

Each decoder-layer linear [N, K] is drawn as a GGUF 4-bit tensor would give it: 4-bit values q uniform in 0..15
(`torch.randint` into uint8) and, per group of 32 inputs, a scale s and an offset o = −7.5·s, so w = (q − 7.5)·s has
mean 0 and variance 21.25·s²; s = gain / √(21.25·K) times a uniform factor in [0.5, 1.5] keeps each linear's gain near
one and the residual stream finite through any depth. They become the store's `q4` nibbles and bf16 `scales_zeros`
through `gguf_quant.int4_group_tensors`, the same helper that takes a GGUF's blocks, so the layout is `convert
--weights q4k`'s to the byte. No float tensor of a linear's size is ever made: the largest float per linear is its
[N, K / 32] scales. Norm weights are ones, biases zeros (bf16); the embeddings (std 0.02) and lm_head (std 1/√hidden)
are drawn in bf16 a chunk of rows at a time. A linear the int4 kernel cannot take (N not a multiple of 16, K not of
32) is held int8 per channel, as q4k holds a GGUF's wider tensors: random int8 values and bf16 row scales.

The store has no tokenizer (prompts are token ids) and its manifest names its source as random weights and the seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import StoreError
from .families import adapter_for
from .files import sha256_file
from .gguf_quant import int4_group_tensors
from .manifest import EMBED_FILE, FORMAT_VERSION, HEAD_FILE, Manifest, layer_file
from .quant import COMPUTE_DTYPE, Q4K_GROUP
from .writer import _check_out, _ids, _save_tensors, _staging, _write_manifest

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Progress = Callable[[str, int, int], None]

VALUE_VARIANCE = (16**2 - 1) / 12  # variance of q − 7.5 for q uniform in 0..15
INT8_VARIANCE = 127 * 128 / 3  # variance of q uniform in −127..127
EMBED_STD = 0.02  # transformers' initializer_range for Llama-family models
ROW_CHUNK = 4096  # rows of an embedding drawn in float32 at a time


def random_q4k_linear(out_features: int, in_features: int, generator: torch.Generator,
                      gain: float = 1.0) -> dict[str, torch.Tensor]:
    """A random linear's tensors as a q4k store holds them (`q4` and `scales_zeros`, or int8 `qweight` and
    `scales` where the int4 kernel cannot take its shape), drawn as integers and per-group scales only."""
    n, k = out_features, in_features
    std = gain / math.sqrt(k)
    if n % 16 or k % Q4K_GROUP:
        q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        return {"qweight": q8, "scales": torch.full((n,), std / math.sqrt(INT8_VARIANCE), dtype=COMPUTE_DTYPE)}
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale = torch.empty(n, k // Q4K_GROUP).uniform_(0.5, 1.5, generator=generator) * (std / math.sqrt(VALUE_VARIANCE))
    return int4_group_tensors(q.numpy(), scale.numpy(), (-7.5 * scale).numpy())


def random_q4k_layer(config: PretrainedConfig, index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Decoder layer `index`'s tensors as a q4k store's layer file holds them: every linear random
    (`random_q4k_linear`), its bias zeros, every norm weight ones, all but the packed values bf16. The names come
    from the family's own layer class, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        layer = adapter_for(str(config.model_type)).new_decoder_layer(config, index)
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, module in layer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        held = random_q4k_linear(module.out_features, module.in_features, generator)
        out.update({f"{name}.{key}": value for key, value in held.items()})
        if module.bias is not None:
            out[f"{name}.bias"] = torch.zeros(module.out_features, dtype=COMPUTE_DTYPE)
        done |= {f"{name}.weight", f"{name}.bias"}
    for key, tensor in layer.state_dict().items():
        if key in done:
            continue
        if tensor.dim() != 1:
            raise StoreError(f"{config.model_type}: layer tensor {key} {tuple(tensor.shape)} is neither a linear "
                             "nor a norm weight: a random q4k store holds dense layers of linears and norms")
        out[key] = torch.ones(tensor.shape, dtype=COMPUTE_DTYPE)
    return out


def random_bf16(rows: int, cols: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """A [rows, cols] bf16 tensor of normal values with `std`, drawn `ROW_CHUNK` rows at a time in float32."""
    out = torch.empty(rows, cols, dtype=COMPUTE_DTYPE)
    for start in range(0, rows, ROW_CHUNK):
        end = min(rows, start + ROW_CHUNK)
        out[start:end] = torch.randn(end - start, cols, generator=generator) * std
    return out


def write_random_q4k_store(config: PretrainedConfig, out: str | Path, *, model_id: str, seed: int = 0,
                           overwrite: bool = False, progress: Progress | None = None) -> Manifest:
    """Write a random-weight model of `config` at `out` as a q4k store (bf16, `weights` q4k, every file hashed into
    the manifest), one layer file at a time through the writer's staging directory: what `Store(out)` opens,
    verifies, and serves as a store converted from a GGUF with `convert --weights q4k`. Same seed, same bytes."""
    family = str(config.model_type)
    adapter = adapter_for(family)
    adapter.check_config(config)
    out = Path(out)
    _check_out(out, overwrite)
    num_layers, hidden, vocab = int(config.num_hidden_layers), int(config.hidden_size), int(config.vocab_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    total = num_layers + 2
    with _staging(out) as staging:
        files: dict[str, dict[str, Any]] = {}

        def save(relpath: str, tensors: dict[str, torch.Tensor], done: int) -> None:
            path = staging / relpath
            _save_tensors(path, tensors)
            files[relpath] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            if progress is not None:
                progress("weights", done, total)

        for i in range(num_layers):
            save(layer_file(i), random_q4k_layer(config, i, torch.Generator().manual_seed((seed << 20) + i)), i + 1)
        heads = torch.Generator().manual_seed((seed << 20) + num_layers)
        save(EMBED_FILE, {"embed_tokens.weight": random_bf16(vocab, hidden, EMBED_STD, heads)}, num_layers + 1)
        head = {"norm.weight": torch.ones(hidden, dtype=COMPUTE_DTYPE)}
        if not tied:
            head["lm_head.weight"] = random_bf16(vocab, hidden, 1 / math.sqrt(hidden), heads)
        save(HEAD_FILE, head, total)
        stored = json.loads(config.to_json_string(use_diff=False))
        stored.pop("_name_or_path", None)
        stored["dtype"] = "bfloat16"
        manifest = Manifest(
            format_version=FORMAT_VERSION, model_id=model_id, family=family, config=stored, num_layers=num_layers,
            hidden_size=hidden, vocab_size=vocab, dtype="bfloat16", files=files, tied_embeddings=tied,
            source=f"random q4k weights (seed {seed})", weights="q4k",
            eos_token_ids=sorted(i for i in _ids(getattr(config, "eos_token_id", None)) if i < vocab),
        )
        _write_manifest(manifest, staging)
    return manifest
