"""Quantized spans: int8 / int4 linears against their own dequantized weights, a span's weight format and bytes, a
split quantized model equal to the same model whole, and clear errors for what cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dsd.shard_store import Store
from dsd.shard_store.quant import (
    Int4Linear,
    Int8Linear,
    WeightFormatError,
    check_weights,
    held_bytes,
    int4_group,
    quantize_linears,
)


def linear(n: int, k: int, seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    layer.weight.data.normal_(0, 0.05)
    return layer


def test_int8_rows_are_its_dequantized_weights_times_the_input() -> None:
    lin = linear(48, 64)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(5, 64)
    deq = q.qweight.float() * q.scales.float()[:, None]
    want = x.bfloat16().float() @ deq.T + lin.bias.bfloat16().float()
    got = q(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    step = lin.weight.abs().amax(1, keepdim=True) / 127
    assert ((deq - lin.weight).abs() <= step * (0.5 + 127 / 256)).all()  # half a step, and the bf16 scale's rounding
    assert torch.allclose(q(x[None]).float()[0], got.float())  # any leading shape


def test_int4_rows_are_its_dequantized_weights_times_the_input_and_groups_fit_the_kernel() -> None:
    lin = linear(32, 256, bias=False)
    assert int4_group(256, 32) == 128 and int4_group(96, 32) == 32 and int4_group(64, 40) is None
    q = Int4Linear.from_linear(lin, 128)
    x = torch.randn(3, 256)
    g = lin.weight.reshape(32, 2, 128)
    step = ((g.amax(-1) - g.amin(-1)) / 15).max()
    got = q(x).float()
    dense = x.bfloat16().float() @ lin.weight.T
    assert (got - dense).abs().max() < 256 * step * x.abs().max() / 2  # within half a step per weight
    assert not torch.allclose(got, dense, atol=1e-4)  # it is 4-bit: not the float layer


def test_a_span_in_each_format_holds_fewer_bytes_and_stays_close_to_fp32(tiny_qwen2_store: Path) -> None:
    store = Store(tiny_qwen2_store)
    fp32 = store.load_span(0, 5)
    x = torch.randn(1, 6, fp32.hidden_size, generator=torch.Generator().manual_seed(1))
    want = fp32.step(x, 0, fp32.new_cache())
    sizes = {"fp32": held_bytes(fp32)}
    for fmt, tol in (("bf16", 0.05), ("int8", 0.1), ("int4", 0.9)):
        span = store.load_span(0, 5, weights=fmt)
        assert span.weights == fmt and span.dtype == torch.bfloat16
        sizes[fmt] = held_bytes(span)
        got = span.step(x, 0, span.new_cache()).float()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < tol, (fmt, rel)  # a random tiny model (unrelated outputs: ~1.4); the kernels are checked above, the real pair in bench/quant.py
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"] < sizes["fp32"], sizes
    assert store.load_span(0, 5, weights="fp16").weights == "fp16" and fp32.weights == "fp32"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_model_split_in_spans_computes_what_it_computes_whole(tiny_qwen2_store: Path, fmt: str) -> None:
    """Packing is deterministic: spans 0:2 and 2:5, a sub-span, and 0:5 whole give the same numbers, bit for bit."""
    store = Store(tiny_qwen2_store)
    whole = store.load_span(0, 5, weights=fmt)
    first, second = store.load_span(0, 2, weights=fmt), store.load_span(2, 5, weights=fmt)
    x = torch.randn(1, 7, whole.hidden_size)
    cw, c1, c2 = whole.new_cache(), first.new_cache(), second.new_cache()
    for start, rows in ((0, x[:, :5]), (5, x[:, 5:])):  # a prompt, then a window on the caches
        a = whole.step(rows, start, cw)
        b = second.step(first.step(rows, start, c1), start, c2)
        assert torch.equal(a, b), (fmt, start)
    sub = whole.sub(2, 5)
    assert sub.weights == fmt and torch.equal(sub.step(x, 0, sub.new_cache()), second.step(x, 0, second.new_cache()))


def test_what_cannot_run_is_refused_by_name(tiny_qwen2_store: Path) -> None:
    with pytest.raises(WeightFormatError, match="unknown weight format 'int3'.*fp32, bf16, fp16, int8, int4"):
        check_weights("int3")
    with pytest.raises(WeightFormatError, match="CPU kernels.*cuda"):
        check_weights("int4", "cuda")
    assert check_weights("bf16", "cuda") == "bf16"
    with pytest.raises(WeightFormatError, match="int8 or int4"):
        quantize_linears(nn.Sequential(nn.Linear(4, 4)), "bf16")
    from dsd.shard_store.errors import StoreError

    with pytest.raises(StoreError, match="computes in torch.bfloat16"):
        Store(tiny_qwen2_store).load_span(0, 2, weights="int8", dtype="float32")


def test_the_command_line_refuses_a_format_it_cannot_serve_in_one_line(tiny_qwen2_store: Path, tmp_path: Path) -> None:
    from support.processes import cli

    key = tmp_path / "k.key"
    start = ["start", "--store", str(tiny_qwen2_store), "--identity", str(key)]
    out = cli(*start, "--weights", "int8", "--dtype", "float32", timeout=60)
    assert out.returncode != 0 and "--weights int8 computes in bfloat16, not --dtype float32" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = cli(*start, "--weights", "nf4", timeout=60)
    assert out.returncode != 0 and "invalid choice: 'nf4'" in out.stderr, out.stderr
    out = cli(*start, "--weights", "int4", "--federated", timeout=60)
    assert out.returncode != 0 and "a federated worker serves the whole model in a float format" in out.stderr


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_store_holds_the_packed_bytes_and_serves_what_quantizing_at_load_serves(
        tiny_qwen2_store: Path, tmp_path: Path, fmt: str) -> None:
    from support.processes import cli

    from dsd.shard_store.errors import StoreError

    out = tmp_path / f"tiny-{fmt}"
    done = cli("store", "quantize", str(tiny_qwen2_store), str(out), "--weights", fmt, "--json", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = __import__("json").loads(done.stdout)
    src, q = Store(tiny_qwen2_store), Store(out)
    assert summary["weights"] == fmt and q.manifest.weights == fmt and q.manifest.dtype == "bfloat16"
    assert summary["layer_bytes"] < src.summary()["layer_bytes"] * (0.4 if fmt == "int8" else 0.3), summary
    assert q.verify() == []  # every file hashed into the manifest, as any store's
    x = torch.randn(1, 6, q.manifest.hidden_size, generator=torch.Generator().manual_seed(2))
    stored, packed_at_load = q.load_span(1, 4), src.load_span(1, 4, weights=fmt)
    assert stored.weights == fmt
    assert torch.equal(stored.step(x, 0, stored.new_cache()), packed_at_load.step(x, 0, packed_at_load.new_cache()))
    with pytest.raises(StoreError, match=f"holds {fmt} weights: serve it with --weights {fmt}"):
        q.load_span(0, 2, weights="bf16")
    full = q.load_full()  # a quantized store's whole model (a q4k draft's way): its layers' linears as held
    packed = Int8Linear if fmt == "int8" else Int4Linear
    assert sum(isinstance(m, packed) for m in full.modules()) >= 7 * q.num_layers - 7, fmt
    again = cli("store", "quantize", str(out), str(tmp_path / "twice"), "--weights", fmt, timeout=60)
    assert again.returncode != 0 and f"already holds {fmt} weights" in again.stderr


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_packed_linear_gives_a_row_the_same_numbers_alone_or_in_a_window(fmt: str) -> None:
    """The kernels are row-invariant: a window's rows come out bit for bit as one-row steps (with row attention around
    them, a quantized span's whole step is: test_batch_invariance.py, docs/quantization.md)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 512)
    packed = Int8Linear.from_linear(linear) if fmt == "int8" else Int4Linear.from_linear(linear, 128)
    x = torch.randn(8, 256).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), torch.cat([packed(x[i : i + 1]) for i in range(8)]))
