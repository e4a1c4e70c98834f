"""A random-weight model written straight into a q4k store (`shard_store/random_q4k.py`): it verifies, its spans load
and step to finite outputs, its layer files hold what `convert --weights q4k` writes from a GGUF, and writing it
never makes a float tensor of a linear's size (what a detour through a float model could not avoid)."""

from __future__ import annotations

import gc
import platform
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.gguf_files import write_tiny_gguf
from support.models import make_tiny_model, tiny_config, tiny_tokenizer
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsd.shard_store import Store, convert
from dsd.shard_store.devices import release_freed_memory
from dsd.shard_store.families import adapter_for
from dsd.shard_store.manifest import layer_file
from dsd.shard_store.quant import QUANT_ROWS, Int4Linear, int8_quantize, unpack_nibbles
from dsd.shard_store.random_q4k import write_random_q4k_store

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
ALL_Q4K = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_K")


class FloatSizes(TorchDispatchMode):
    """Records the element count of the largest floating-point tensor any torch op makes (meta tensors aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def layout(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor of a layer file: its dtype and shape."""
    return {k: (v.dtype, tuple(v.shape)) for k, v in load_file(str(path)).items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: attention biases and tied embeddings
def test_a_random_q4k_store_verifies_loads_and_steps_to_finite_outputs(family: str, tmp_path: Path) -> None:
    config = tiny_config(family, layers=4)
    manifest = write_random_q4k_store(config, tmp_path / "s", model_id="rand", seed=1)
    assert manifest.weights == "q4k" and manifest.dtype == "bfloat16" and manifest.source.startswith("random")
    store = Store(tmp_path / "s", verify=True)
    assert store.verify() == []
    tensors = load_file(str(tmp_path / "s" / layer_file(2)))
    hidden, inter = config.hidden_size, config.intermediate_size
    for name in LINEARS:
        q4, sz = tensors[f"{name}.q4"], tensors[f"{name}.scales_zeros"]
        n = q4.shape[0]
        k = inter if name == "mlp.down_proj" else hidden
        assert q4.dtype == torch.uint8 and q4.shape == (n, k // 2), name
        assert sz.dtype == torch.bfloat16 and sz.shape == (k // 32, n, 2), name  # groups of 32: a GGUF block's
    for name in NORMS:
        assert tensors[name].dtype == torch.bfloat16 and bool((tensors[name] == 1).all())
    biases = {k for k in tensors if k.endswith(".bias")}
    assert biases == ({f"self_attn.{p}_proj.bias" for p in "qkv"} if family == "qwen2" else set())
    assert not {k for k in tensors if k.endswith(".weight")} - set(NORMS)  # no linear left float
    head = store.load_head()
    whole = store.load_span(0, 4)
    parts = [store.load_span(0, 2, weights="q4k"), store.load_span(2, 4)]
    assert whole.weights == "q4k"
    ids = torch.tensor([[1, 17, 42, 99, 5]])
    with torch.inference_mode():
        caches = [span.new_cache() for span in (whole, *parts)]
        want = whole(head.embed(ids), 0, caches[0])
        h = head.embed(ids)
        for span, cache in zip(parts, caches[1:], strict=True):
            h = span(h, 0, cache)
        assert torch.equal(h, want)  # a route of two spans computes what the layers compute whole
        for rows in (1, 8):  # a decoding step and a window, after the prompt
            x = torch.randn(1, rows, hidden)
            for span, cache in zip((whole, *parts), caches, strict=True):
                cache.truncate(ids.shape[1])
                out = span(x, ids.shape[1], cache)
                assert out.shape == (1, rows, hidden) and bool(torch.isfinite(out).all())
        logits = head.logits(want)
    assert bool(torch.isfinite(logits).all()) and float(want.float().std()) > 0


def test_random_layers_hold_what_convert_writes_from_a_q4k_gguf(tmp_path: Path) -> None:
    model = make_tiny_model("llama", layers=2, hidden_size=256, intermediate_size=256)  # Q4_K: inputs of 256
    write_tiny_gguf(model, tmp_path / "t.gguf", tiny_tokenizer(), types=ALL_Q4K)
    convert(tmp_path / "t.gguf", tmp_path / "gguf", weights="q4k")
    write_random_q4k_store(model.config, tmp_path / "rand", model_id="rand")
    for i in range(2):
        assert layout(tmp_path / "rand" / layer_file(i)) == layout(tmp_path / "gguf" / layer_file(i))
    assert Store(tmp_path / "rand").manifest.weights == Store(tmp_path / "gguf").manifest.weights == "q4k"


def test_writing_never_makes_a_float_copy_of_a_linear(tmp_path: Path) -> None:
    # vocab 64: the embeddings, float by design, stay smaller than the smallest linear
    config = tiny_config("llama", layers=2, hidden_size=512, intermediate_size=1024, vocab_size=64)
    smallest = 512 * config.num_key_value_heads * (512 // config.num_attention_heads)  # k_proj's weights
    layer_fp32 = 4 * 512 * (2 * 512 + 2 * 256 + 3 * 1024)  # one float layer's linears, in bytes
    with FloatSizes() as probe:
        nn.Linear(512, 256)  # what any float model is made of
    assert probe.largest >= smallest  # the probe sees it: a writer going through floats would fail below
    with torch.device("meta"):  # the family's modeling module imported before tracing: its import is no write
        adapter_for("llama").new_decoder_layer(config, 0)
    tracemalloc.start()
    try:
        with FloatSizes() as sizes:
            write_random_q4k_store(config, tmp_path / "s", model_id="rand")
        _, numpy_peak = tracemalloc.get_traced_memory()  # numpy's arrays are traced, torch's are not
    finally:
        tracemalloc.stop()
    assert sizes.largest < smallest, (sizes.largest, smallest)
    assert numpy_peak < layer_fp32 / 2, (numpy_peak, layer_fp32)
    assert Store(tmp_path / "s").verify() == []


def test_nibbles_repacked_a_block_of_rows_at_a_time_are_the_whole_tensors_packing() -> None:
    gen = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 256, (1040, 64), dtype=torch.uint8, generator=gen)  # two blocks of 512 rows and 16 more
    sz = torch.rand(128 // 32, 1040, 2, generator=gen).to(torch.bfloat16)
    blocks, whole = Int4Linear(q4, sz, nibbles=True), Int4Linear(unpack_nibbles(q4), sz)
    assert blocks.in_features == whole.in_features == 128 and torch.equal(blocks.qweight, whole.qweight)
    x = torch.randn(3, 128)
    assert torch.equal(blocks(x), whole(x))


def mapped_files(under: Path) -> set[str]:
    """The files below `under` this process has memory-mapped (/proc/self/maps)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps if str(under) in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_loaded_q4k_span_and_its_int8_head_keep_no_store_file_mapped(tmp_path: Path) -> None:
    write_random_q4k_store(tiny_config("llama", layers=2), tmp_path / "s", model_id="rand")
    store = Store(tmp_path / "s")
    span, head = store.load_span(0, 2), store.load_head()
    gc.collect()
    assert type(head.lm_head).__name__ == "Int8Linear"
    # a view of a file's tensor (a norm, a bias) keeps the whole file mapped, and every page packing read resident:
    # an 8B model's peer held 1.1 GB more than its weights, its head 1 GB more
    assert mapped_files(tmp_path) == set()
    with torch.inference_mode():
        assert bool(torch.isfinite(head.logits(span(head.embed(torch.tensor([[1, 2, 3]])), 0, span.new_cache()))).all())


def test_int8_rows_quantized_a_block_at_a_time_are_the_whole_tensors() -> None:
    w = torch.randn(QUANT_ROWS + 100, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scales = int8_quantize(w)
    full = w.float()
    scale = (full.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    assert torch.equal(q, torch.round(full / scale[:, None]).clamp(-127, 127).to(torch.int8))
    assert torch.equal(scales, scale.to(torch.bfloat16))


def test_loading_a_quantized_span_hands_freed_memory_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dsd.shard_store.store as store_module

    write_random_q4k_store(tiny_config("llama", layers=2), tmp_path / "s", model_id="rand")
    calls: list[int] = []
    monkeypatch.setattr(store_module, "release_freed_memory", lambda: calls.append(1) or True)
    Store(tmp_path / "s").load_span(0, 2)
    assert calls  # a peer loads in a worker thread, whose glibc arena kept 0.45 GB of an 8B span's temporaries
    if Path("/proc/self/maps").exists() and "glibc" in " ".join(platform.libc_ver()):
        assert release_freed_memory() is True
