"""Weight formats of a span: float (fp32, bf16, fp16) or weight-only quantized (int8, int4) linears.

A quantized span keeps every `nn.Linear` of its decoder layers as packed integer weights with scales and computes
in bfloat16 (norms, biases, attention and activations stay bf16): torch's CPU kernels are fast only with bf16
activations (measured on a 2-core Xeon: one row through a layer's seven projections 0.25× fp32's time, fed fp32 3–37×
slower than fp32 itself).

- `int8`: per output channel symmetric, q = round(w / s) in [-127, 127], s = max|w| / 127 per row;
  `torch._weight_int8pack_mm` (x [M, K] bf16, q [N, K] int8, s [N] bf16).
- `int4`: group-wise asymmetric over `INT4_GROUP` (128) consecutive inputs of a row (the largest of 128, 64, 32
  that divides the row; a row it cannot split stays bf16), q = round((w − min) / s) in [0, 15], s = (max − min) / 15,
  w ≈ (q − 8)·s + zero with zero = min + 8·s; `torch._weight_int4pack_mm_for_cpu` (packed with
  `_convert_weight_to_int4pack_for_cpu`, inner k tiles 2; it needs N a multiple of 16, else the linear stays bf16).

- `q4k`: a GGUF's own 4-bit tensors taken as they are (`gguf_quant.py`, `dsd-node convert --weights q4k`): each
  Q4_K / Q4_0 / Q4_1 block of 32 weights becomes an int4 group of 32 with that block's scale and zero (rounded to
  bf16, which the kernel takes), its 5-, 6- and 8-bit tensors (Q5_K, Q6_K, Q8_0, …) int8 per channel; no float
  detour and no second rounding of the 4-bit weights. Only a GGUF gives it: a float store cannot.

Quantizing is deterministic: the same float weights give the same packed weights, so a span of a route and the same
layers run whole in one process compute the same numbers. Embeddings, the final norm and lm_head (the head's) stay
in the head's float dtype. The packed kernels are CPU kernels: another device gets a clear error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "q4k")
FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANT_FORMATS = ("int8", "int4", "q4k")
Q4K_GROUP = 32  # a GGUF 4-bit block's weights per scale (and zero)
INT4_GROUP = 128
INT4_GROUPS = (128, 64, 32)  # group sizes tried in order: the first that divides a row's inputs
INT4_TILES = 2
COMPUTE_DTYPE = torch.bfloat16  # what a quantized span computes in
Q4K_ONLY_FROM_GGUF = ("q4k weights are a GGUF's own 4-bit tensors, which a float store no longer has: write a q4k store "
                      "with `dsd-node convert --weights q4k FILE.gguf OUT` and serve it, or serve int4 from this one")


class WeightFormatError(ValueError):
    """An unknown weight format, or one this machine has no kernel for."""


def check_weights(fmt: str, device: torch.device | str | None = None) -> str:
    """`fmt` if it is a known format that runs on `device` (quantized: the CPU only), else WeightFormatError."""
    if fmt not in WEIGHT_FORMATS:
        raise WeightFormatError(f"unknown weight format {fmt!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    if fmt in QUANT_FORMATS:
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type != "cpu":
            raise WeightFormatError(
                f"--weights {fmt} runs on torch's CPU kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu); "
                f"this span is on {dev}: serve bf16 or fp16 there")
        ops = {"int8": ("_weight_int8pack_mm",), "int4": ("_weight_int4pack_mm_for_cpu",)}.get(
            fmt, ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu"))
        for op in ops:
            if not hasattr(torch.ops.aten, op):
                raise WeightFormatError(f"--weights {fmt}: this torch ({torch.__version__}) has no aten.{op}")
    return fmt


def bytes_per_weight(fmt: str) -> float:
    """What one weight of a layer costs held in `fmt` (int8: a byte and its row's bf16 scale amortized; int4: half a
    byte and a bf16 scale and zero per group of 128; q4k: per group of 32, and its 6-bit tensors, a sixth of a layer's
    weights in a Q4_K_M file, a byte); norms and biases, a few in a thousand, are counted alike."""
    q4k = (5 * (0.5 + 4 / Q4K_GROUP) + 1.0) / 6
    return {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0 + 2 / 1536, "int4": 0.5 + 4 / INT4_GROUP,
            "q4k": q4k}[check_weights(fmt)]


def compute_dtype(fmt: str) -> torch.dtype:
    """The dtype a span of weight format `fmt` computes in."""
    return FLOAT_FORMATS.get(check_weights(fmt), COMPUTE_DTYPE)


def format_of_dtype(dtype: torch.dtype) -> str:
    """The float weight format of a dtype (fp32 for anything unknown)."""
    return next((name for name, dt in FLOAT_FORMATS.items() if dt == dtype), "fp32")


QUANT_ROWS = 4096  # rows of a float weight quantized to int8 at a time


def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales bf16 [N]) of a float weight [N, K]: per output channel, symmetric, `QUANT_ROWS` rows
    at a time (each row is its own: the same bytes as the whole at once, without float32 copies of all of it: an
    8B model's bf16 lm_head, 128256 rows, took 2 GB per copy and a head 9.4 GB at its peak)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=COMPUTE_DTYPE)
    for start in range(0, w.shape[0], QUANT_ROWS):
        rows = w[start:start + QUANT_ROWS].detach().to(torch.float32)
        scale = (rows.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q[start:start + QUANT_ROWS] = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
        scales[start:start + QUANT_ROWS] = scale.to(COMPUTE_DTYPE)
    return q, scales


def int4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in 0..15, scales and zeros bf16 [K / group, N, 2]) of a float weight [N, K]: per group of
    `group` inputs, asymmetric (w ≈ (q − 8)·s + zero)."""
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8.0 * scale
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, K] (K even) as bytes [N, K / 2], column 2j in the low nibble: how a store holds them."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def int4_dequantize(q4: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a store's 4-bit values (nibbles [N, K / 2]) and bf16 scales and zeros
    [K / group, N, 2] stand for: (q − 8)·s + zero per group, as the kernel computes it."""
    q = unpack_nibbles(q4).to(torch.float32)
    scale, zero = scales_zeros.to(torch.float32).transpose(0, 1).unbind(-1)
    group = q.shape[1] // scale.shape[1]
    return (q - 8.0) * scale.repeat_interleave(group, 1) + zero.repeat_interleave(group, 1)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` undone: int32 [N, 2·K']."""
    b = b.to(torch.int32)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (per output channel scales); bf16 in and out."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        # copies: a store's tensors are memory-mapped at any byte offset, and the kernel's vector loads need the
        # allocator's alignment (a misaligned bf16 scale vector crashes it)
        self.register_buffer("qweight", qweight.to(torch.int8).clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", scales.to(COMPUTE_DTYPE).clone(memory_format=torch.contiguous_format))
        self.register_buffer("bias", None if bias is None else bias.to(COMPUTE_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*int8_quantize(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous(), self.qweight,
                                      self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """An embedding table held as int8 rows with a bf16 scale each (the rows of an int8 lm_head, which a tied model
    shares); a looked-up row is its values times its scale, rounded to bf16 once."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].to(torch.float32) * self.scales[ids].to(torch.float32)[..., None]
        return rows.to(COMPUTE_DTYPE)


def int8_head(embed: nn.Embedding, lm_head: nn.Linear, tied: bool) -> tuple[Int8Embedding, Int8Linear]:
    """A head's embeddings and lm_head as int8 rows (per row scales): the logits come from the row-invariant int8
    kernel, so a window's rows get the logits one-row steps get, at a quarter of fp32's bytes; tied, one matrix."""
    q, s = int8_quantize(embed.weight)
    out = Int8Linear(q, s)
    emb = Int8Embedding(out.qweight, out.scales)
    if not tied:
        out = Int8Linear(*int8_quantize(lm_head.weight))
    return emb, out


def int4_group(in_features: int, out_features: int) -> int | None:
    """The int4 group size for a [out, in] weight, or None when the kernel cannot take it (stays bf16)."""
    if out_features % 16:
        return None
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


REPACK_ROWS = 512  # rows of a store's nibbles unpacked for the kernel at a time (a multiple of its row blocks)


def int4_kernel_layout(q4: torch.Tensor) -> torch.Tensor:
    """A store's nibbles [N, K / 2] (`pack_nibbles`) in the CPU kernel's packed layout, `REPACK_ROWS` rows at a time,
    unpacked in uint8 and widened to the int32 the kernel takes only then: the kernel packs blocks of rows on their
    own, so the result is the whole tensor's to the bit, without `unpack_nibbles`' int32 copy of all of it (an
    8B model's MLP linear: 0.5 GB at the peak and 10× the time)."""
    blocks = []
    for b in q4.split(REPACK_ROWS):
        q = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1).to(torch.int32)
        blocks.append(torch._convert_weight_to_int4pack_for_cpu(q, INT4_TILES))
    return torch.cat(blocks)


class Int4Linear(nn.Module):
    """A linear layer with 4-bit weights (group-wise scales and zeros); bf16 in and out. Holds the kernel's packed
    layout only (`q`, 0..15 [N, K], is packed at construction; with `nibbles`, `q` is a store's [N, K / 2] bytes)."""

    def __init__(self, q: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None = None, *,
                 nibbles: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = int(q.shape[0]), int(q.shape[1]) * (2 if nibbles else 1)
        self.group = self.in_features // int(scales_zeros.shape[0])
        self.register_buffer("qweight", int4_kernel_layout(q.to(torch.uint8)) if nibbles else
                             torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INT4_TILES))
        self.register_buffer("scales_zeros", scales_zeros.to(COMPUTE_DTYPE).clone(memory_format=torch.contiguous_format))
        self.register_buffer("bias", None if bias is None else bias.to(COMPUTE_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int) -> Int4Linear:
        return cls(*int4_quantize(linear.weight, group), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous(), self.qweight, self.group,
            self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_linears(module: nn.Module, fmt: str) -> list[str]:
    """Replace every `nn.Linear` inside `module` by its `fmt` (int8 | int4) form, then cast what is left (norms,
    the linears int4 cannot take) to bf16; returns the names of the linears kept in bf16."""
    check_weights(fmt)
    if fmt == "q4k":
        raise WeightFormatError(Q4K_ONLY_FROM_GGUF)
    if fmt not in QUANT_FORMATS:
        raise WeightFormatError(f"quantize_linears takes int8 or int4, not {fmt!r}")
    kept: list[str] = []
    for name, child in list(_linears(module)):
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        if fmt == "int8":
            setattr(parent, attr, Int8Linear.from_linear(child))
            continue
        group = int4_group(child.in_features, child.out_features)
        if group is None:
            kept.append(name)
            continue
        setattr(parent, attr, Int4Linear.from_linear(child, group))
    for p in module.parameters():  # norms, biases of layers kept wide, anything but the packed weights
        p.data = p.data.to(COMPUTE_DTYPE)
    return kept


def _linears(module: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def held_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer a module holds (what its weights cost in memory)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def stored_tensors(layer: nn.Module, fmt: str,
                   packed: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """A float layer's tensors as a quantized store holds them in `fmt`: per linear `NAME.qweight` (int8) or
    `NAME.q4` (4-bit values two to a byte, `pack_nibbles`) with `NAME.scales` / `NAME.scales_zeros` and its bias,
    every other tensor (norms, linears int4 cannot take) in bf16 under its own name. `packed` (q4k): per linear, the
    tensors a GGUF gave as they are (`gguf_quant.py`; empty: kept bf16); a q4k linear it lacks is held int8."""
    check_weights(fmt)
    if fmt not in QUANT_FORMATS:
        raise WeightFormatError(f"a quantized store holds {', '.join(QUANT_FORMATS)}, not {fmt!r}")
    if fmt == "q4k" and packed is None:
        raise WeightFormatError(Q4K_ONLY_FROM_GGUF)
    packed = packed or {}
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, lin in _linears(layer):
        group = int4_group(lin.in_features, lin.out_features) if fmt == "int4" else None
        if name in packed:
            if not packed[name]:
                continue
            out.update({f"{name}.{key}": value for key, value in packed[name].items()})
        elif fmt in ("int8", "q4k"):
            out[f"{name}.qweight"], out[f"{name}.scales"] = int8_quantize(lin.weight)
        elif group is not None:
            q, out[f"{name}.scales_zeros"] = int4_quantize(lin.weight, group)
            out[f"{name}.q4"] = pack_nibbles(q)
        else:
            continue
        if lin.bias is not None:
            out[f"{name}.bias"] = lin.bias.detach().to(COMPUTE_DTYPE)
        done |= {f"{name}.weight", f"{name}.bias"}
    for key, tensor in layer.state_dict().items():
        if key not in done:
            out[key] = tensor.detach().to(COMPUTE_DTYPE)
    return {k: v.contiguous() for k, v in out.items()}


def load_stored(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Fill a layer built on the meta device from a quantized store's tensors (`stored_tensors`): its linears
    become Int8Linear / Int4Linear, the rest is assigned in bf16. Returns what the tensors lacked (empty: whole)."""
    tensors = dict(tensors)
    for name, _ in _linears(layer):
        bias = _own(tensors.pop(f"{name}.bias", None))
        if f"{name}.qweight" in tensors:
            module: nn.Module = Int8Linear(tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scales"), bias)
        elif f"{name}.q4" in tensors:
            module = Int4Linear(tensors.pop(f"{name}.q4"), tensors.pop(f"{name}.scales_zeros"), bias, nibbles=True)
        else:
            if bias is not None:
                tensors[f"{name}.bias"] = bias
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, module)
    layer.to(COMPUTE_DTYPE)
    owned = {key: _own(tensor) for key, tensor in tensors.items()}
    missing, unexpected = layer.load_state_dict(owned, strict=False, assign=True)
    left = [n for n, p in layer.named_parameters() if p.is_meta]
    return sorted(set(left) | set(unexpected))


def _own(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A copy in bf16 of a store file's tensor: a view would keep the whole memory-mapped file mapped, its pages
    read while packing resident (an 8B model's 8-layer span: 1.1 GB more RSS for a few norms and biases)."""
    return None if tensor is None else tensor.to(COMPUTE_DTYPE).clone(memory_format=torch.contiguous_format)


def float_tensors(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A quantized store's layer file (`stored_tensors`) as the float layer it holds, in `dtype`: each packed linear's
    values times its scales (int4: `(q - 8)·s + zero` per group) as `NAME.weight`, every other tensor cast. For a
    model that quantizes itself again (an int8 draft from a q4k store), never for a route's spans."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key.endswith(".qweight"):
            name = key[: -len(".qweight")]
            out[f"{name}.weight"] = (tensor.to(torch.float32) * tensors[f"{name}.scales"].to(torch.float32)[:, None])
        elif key.endswith(".q4"):
            name = key[: -len(".q4")]
            out[f"{name}.weight"] = int4_dequantize(tensor, tensors[f"{name}.scales_zeros"])
        elif not key.endswith((".scales", ".scales_zeros")):
            out[key] = tensor
    return {key: tensor.to(dtype) for key, tensor in out.items()}
