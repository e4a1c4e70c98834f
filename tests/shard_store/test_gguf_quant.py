"""q4k stores: a GGUF's own 4-bit blocks taken as they are (`convert --weights q4k`), its wider tensors int8, its float
ones bf16; a layer type that maps to none of them is refused, naming the tensor, before the slow load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.gguf_files import write_tiny_gguf
from support.models import make_tiny_model, tiny_tokenizer
from support.processes import cli

from dsd.shard_store import Store, StoreError, convert
from dsd.shard_store.manifest import layer_file
from dsd.shard_store.quant import Q4K_ONLY_FROM_GGUF, WeightFormatError, unpack_nibbles
from dsd.shard_store.writer import quantize_store

# hidden 256: every linear's inputs a multiple of a Q4_K super-block
WIDE = dict(layers=2, hidden_size=256, intermediate_size=256, seed=3)
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_K",
         "ffn_down": "Q8_0"}  # attn_v stays F32


def held_weight(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What a quantized layer file's linear `name` computes with, as float32."""
    if f"{name}.q4" in tensors:
        q = unpack_nibbles(tensors[f"{name}.q4"]).float()
        sz = tensors[f"{name}.scales_zeros"].float().transpose(0, 1)
        group = q.shape[1] // sz.shape[1]
        return (q - 8) * sz[..., 0].repeat_interleave(group, 1) + sz[..., 1].repeat_interleave(group, 1)
    if f"{name}.qweight" in tensors:
        return tensors[f"{name}.qweight"].float() * tensors[f"{name}.scales"].float()[:, None]
    return tensors[f"{name}.weight"].float()


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # llama: q and k rows permuted in the file
def test_a_q4k_store_holds_the_files_own_blocks(family: str, tmp_path: Path) -> None:
    model = make_tiny_model(family, **WIDE)
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, gguf_path, tiny_tokenizer(), types=TYPES)
    manifest = convert(gguf_path, tmp_path / "q4k", weights="q4k")
    assert manifest.weights == "q4k" and manifest.dtype == "bfloat16"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the float32 store beside it is gone
    convert(gguf_path, tmp_path / "float")  # what transformers' loader makes of the same file
    quantize_store(tmp_path / "float", tmp_path / "int4", "int4")  # the same values quantized again (groups of 128)
    floats, q4k, int4 = (load_file(str(tmp_path / s / layer_file(1))) for s in ("float", "q4k", "int4"))
    held = {"self_attn.q_proj": "q4", "self_attn.k_proj": "q4", "self_attn.o_proj": "q4", "mlp.gate_proj": "q4",
            "mlp.up_proj": "q4", "mlp.down_proj": "qweight", "self_attn.v_proj": "weight"}
    for name, kind in held.items():
        assert f"{name}.{kind}" in q4k, (name, sorted(q4k))
        want = floats[f"{name}.weight"]
        err = (held_weight(q4k, name) - want).abs().max().item()
        if kind == "q4":  # the file's 4-bit values and its scales (groups of 32), to the bf16 rounding of each
            assert q4k[f"{name}.scales_zeros"].shape[0] == want.shape[1] // 32
            again = (held_weight(int4, name) - want).abs().max().item()
            assert err <= 2 ** -7 * want.abs().max().item() and err < again / 8, (name, err, again)
        elif kind == "qweight":  # half a step of its row, and the bf16 rounding of its scale (127 steps x 2^-8)
            rows = (held_weight(q4k, name) - want).abs().amax(dim=1)
            assert bool((rows <= want.abs().amax(dim=1) / 127).all()), name
        else:
            assert err <= 2 ** -8 * want.abs().max().item()
    store = Store(tmp_path / "q4k", verify=True)
    ids = torch.tensor([[1, 17, 42, 99, 5, 17, 42]])
    head = store.load_head(dtype=torch.bfloat16)
    whole = store.load_span(0, 2)
    parts = [store.load_span(0, 1, weights="q4k"), store.load_span(1, 2, weights="q4k")]
    with torch.inference_mode():
        want = head.logits(whole(head.embed(ids), 0, whole.new_cache()))
        h = head.embed(ids)
        for span in parts:
            h = span(h, 0, span.new_cache())
        assert torch.equal(head.logits(h), want)  # a split q4k model computes what it computes whole


def test_a_type_q4k_cannot_hold_is_refused_before_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was loaded before it was refused")

    write_tiny_gguf(make_tiny_model("qwen2", **WIDE), tmp_path / "q3.gguf", types={"attn_q": "Q3_K"})
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fail)
    with pytest.raises(StoreError, match=r"blk\.0\.attn_q\.weight \(Q3_K\), blk\.1\.attn_q\.weight \(Q3_K\)"):
        convert(tmp_path / "q3.gguf", tmp_path / "out", weights="q4k")
    assert not (tmp_path / "out").exists()


def test_q4k_comes_only_from_a_gguf(tmp_path: Path, tiny_qwen2_root: Path) -> None:
    store = Store(tiny_qwen2_root / "store")
    with pytest.raises(WeightFormatError, match="convert --weights q4k"):
        store.load_span(0, 1, weights="q4k")
    with pytest.raises(StoreError, match="give a .gguf file"):
        convert(tiny_qwen2_root / "hf", tmp_path / "out", weights="q4k")
    assert "a float store no longer has" in Q4K_ONLY_FROM_GGUF


def test_convert_weights_on_the_command_line(tmp_path: Path) -> None:
    write_tiny_gguf(make_tiny_model("qwen2", **WIDE), tmp_path / "m.gguf", tiny_tokenizer(), types={"ffn_": "Q4_K"})
    out = cli("convert", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "s"), "--weights", "q4k", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["weights"] == "q4k" and summary["dtype"] == "bfloat16"
    tensors = load_file(str(tmp_path / "s" / layer_file(0)))
    assert tensors["mlp.up_proj.q4"].dtype == torch.uint8 and tensors["self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert np.isfinite(tensors["mlp.down_proj.scales_zeros"].float().numpy()).all()


def test_the_mapping_check_takes_the_blocks_own_weight_and_refuses_one_a_step_off() -> None:
    """`_check_mapped`: 4-bit blocks held as int4 groups give their weight up to the bf16 rounding of each scale and
    zero; a loader that changed one weight by a step is refused, naming the tensor and the position."""
    from dsd.shard_store.gguf_quant import _check_mapped, int4_group_tensors
    from dsd.shard_store.quant import int4_dequantize

    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, size=(16, 64), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.05, size=(16, 2)).astype(np.float32)
    offset = rng.uniform(-0.5, 0.0, size=(16, 2)).astype(np.float32)
    held = int4_group_tensors(q, scale, offset)
    weight = torch.from_numpy(scale.repeat(32, 1) * q + offset.repeat(32, 1))
    _check_mapped("blk.0.ffn_up.weight", "Q4_K", held, weight)
    assert torch.allclose(int4_dequantize(held["q4"], held["scales_zeros"]), weight, atol=2e-3)
    off = weight.clone()
    off[3, 40] += float(scale[3, 1])
    with pytest.raises(StoreError, match=r"blk.0.ffn_up.weight \(Q4_K\).*at \[3, 40\]"):
        _check_mapped("blk.0.ffn_up.weight", "Q4_K", held, off)
