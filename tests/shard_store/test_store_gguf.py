"""GGUF import: a tiny model of each family transformers' GGUF loader maps, written as an F32 GGUF the way
llama.cpp's converter writes it (support/gguf_files.py), converts to a store that equals the source model
(head -> two spans -> head, and load_full); a file whose model transformers would load differently (a
quirk its GGUF mapping drops), an architecture outside our families, or a Mixtral written as "llama" is
refused before the slow load, naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.gguf_files import write_tiny_gguf
from support.models import make_tiny_model, tiny_tokenizer

from dsd.shard_store import Store, StoreError, convert

TOL = 1e-4

# Each family with the quirks a GGUF carries through transformers' loader. A field its GGUF mapping does not
# read must equal the config class's default there: Qwen3's head_dim 128, Qwen3-MoE's moe_intermediate_size
# 768, Gemma's query_pre_attn_scalar 256 (which llama.cpp derives from head_dim, so head_dim 256) and Gemma 2's
# soft caps 50 and 30; Gemma 3's layer pattern and local rope base must be llama.cpp's fixed ones (every sixth
# layer global, 10000), Phi-3 rotates whole heads, and a Qwen3-MoE has no dense layer (llama.cpp's qwen3moe has
# no dense FFN tensors). A Mistral without sliding window is written by llama.cpp as, and loads as, a llama.
EXACT: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "mistral-full": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 128}),
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [], "moe_intermediate_size": 768}),
    "phi3": ("phi3", {"partial_rotary_factor": 1.0}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 256, "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "gemma3_text",
        {
            "layers": 6, "layer_types": None, "head_dim": 256, "query_pre_attn_scalar": 256,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 12345.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}

# The tiny families' own quirks (support/models.py FAMILY_QUIRKS), each lost by transformers' GGUF loader: the
# refusal names the GGUF key or tensor and the config field.
REFUSED: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "llama3": ({}, ("llama:", "rope_freqs.weight", "rope_type llama3")),
    "mistral": ({}, ("llama:", "llama.attention.sliding_window=6", "sliding_window")),
    "qwen3": ({}, ("qwen3:", "qwen3.attention.key_length=24", "head_dim")),
    "qwen3_moe": (
        {"mlp_only_layers": []}, ("qwen3_moe:", "qwen3moe.expert_feed_forward_length=48", "moe_intermediate_size")
    ),
    "phi3": ({}, ("phi3:", "phi3.rope.dimension_count=8", "partial_rotary_factor")),
    "gemma2": ({}, (
        "gemma2:", "gemma2.attn_logit_softcapping=5.0", "gemma2.final_logit_softcapping=3.0",
        "query_pre_attn_scalar: no GGUF key carries it and llama.cpp uses 16",
    )),
    "gemma3_text": ({}, (
        "gemma3_text:", "layer_types", "gemma3.attention.sliding_window_pattern", "gemma3.rope.freq_base_swa=100.0",
        "query_pre_attn_scalar",
    )),
    "mixtral": ({}, ("llama:", "llama.expert_count=4", "blk.*.ffn_gate_exps.weight", "Hugging Face folder")),
}


def _ids() -> torch.Tensor:
    """Nine random tokens: longer than the tiny sliding windows (6)."""
    return torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))


def _assert_store_equals(model: torch.nn.Module, store: Store) -> None:
    """The store's head -> spans [0, 2), [2, n) -> head, and its load_full, give the model's logits."""
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    head, n = store.load_head(), store.manifest.num_layers
    first, second = store.load_span(0, 2), store.load_span(2, n)
    hidden = first(head.embed(ids), 0, first.new_cache())
    got = head.logits(second(hidden, 0, second.new_cache()))
    assert (got - want).abs().max().item() <= TOL
    with torch.no_grad():
        assert (store.load_full()(ids).logits - want).abs().max().item() <= TOL


@pytest.fixture
def no_slow_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if transformers' model loader runs: refusals come before the slow load."""
    from transformers import AutoModelForCausalLM

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was loaded before it was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fail)


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_converts_exactly(tie: bool, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = make_tiny_model("qwen2", layers=2, tie=tie, seed=4)
    gguf_path = tmp_path / "tiny-q.gguf"
    write_tiny_gguf(model, gguf_path, tiny_tokenizer())
    manifest = convert(gguf_path, tmp_path / "store")
    assert manifest.model_id == "tiny-q" and manifest.source == "tiny-q.gguf"
    assert manifest.tied_embeddings is tie
    assert manifest.config["rope_parameters"]["rope_theta"] == 12345.0
    store = Store(tmp_path / "store", verify=True)

    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    head, span = store.load_head(), store.load_span(0, 2)
    got = head.logits(span(head.embed(ids), 0, span.new_cache()))
    assert (got - want).abs().max().item() <= TOL
    with torch.no_grad():
        assert (store.load_full()(ids).logits - want).abs().max().item() <= TOL

    tok = store.load_tokenizer()
    want_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)
    text = "class Node:\n    def __init__(self, value):\n"
    assert tok(text).input_ids == want_tok(text).input_ids
    assert tok.decode(tok(text).input_ids) == text


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    write_tiny_gguf(make_tiny_model("qwen2", layers=1), tmp_path / "bare.gguf")
    manifest = convert(tmp_path, tmp_path / "store", gguf_file="bare.gguf", model_id="bare")
    assert manifest.tokenizer_files == [] and manifest.model_id == "bare"
    assert Store(tmp_path / "store").load_tokenizer() is None


@pytest.mark.parametrize("name", sorted(EXACT))
def test_each_family_converts_from_gguf_exactly(name: str, tmp_path: Path) -> None:
    family, overrides = EXACT[name]
    model = make_tiny_model(name, **overrides)
    write_tiny_gguf(model, tmp_path / f"tiny-{name}.gguf", tiny_tokenizer())
    manifest = convert(tmp_path / f"tiny-{name}.gguf", tmp_path / "store")
    assert manifest.family == family and manifest.num_layers == model.config.num_hidden_layers
    _assert_store_equals(model, Store(tmp_path / "store", verify=True))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_quirk_the_gguf_loader_drops_is_refused(name: str, tmp_path: Path, no_slow_load: None) -> None:
    overrides, named = REFUSED[name]
    write_tiny_gguf(make_tiny_model(name, **overrides), tmp_path / "q.gguf", tiny_tokenizer())
    with pytest.raises(StoreError) as refused:
        convert(tmp_path / "q.gguf", tmp_path / "store")
    message = str(refused.value)
    assert message.startswith(named[0]), message
    for part in named[1:]:
        assert part in message, message
    assert not (tmp_path / "store").exists()


def test_llama3_rope_scaling_has_no_gguf_metadata(tmp_path: Path) -> None:
    """llama.cpp writes Llama 3 rope scaling as a rope_freqs tensor of per-frequency divisors, which
    transformers' GGUF loader neither maps nor turns into rope_parameters: loaded as is, the model would
    rotate with plain rope. convert refuses it (test above) instead of dropping the scaling."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    write_tiny_gguf(make_tiny_model("llama3"), tmp_path / "l3.gguf")
    assert "rope_freqs.weight" in {t.name for t in GGUFReader(str(tmp_path / "l3.gguf")).tensors}
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="l3.gguf")
    assert config.rope_parameters["rope_type"] == "default"


def test_a_family_llama_cpp_cannot_write_is_not_written(tmp_path: Path) -> None:
    """A Qwen3-MoE with a dense first layer has tensors llama.cpp's qwen3moe architecture has no name for."""
    with pytest.raises(ValueError, match="no tensor for model.layers.0.mlp.gate_proj.weight"):
        write_tiny_gguf(make_tiny_model("qwen3_moe"), tmp_path / "dense.gguf")


def _write_foreign_gguf(path: Path, arch: str, name: str = "foreign") -> None:
    """A minimal GGUF of another architecture, as gguf's writer lays one out (one embedding tensor)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-5)
    writer.add_vocab_size(10)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_an_architecture_outside_our_families_is_refused(arch: str, tmp_path: Path, no_slow_load: None) -> None:
    _write_foreign_gguf(tmp_path / "f.gguf", arch)
    refusal = rf"architecture '{arch}' .* loads in transformers as '{arch}', not a supported family \(.*llama.*\)"
    with pytest.raises(StoreError, match=refusal):
        convert(tmp_path / "f.gguf", tmp_path / "store")


def test_an_architecture_transformers_cannot_load_is_refused(tmp_path: Path, no_slow_load: None) -> None:
    _write_foreign_gguf(tmp_path / "r.gguf", "rwkv6")
    refusal = r"transformers cannot load the GGUF architecture 'rwkv6'.*maps .*gemma2.*supported families: .*llama"
    with pytest.raises(StoreError, match=refusal):
        convert(tmp_path / "r.gguf", tmp_path / "store")


def test_a_llama_file_named_mistral_is_refused(tmp_path: Path, no_slow_load: None) -> None:
    """transformers reads a "llama" GGUF named exactly "mistral" as Mistral: its config gains the default
    4096-token sliding window the file does not state, and gguf-py has no "mistral" tensor names."""
    write_tiny_gguf(make_tiny_model("mistral-full"), tmp_path / "m.gguf", name="mistral")
    with pytest.raises(StoreError, match=r"^mistral: .*sliding_window: .*has 4096.*cannot map the tensors"):
        convert(tmp_path / "m.gguf", tmp_path / "store")
