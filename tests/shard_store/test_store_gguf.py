"""GGUF import: a tiny Qwen2 written as an F32 GGUF (llama.cpp tensor names, with a BPE tokenizer)
converts to a store whose model and tokenizer equal the source, tied or untied lm_head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.models import make_tiny_model, tiny_tokenizer

from dsd.shard_store import Store, convert

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_tiny_qwen2_gguf(model: torch.nn.Module, path: Path, tokenizer=None) -> None:
    """Write a Qwen2 model as an F32 GGUF the way llama.cpp names things (no lm_head when tied)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer is not None:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        added = {a["id"]: a["content"] for a in spec["added_tokens"]}
        tokens = [""] * len(tokenizer)
        for text, i in spec["model"]["vocab"].items():
            tokens[i] = text
        for i, text in added.items():
            tokens[i] = text
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for key, tensor in state.items():
        if key in _TOP_NAMES:
            name = _TOP_NAMES[key]
        else:
            _, _, index, rest = key.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{index}.{_LAYER_NAMES[module]}.{kind}"
        w.add_tensor(name, tensor.detach().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_converts_exactly(tie: bool, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = make_tiny_model("qwen2", layers=2, tie=tie, seed=4)
    gguf_path = tmp_path / "tiny-q.gguf"
    write_tiny_qwen2_gguf(model, gguf_path, tiny_tokenizer())
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
    assert (got - want).abs().max().item() <= 1e-4
    with torch.no_grad():
        assert (store.load_full()(ids).logits - want).abs().max().item() <= 1e-4

    tok = store.load_tokenizer()
    want_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)
    text = "class Node:\n    def __init__(self, value):\n"
    assert tok(text).input_ids == want_tok(text).input_ids
    assert tok.decode(tok(text).input_ids) == text


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    write_tiny_qwen2_gguf(make_tiny_model("qwen2", layers=1), tmp_path / "bare.gguf")
    manifest = convert(tmp_path, tmp_path / "store", gguf_file="bare.gguf", model_id="bare")
    assert manifest.tokenizer_files == [] and manifest.model_id == "bare"
    assert Store(tmp_path / "store").load_tokenizer() is None
