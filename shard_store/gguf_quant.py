"""A GGUF's own quantized tensors as a `q4k` store's layers: each 4-bit block as it is, without the float detour.

llama.cpp's 4-bit types keep, per block of 32 weights of a row, 4-bit values q, a scale s and an offset o, w = s·q + o:
Q4_K (super-blocks of 256: 6-bit sub-scales sc and sub-mins m times the block's fp16 d and dmin) s = d·sc, o = −dmin·m;
Q4_1 s = d, o = m; Q4_0 s = d, o = −8·d. torch's CPU int4 kernel computes w = (q − 8)·s + zero per group, so each block
becomes a group of 32 with the same q, its s, and zero = o + 8·s, both rounded to bf16 (what the kernel takes). A
layer's linears of wider types (Q5_K, Q6_K, Q8_0, Q5_0, Q5_1) are held int8 per channel from their values, float ones
(F32, F16, BF16) bf16; any other type is refused, naming the tensor and its type, before anything is loaded.

Names and value transforms are transformers' own (its GGUF name map and tensor processor, as `convert` loads a file): a
processor that reorders a tensor's rows (Llama's q and k, which llama.cpp permutes for its rotary layout) reorders the
blocks' rows alike, and every mapped tensor is checked against transformers' dequantization of it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from .errors import StoreError
from .quant import COMPUTE_DTYPE, Q4K_GROUP, pack_nibbles

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

FOUR_BIT = ("Q4_K", "Q4_0", "Q4_1")  # held as they are: int4 groups of 32
WIDER = ("Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1")  # held int8 per channel from their values
FLOATS = ("F32", "F16", "BF16")  # held bf16
BF16_REL = 2.0 ** -8  # bf16 rounds to 8 significant bits: |x − bf16(x)| ≤ 2^-9·|x|, with room to spare


@dataclass
class Q4kPlan:
    """What a GGUF's layers become in a q4k store: per decoder-layer linear (its transformers key), the GGUF tensor
    and its type; counts per type for the store's summary."""

    linears: dict[str, tuple[str, str]] = field(default_factory=dict)  # hf key -> (gguf tensor, type name)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind in self.linears.values():
            out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))


def plan_q4k(path: Path, config: PretrainedConfig) -> Q4kPlan:
    """Each decoder-layer linear of the GGUF at `path` and its tensor type; a StoreError naming every linear whose
    type maps to nothing a q4k store holds."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    to_hf, _, linear_keys = _name_map(config, _architecture(reader))
    plan = Q4kPlan()
    refused = []
    for tensor in reader.tensors:
        key = to_hf.get(tensor.name)
        if key not in linear_keys:
            continue
        kind = tensor.tensor_type.name
        if kind not in (*FOUR_BIT, *WIDER, *FLOATS):
            refused.append(f"{tensor.name} ({kind})")
        plan.linears[key] = (tensor.name, kind)
    if refused:
        raise StoreError(
            f"{path.name}: these tensors' types do not map to q4k weights: {', '.join(refused)}; q4k holds "
            f"{'/'.join(FOUR_BIT)} blocks as int4, {'/'.join(WIDER)} as int8 and {'/'.join(FLOATS)} as bf16 "
            "(convert to a float store and `store quantize --weights int4` instead)")
    return plan


def packed_layers(path: Path, model: PreTrainedModel, plan: Q4kPlan) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Per layer index, per linear (its name inside the layer), what a q4k store takes from the file as it is: a 4-bit
    one's packed values and bf16 scales and zeros; a float one nothing (`quant.stored_tensors` keeps it bf16); a
    wider one is left out (`stored_tensors` holds it int8). `model` is the same file loaded by transformers (to check
    against)."""
    from gguf import GGUFReader

    from .families import adapter_for

    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    _, processor, _ = _name_map(model.config, _architecture(reader))
    adapter = adapter_for(model.config.model_type)
    state = model.state_dict()
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, (name, kind) in plan.linears.items():
        _, index, local = adapter.split_key(key)
        assert index is not None
        linear = local.removesuffix(".weight")
        weight = state[key]
        if kind in FOUR_BIT:
            tensor = by_name[name]
            q, scale, offset = four_bit_blocks(np.asarray(tensor.data), kind, *weight.shape)
            rows = _row_order(processor, name, model.config, weight.shape[0])
            q, scale, offset = q[rows], scale[rows], offset[rows]
            held = int4_group_tensors(q, scale, offset)
            _check_mapped(name, kind, held, weight)
        elif kind in FLOATS:
            held = {}
        else:
            continue
        out.setdefault(index, {})[linear] = held
    return out


def four_bit_blocks(data: np.ndarray, kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [n, k] in 0..15, scale float32 [n, k / 32], offset float32 [n, k / 32]) of a 4-bit tensor's raw
    blocks (one row of bytes per output row): w = scale·q + offset per block of 32 inputs."""
    import gguf.quants as quants

    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if kind == "Q4_K":
        b = blocks.reshape(-1, 144)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = quants.Q4_K.get_scale_min(b[:, 4:16].copy())
        scale, offset = d * sc.astype(np.float32), -dmin * m.astype(np.float32)  # [blocks, 8]
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    else:
        b = blocks.reshape(-1, 18 if kind == "Q4_0" else 20)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        if kind == "Q4_0":
            scale, offset, start = d, -8.0 * d, 2
        else:
            scale, offset, start = d, b[:, 2:4].copy().view(np.float16).astype(np.float32), 4
        qs = b[:, start:].reshape(-1, 1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, k)
    return q, scale.reshape(n, k // Q4K_GROUP), offset.reshape(n, k // Q4K_GROUP)


def int4_group_tensors(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> dict[str, torch.Tensor]:
    """A store's `q4` (nibbles) and `scales_zeros` ([k / 32, n, 2] bf16, zero = offset + 8·scale) of 4-bit blocks."""
    s = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))
    zero = torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32)) + 8.0 * s
    scales_zeros = torch.stack([s, zero], dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)
    return {"q4": pack_nibbles(torch.from_numpy(np.ascontiguousarray(q))), "scales_zeros": scales_zeros}


def _check_mapped(name: str, kind: str, held: dict[str, torch.Tensor], weight: torch.Tensor) -> None:
    """The held groups give transformers' dequantized `weight` up to the bf16 rounding of each scale and zero."""
    from .quant import int4_dequantize

    mine = int4_dequantize(held["q4"], held["scales_zeros"])
    n, k = mine.shape
    s, zero = held["scales_zeros"].to(torch.float32).transpose(0, 1).abs().unbind(-1)  # [n, groups] each
    bound = ((8.0 * s + zero) * BF16_REL + 1e-6).repeat_interleave(Q4K_GROUP, dim=1)
    err = (mine - weight.to(torch.float32)).abs() - bound
    if bool((err > 0).any()):
        row, col = divmod(int(err.argmax()), k)
        raise StoreError(
            f"GGUF tensor {name} ({kind}): its blocks taken as int4 groups give {float(mine[row, col]):.6g} at "
            f"[{row}, {col}] where transformers' loader gives {float(weight[row, col]):.6g}: the loader transforms this "
            "tensor in a way q4k cannot follow (convert to a float store and `store quantize --weights int4`)")


def _row_order(processor: Any, name: str, config: PretrainedConfig, n: int) -> np.ndarray:
    """The order transformers' tensor processor puts a tensor's rows in (identity for most; Llama's q and k are
    un-permuted), found by processing the row indices; a StoreError if it does more than reorder rows."""
    index = np.arange(n, dtype=np.float64).reshape(n, 1)
    result = processor.process(weights=index, name=name, tensor_key_mapping={}, parsed_parameters={"config": {}})
    rows = np.asarray(result.weights).reshape(-1)
    if rows.shape != (n,) or sorted(rows.astype(np.int64).tolist()) != list(range(n)):
        raise StoreError(f"GGUF tensor {name}: transformers' loader changes it beyond reordering its rows; q4k cannot "
                         "hold it as the file has it")
    return rows.astype(np.int64)


def _architecture(reader: Any) -> str:
    return str(reader.fields["general.architecture"].contents())


def _name_map(config: PretrainedConfig, arch: str) -> tuple[dict[str, str], Any, set[str]]:
    """transformers' GGUF tensor name -> model key map, the architecture's tensor processor (as it loads), and the
    model keys of every decoder layer's linear weights."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from .families import adapter_for

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    adapter = adapter_for(config.model_type)
    linears = {f"{name}.weight" for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and adapter.split_key(f"{name}.weight")[0] == "layer"}
    return get_gguf_hf_weights_map(model, processor), processor, linears
