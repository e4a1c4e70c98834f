"""Tensor codecs: raw is bit-exact, fp16/bf16 stay within their epsilon, int8 within half a step per block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dsd.protocol import Limits, ProtocolError, WireTensor, decode_tensor, encode_tensor
from dsd.protocol.tensors import bf16_bits_to_f32, f32_to_bf16_bits

torch.set_num_threads(1)
SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def activations(draw: st.DrawFn) -> np.ndarray:
    """Hidden-state-like float32 arrays: normal values, a few outlier channels, some exact zeros."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 200))
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e3]))
    x = rng.standard_normal((rows, cols)) * scale
    outliers = rng.integers(0, cols, size=draw(st.integers(0, 3)))
    x[:, outliers] *= draw(st.floats(1, 200))
    x[rng.random(x.shape) < 0.05] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int8", "int32", "int64", "uint8", "uint64", "bool"])
@pytest.mark.parametrize("zstd", [False, True])
def test_raw_is_bit_exact(dtype: str, zstd: bool) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 7)) * 1000).astype(dtype)
    if dtype == "float32":
        x.reshape(-1)[:3] = [np.float32(1e-45), -0.0, np.nextafter(np.float32(1), np.float32(2))]
    t = encode_tensor(x, "raw", zstd)
    y = decode_tensor(t)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.tobytes() == x.tobytes()
    y[0] = 0  # decoded arrays are writable, not views of the wire bytes


def test_raw_keeps_nan_bits_when_allowed() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    x.view(np.uint32)[0] = 0x7FC01234  # a NaN with a payload
    t = encode_tensor(x, "raw")
    with pytest.raises(ProtocolError) as ei:
        decode_tensor(t)
    assert ei.value.field == "tensor.data" and ei.value.code == "bad_tensor"
    assert decode_tensor(t, allow_nonfinite=True).view(np.uint32).tolist() == x.view(np.uint32).tolist()


FP16_OVERFLOW = 65520.0  # round to nearest: below it a value rounds to fp16's largest, 65504; from it, to inf


def test_fp16_keeps_values_that_round_to_its_largest_and_refuses_those_that_overflow() -> None:
    assert decode_tensor(encode_tensor(np.array([65519.0, -65510.0], np.float32), "fp16")).tolist() == [65504.0, -65504.0]
    with pytest.raises(ProtocolError, match="fp16 range"):
        encode_tensor(np.array([FP16_OVERFLOW], np.float32), "fp16")


@SETTINGS
@given(x=activations(), zstd=st.booleans())
def test_fp16_within_half_ulp(x: np.ndarray, zstd: bool) -> None:
    if np.abs(x).max() >= FP16_OVERFLOW:
        with pytest.raises(ProtocolError, match="fp16 range"):
            encode_tensor(x, "fp16", zstd)
        return
    y = decode_tensor(encode_tensor(x, "fp16", zstd))
    assert y.dtype == np.float32 and y.shape == x.shape
    err = np.abs(y.astype(np.float64) - x)
    # half an ulp of fp16: relative 2**-11 for normals, 2**-25 absolute in the subnormal range
    assert np.all(err <= np.maximum(np.abs(x) * 2.0**-11, 2.0**-25))


@SETTINGS
@given(x=activations(), zstd=st.booleans())
def test_bf16_rounds_to_nearest_even_like_torch(x: np.ndarray, zstd: bool) -> None:
    y = decode_tensor(encode_tensor(x, "bf16", zstd))
    ref = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    assert y.view(np.uint32).tolist() == ref.view(np.uint32).tolist()
    assert np.all(np.abs(y.astype(np.float64) - x) <= np.abs(x) * 2.0**-8)


def test_bf16_ties_go_to_even_and_specials_survive() -> None:
    # 1 + 2**-8 is exactly between bf16 neighbours 1 and 1 + 2**-7: ties to even (1.0);
    # 1 + 3 * 2**-8 is between 1 + 2**-7 (odd) and 1 + 2**-6 (even): goes up.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.inf, -np.inf, np.nan, -0.0, 3.4e38], np.float32)
    y = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert y[0] == 1.0 and y[1] == 1 + 2**-6
    assert y[2] == np.inf and y[3] == -np.inf and np.isnan(y[4])
    assert np.signbit(y[5]) and y[5] == 0
    assert y[6] == np.inf  # rounds past bf16 max, as RNE must
    with pytest.raises(ProtocolError, match="bf16 range"):
        encode_tensor(np.array([3.4e38], np.float32), "bf16")


@SETTINGS
@given(x=activations(), block=st.sampled_from([1, 7, 32, 64, 128, 1000]), scale=st.sampled_from(["fp16", "fp32"]), zstd=st.booleans())
def test_int8_error_at_most_half_a_step_of_its_block(x: np.ndarray, block: int, scale: str, zstd: bool) -> None:
    if scale == "fp16" and np.abs(x).max() / 127 > 65000:
        return
    t = encode_tensor(x, "int8", zstd, block=block, scale_dtype=scale)
    y = decode_tensor(t)
    n = x.size
    nb = -(-n // block)
    raw = zstandard.ZstdDecompressor().decompress(t.data) if zstd else t.data
    sdt = "<f2" if scale == "fp16" else "<f4"
    scales = np.frombuffer(raw, dtype=sdt, count=nb).astype(np.float64)
    assert len(raw) == nb * np.dtype(sdt).itemsize + n
    step = scales[np.arange(n) // block]
    err = np.abs(y.reshape(-1).astype(np.float64) - x.reshape(-1))
    assert np.all(err <= step / 2 * (1 + 1e-6) + 1e-30)
    # the step is the block's absmax / 127, rounded up only as far as the scale dtype needs
    absmax = np.array([np.abs(x.reshape(-1)[i * block : (i + 1) * block]).max() for i in range(nb)])
    assert np.all(scales * 127 >= absmax)
    rel, smallest = (2.0**-10, 2.0**-24) if scale == "fp16" else (2.0**-23, 2.0**-149)
    assert np.all(scales * 127 <= absmax * (1 + rel) + 127 * smallest)


def test_int8_scale_overflow_and_nonfinite_are_refused() -> None:
    with pytest.raises(ProtocolError, match="scale_dtype='fp32'"):
        encode_tensor(np.array([1e7], np.float32), "int8")
    assert decode_tensor(encode_tensor(np.array([1e7], np.float32), "int8", scale_dtype="fp32"))[0] == pytest.approx(1e7, rel=1e-6)
    with pytest.raises(ProtocolError, match="NaN"):
        encode_tensor(np.array([1.0, np.nan], np.float32), "int8")
    with pytest.raises(ProtocolError, match="fp16 range"):
        encode_tensor(np.array([70000.0], np.float32), "fp16")


def test_int8_refuses_hostile_scales() -> None:
    good = encode_tensor(np.ones(4, np.float32), "int8", block=4, scale_dtype="fp32")
    for bad_scale in (np.float32(np.nan), np.float32(-1.0), np.float32(np.inf)):
        data = np.array([bad_scale], "<f4").tobytes() + good.data[4:]
        with pytest.raises(ProtocolError, match="scales"):
            decode_tensor(WireTensor("float32", (4,), "int8", False, data, 4, "fp32"))


def test_lossy_codecs_need_floats_and_unknown_codec_is_named() -> None:
    with pytest.raises(ProtocolError) as ei:
        encode_tensor(np.arange(4), "fp16")
    assert ei.value.field == "dtype"
    with pytest.raises(ProtocolError) as ei:
        encode_tensor(np.ones(4, np.float32), "fp8")
    assert ei.value.field == "codec"
    with pytest.raises(ProtocolError) as ei:
        encode_tensor(np.ones(2, np.complex64), "raw")
    assert ei.value.field == "dtype"


def test_torch_tensors_are_taken_as_data() -> None:
    x = torch.randn(3, 8)
    np.testing.assert_array_equal(decode_tensor(encode_tensor(x, "raw")), x.numpy())
    with pytest.raises(ProtocolError) as ei:
        encode_tensor(x.to(torch.bfloat16), "bf16")
    assert ei.value.field == "dtype"


def test_byte_count_must_match_shape() -> None:
    with pytest.raises(ProtocolError) as ei:
        WireTensor("float32", (2, 3), "raw", False, b"\0" * 23)
    assert ei.value.field == "tensor.data" and "needs 24" in str(ei.value)
    with pytest.raises(ProtocolError, match="needs 12"):
        WireTensor("float32", (2, 3), "fp16", False, b"\0" * 13)
    with pytest.raises(ProtocolError, match="needs 10"):  # 2 fp16 scales (block 4) + 6 int8
        WireTensor("float32", (6,), "int8", False, b"\0" * 15, 4, "fp16")
    # zstd frame whose header states a different size: refused without decompressing
    with pytest.raises(ProtocolError, match="zstd frame holds 20 bytes"):
        WireTensor("float32", (2, 3), "raw", True, zstandard.ZstdCompressor().compress(b"\0" * 20))


def test_zstd_payload_of_wrong_size_or_corrupt_is_refused() -> None:
    for payload in (b"\0" * 20, b"\0" * 28):
        obj = zstandard.ZstdCompressor().compressobj()  # streaming: no content size in the header
        blob = obj.compress(payload) + obj.flush()
        t = WireTensor("float32", (2, 3), "raw", True, blob)
        with pytest.raises(ProtocolError, match="expected 24") as ei:
            decode_tensor(t)
        assert ei.value.code == "bad_tensor"
    good = zstandard.ZstdCompressor().compress(b"\0" * 24)
    for blob in (good + b"junk", good + good, good[:-2]):
        with pytest.raises(ProtocolError):
            decode_tensor(WireTensor("float32", (2, 3), "raw", True, blob))
    with pytest.raises(ProtocolError, match="not a zstd frame"):
        WireTensor("float32", (2, 3), "raw", True, b"garbage")


def test_rank_and_element_limits() -> None:
    with pytest.raises(ProtocolError) as ei:
        encode_tensor(np.zeros((1, 1, 1, 1, 2), np.float32), "raw")
    assert ei.value.field == "tensor.shape" and ei.value.code == "limit"
    t = encode_tensor(np.zeros((10, 10), np.float32), "raw")
    with pytest.raises(ProtocolError) as ei:
        decode_tensor(t, Limits(max_tensor_elements=99))
    assert ei.value.field == "tensor.shape" and ei.value.code == "limit"
    assert decode_tensor(t, Limits(max_tensor_elements=100)).shape == (10, 10)


def test_bool_raw_payload_must_be_zero_or_one() -> None:
    with pytest.raises(ProtocolError, match="bool"):
        decode_tensor(WireTensor("bool", (3,), "raw", False, b"\x00\x01\x02"))
