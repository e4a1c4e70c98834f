"""Tensor codecs for the wire: raw (exact), fp16, bf16 and blockwise int8, each optionally zstd-compressed.

A `WireTensor` carries dtype, shape and codec with the bytes, so a decoder can check
the byte count against the shape before it builds an array, and bound zstd output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from .checks import check_bytes, check_ident, check_int, check_map, check_seq
from .errors import BAD_TENSOR, LIMIT, ProtocolError
from .limits import DEFAULT_LIMITS, Limits

# Little-endian numpy type per wire dtype name.
DTYPES: dict[str, str] = {
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "int8": "|i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "|u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "bool": "|b1",
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
CODECS = ("raw", "fp16", "bf16", "int8")
SCALE_DTYPES = {"fp16": "<f2", "fp32": "<f4"}
_CHUNK = 1 << 20  # zstd output is read in pieces this big, so memory follows real output


@dataclass(frozen=True)
class WireTensor:
    """An encoded tensor: `dtype` of the source array, `shape`, `codec`, `zstd` flag, payload `data`.

    int8 payloads are the per-block scales (`scale_dtype`, one per `block` elements of the
    flattened tensor) followed by one int8 per element.
    """

    dtype: str
    shape: tuple[int, ...]
    codec: str
    zstd: bool
    data: bytes
    block: int | None = None
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shape, list):
            object.__setattr__(self, "shape", tuple(self.shape))
        if isinstance(self.data, bytearray | memoryview):
            object.__setattr__(self, "data", bytes(self.data))
        if self.codec == "int8" and self.scale_dtype is None:
            object.__setattr__(self, "scale_dtype", "fp16")
        self.validate(DEFAULT_LIMITS)

    @property
    def numel(self) -> int:
        """Number of elements the shape describes."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def payload_bytes(self) -> int:
        """Size of the uncompressed payload that the shape, dtype and codec imply."""
        n = self.numel
        if self.codec == "raw":
            return n * np.dtype(DTYPES[self.dtype]).itemsize
        if self.codec in ("fp16", "bf16"):
            return 2 * n
        assert self.block is not None and self.scale_dtype is not None
        return -(-n // self.block) * np.dtype(SCALE_DTYPES[self.scale_dtype]).itemsize + n

    def validate(self, limits: Limits, field: str = "tensor") -> None:
        """Check every field against `limits` (no payload decoding, only header-level zstd checks)."""
        check_ident(self.dtype, f"{field}.dtype")
        if self.dtype not in DTYPES:
            raise ProtocolError(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})", f"{field}.dtype")
        check_ident(self.codec, f"{field}.codec")
        if self.codec not in CODECS:
            raise ProtocolError(f"unknown codec {self.codec!r} (known: {', '.join(CODECS)})", f"{field}.codec")
        if not isinstance(self.zstd, bool):
            raise ProtocolError(f"must be a bool, got {type(self.zstd).__name__}", f"{field}.zstd")
        shape = check_seq(self.shape, f"{field}.shape", limits.max_rank)
        if not isinstance(self.shape, tuple):
            raise ProtocolError("must be a tuple", f"{field}.shape")
        n = 1
        for i, d in enumerate(shape):
            n *= check_int(d, f"{field}.shape[{i}]", 0, limits.max_tensor_elements)
            if n > limits.max_tensor_elements:
                raise ProtocolError(
                    f"{n}+ elements exceed max_tensor_elements {limits.max_tensor_elements}", f"{field}.shape", LIMIT
                )
        if self.codec != "raw" and self.dtype not in FLOAT_DTYPES:
            raise ProtocolError(f"codec {self.codec!r} needs a float dtype, got {self.dtype!r}", f"{field}.dtype")
        if self.codec == "int8":
            check_int(self.block, f"{field}.block", 1, limits.max_tensor_elements)
            if not isinstance(self.scale_dtype, str) or self.scale_dtype not in SCALE_DTYPES:
                raise ProtocolError(f"must be 'fp16' or 'fp32', got {self.scale_dtype!r}", f"{field}.scale_dtype")
        else:
            if self.block is not None:
                raise ProtocolError(f"only int8 has a block size (codec {self.codec!r})", f"{field}.block")
            if self.scale_dtype is not None:
                raise ProtocolError(f"only int8 has scales (codec {self.codec!r})", f"{field}.scale_dtype")
        check_bytes(self.data, f"{field}.data", limits.max_frame_bytes)
        expected = self.payload_bytes
        if not self.zstd:
            if len(self.data) != expected:
                raise ProtocolError(
                    f"{len(self.data)} bytes, but shape {list(self.shape)} with codec {self.codec} needs {expected}",
                    f"{field}.data",
                    BAD_TENSOR,
                )
            return
        try:
            size = zstandard.frame_content_size(self.data)
        except (zstandard.ZstdError, ValueError, TypeError) as exc:
            raise ProtocolError(f"not a zstd frame ({exc})", f"{field}.data", BAD_TENSOR) from None
        if size != -1 and size != expected:
            raise ProtocolError(
                f"zstd frame holds {size} bytes, but shape {list(self.shape)} with codec {self.codec} needs {expected}",
                f"{field}.data",
                BAD_TENSOR,
            )

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map of this tensor."""
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "codec": self.codec,
            "zstd": self.zstd,
            "data": self.data,
        }
        if self.codec == "int8":
            out["block"] = self.block
            out["scale"] = self.scale_dtype
        return out

    @classmethod
    def from_wire(cls, raw: object, limits: Limits, field: str = "tensor") -> WireTensor:
        """Build from a decoded msgpack map, validating against `limits`; unknown keys are ignored."""
        m = check_map(raw, field)
        values = {}
        for key in ("dtype", "shape", "codec", "zstd", "data"):
            if key not in m:
                raise ProtocolError("missing", f"{field}.{key}")
            values[key] = m[key]
        shape = values["shape"]
        values["shape"] = tuple(shape) if isinstance(shape, list) else shape
        values["block"] = m.get("block")
        values["scale_dtype"] = m.get("scale")
        obj = object.__new__(cls)
        for key, value in values.items():
            object.__setattr__(obj, key, value)
        obj.validate(limits, field)
        return obj


def _float_source(array: np.ndarray, codec: str) -> np.ndarray:
    if array.dtype.name not in FLOAT_DTYPES:
        raise ProtocolError(f"codec {codec!r} needs a float array, got {array.dtype.name}", "dtype", BAD_TENSOR)
    return array


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even; NaN stays a quiet NaN."""
    u = np.asarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
    nan = np.isnan(u.view(np.float32))
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    if nan.any():
        rounded = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16).reshape(np.shape(x))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _split_blocks(flat: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole blocks of a flat array as a [blocks, block] view, and the shorter tail block."""
    full = flat.size // block
    return flat[: full * block].reshape(full, block), flat[full * block :]


def _blockwise(flat: np.ndarray, block: int, fn: Any) -> np.ndarray:
    """Apply `fn(values [b, block], block_index_slice)` to whole blocks and the tail; memory stays O(n)."""
    body, tail = _split_blocks(flat, block)
    out = fn(body, slice(0, body.shape[0]))
    if tail.size:
        out = np.concatenate([out.reshape(-1), fn(tail[None, :], slice(body.shape[0], body.shape[0] + 1)).reshape(-1)])
    return out.reshape(-1)


def int8_scales(flat: np.ndarray, block: int, scale_dtype: str) -> np.ndarray:
    """Per-block absmax/127 scales, rounded up in `scale_dtype` so no element needs clipping."""
    absmax = _blockwise(np.abs(flat), block, lambda v, _: v.max(axis=1, initial=0.0))
    st = np.dtype(SCALE_DTYPES[scale_dtype])
    with np.errstate(over="ignore"):
        scales = (absmax / 127.0).astype(st)
    if not np.all(np.isfinite(scales)):
        raise ProtocolError(
            f"a block's absmax {absmax.max():.3g} overflows {scale_dtype} scales; use scale_dtype='fp32'",
            "scale_dtype",
            BAD_TENSOR,
        )
    short = scales.astype(np.float64) * 127.0 < absmax
    if short.any():
        scales = np.where(short, np.nextafter(scales, st.type(np.inf)), scales).astype(st)
    return scales


def encode_tensor(
    array: Any,
    codec: str = "fp16",
    zstd: bool = False,
    block: int = 64,
    scale_dtype: str = "fp16",
    *,
    level: int = 3,
) -> WireTensor:
    """Encode an array (numpy, or anything `np.asarray` takes) with `codec`, optionally zstd level `level`."""
    if codec not in CODECS:
        raise ProtocolError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})", "codec")
    try:
        a = np.asarray(array)
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a bfloat16 torch tensor
        raise ProtocolError(f"cannot view {type(array).__name__} as a numpy array ({exc})", "dtype") from None
    if a.dtype.name not in DTYPES:
        raise ProtocolError(f"unsupported dtype {a.dtype} (supported: {', '.join(DTYPES)})", "dtype", BAD_TENSOR)
    wblock: int | None = None
    wscale: str | None = None
    if codec == "raw":
        data = a.astype(DTYPES[a.dtype.name]).tobytes()
    elif codec == "fp16":
        src = _float_source(a, codec)
        with np.errstate(over="ignore"):
            half = src.astype("<f2")
        if not np.array_equal(np.isfinite(half), np.isfinite(src)):
            raise ProtocolError("values beyond fp16 range (65504); use bf16 or raw", "data", BAD_TENSOR)
        data = half.tobytes()
    elif codec == "bf16":
        src = _float_source(a, codec)
        with np.errstate(over="ignore"):
            f32 = src.astype(np.float32)
        bits = f32_to_bf16_bits(f32)
        if not np.array_equal(np.isfinite(bf16_bits_to_f32(bits)), np.isfinite(src)):
            raise ProtocolError("values beyond bf16 range; use raw", "data", BAD_TENSOR)
        data = bits.astype("<u2").tobytes()
    else:
        src = _float_source(a, codec)
        check_int(block, "block", 1, DEFAULT_LIMITS.max_tensor_elements)
        if not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPES:
            raise ProtocolError(f"must be 'fp16' or 'fp32', got {scale_dtype!r}", "scale_dtype")
        flat = src.reshape(-1).astype(np.float64)
        if not np.all(np.isfinite(flat)):
            raise ProtocolError("int8 cannot carry NaN or inf; use raw", "data", BAD_TENSOR)
        scales = int8_scales(flat, block, scale_dtype)
        s64 = scales.astype(np.float64)
        safe = np.where(s64 > 0, s64, 1.0)
        q = _blockwise(flat, block, lambda v, i: np.rint(v / safe[i, None]))
        q = np.clip(q, -127, 127).astype(np.int8)
        data = scales.astype(SCALE_DTYPES[scale_dtype]).tobytes() + q.tobytes()
        wblock, wscale = block, scale_dtype
    if zstd:
        data = zstandard.ZstdCompressor(level=level).compress(data)
    return WireTensor(a.dtype.name, tuple(int(d) for d in a.shape), codec, bool(zstd), data, wblock, wscale)


# The codec that carries a compute dtype's values exactly: half precision travels in half the bytes.
LOSSLESS_CODECS: dict[str, str] = {"float32": "raw", "bfloat16": "bf16", "float16": "fp16"}


def codec_for_dtype(dtype: str) -> str:
    """The hidden-state codec of compute dtype `dtype` ("float32", "bfloat16", "float16"): lossless for
    values computed in it; raw for anything else."""
    return LOSSLESS_CODECS.get(dtype, "raw")


@dataclass(frozen=True)
class WireFormat:
    """How a peer puts hidden states on the wire; raw fp32 is exact (DSD's lossless default).

    codec "auto" stands for the codec of the compute dtype (`for_dtype` resolves it before use).
    """

    codec: str = "raw"
    zstd: bool = False

    def for_dtype(self, dtype: str) -> WireFormat:
        """This format with codec "auto" replaced by `codec_for_dtype(dtype)`; any other codec is kept."""
        return WireFormat(codec_for_dtype(dtype), self.zstd) if self.codec == "auto" else self

    def encode(self, array: np.ndarray) -> WireTensor:
        if self.codec == "auto":
            raise ProtocolError("codec 'auto' must be resolved with WireFormat.for_dtype before encoding", "codec")
        return encode_tensor(array, codec=self.codec, zstd=self.zstd)


def _bounded_decompress(blob: bytes, expected: int, field: str) -> bytes:
    """Decompress a zstd payload that must hold exactly `expected` bytes, never reading past that."""
    parts: list[bytes] = []
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True) as reader:
            while got <= expected:
                chunk = reader.read(min(_CHUNK, expected + 1 - got))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"corrupt zstd payload ({exc})", field, BAD_TENSOR) from None
    if got != expected:
        more = "more than " if got > expected else ""
        raise ProtocolError(f"zstd payload holds {more}{got} bytes, expected {expected}", field, BAD_TENSOR)
    return b"".join(parts)


def decode_tensor(t: WireTensor, limits: Limits = DEFAULT_LIMITS, allow_nonfinite: bool = False) -> np.ndarray:
    """Decode to a writable array: float32 for fp16/bf16/int8, the source dtype for raw.

    NaN/inf is a ProtocolError unless `allow_nonfinite`.
    """
    if not isinstance(t, WireTensor):
        raise ProtocolError(f"must be a WireTensor, got {type(t).__name__}", "tensor")
    t.validate(limits)
    expected = t.payload_bytes
    data = _bounded_decompress(t.data, expected, "tensor.data") if t.zstd else t.data
    n = t.numel
    if t.codec == "raw":
        raw = np.frombuffer(data, dtype=DTYPES[t.dtype], count=n)
        if t.dtype == "bool" and np.any(raw.view(np.uint8) > 1):
            raise ProtocolError("bool tensor holds bytes other than 0 and 1", "tensor.data", BAD_TENSOR)
        out = raw.astype(np.dtype(DTYPES[t.dtype]).newbyteorder("="))
    elif t.codec == "fp16":
        out = np.frombuffer(data, dtype="<f2", count=n).astype(np.float32)
    elif t.codec == "bf16":
        out = bf16_bits_to_f32(np.frombuffer(data, dtype="<u2", count=n))
    else:
        assert t.block is not None and t.scale_dtype is not None
        nb = -(-n // t.block)
        sdt = np.dtype(SCALE_DTYPES[t.scale_dtype])
        scales = np.frombuffer(data, dtype=sdt, count=nb).astype(np.float32)
        if not (np.all(np.isfinite(scales)) and np.all(scales >= 0)):
            raise ProtocolError("int8 scales must be finite and >= 0", "tensor.data", BAD_TENSOR)
        q = np.frombuffer(data, dtype=np.int8, count=n, offset=nb * sdt.itemsize)
        out = _blockwise(q, t.block, lambda v, i: v.astype(np.float32) * scales[i, None])
    if not allow_nonfinite and out.dtype.kind == "f" and not np.all(np.isfinite(out)):
        raise ProtocolError("tensor holds NaN or inf", "tensor.data", BAD_TENSOR)
    return out.reshape(t.shape)
