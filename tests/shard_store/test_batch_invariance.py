"""Batch-invariant quantized spans (issue 70): a row gives the same bits computed alone (an `ar` step), in a chain
window, in a token tree or beside other sessions' windows, so speculative decoding over a quantized route gives the
quantized model's own greedy text; and the head of a quantized route holds int8 ends whose logits are row-invariant.

The geometry is the real target's where it matters (head dim 128, GQA): before row attention, 18 of 30 int4 windows
of such a span differed from one-row steps, and `sd`/`dsd` parted from `ar` on 10 of 20 runs of the model below."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import trio
from support.models import make_tiny_model, noisy_copy, tiny_tokenizer

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams
from dsd.shard_store import Store, convert
from dsd.shard_store.modules import SpanModule, SpanWindow
from dsd.shard_store.quant import Int8Embedding, Int8Linear, held_bytes
from dsd.shard_store.rotary_table import RotaryTable

GEOMETRY = dict(hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024)  # head dim 128, two query heads per key/value head


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A 4-layer Qwen2 of the real head geometry: (its float store, the model); and a q4k store of its GGUF."""
    from support.gguf_files import write_tiny_gguf

    root = tmp_path_factory.mktemp("wide")
    model = make_tiny_model("qwen2", layers=4, **GEOMETRY)
    model.save_pretrained(root / "hf")
    tiny_tokenizer().save_pretrained(root / "hf")
    convert(root / "hf", root / "store", model_id="wide")
    write_tiny_gguf(model, root / "wide.gguf", tiny_tokenizer(),
                    types={"attn_q": "Q4_K", "attn_k": "Q4_0", "ffn_": "Q4_K", "attn_v": "Q8_0"})
    convert(root / "wide.gguf", root / "q4k", weights="q4k")
    return root, model


def span_of(root: Path, fmt: str, start: int = 0, end: int = 4) -> SpanModule:
    if fmt == "q4k":
        return Store(root / "q4k").load_span(start, end)
    return Store(root / "store").load_span(start, end, weights=fmt)


def one_row_steps(span: SpanModule, prefix: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`rows` [1, t, h] after `prefix`, one `ar` step each: the reference every other way of computing must equal."""
    cache = span.new_cache()
    span.step(prefix, 0, cache)
    p = prefix.shape[1]
    return torch.cat([span.step(rows[:, i : i + 1], p + i, cache) for i in range(rows.shape[1])], dim=1)


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, GEOMETRY["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("fmt", ["int8", "int4", "q4k"])
def test_a_window_gives_each_row_the_bits_of_one_row_steps(wide, fmt: str) -> None:
    root, _ = wide
    span = span_of(root, fmt)
    assert span.weights == fmt
    for seed, (p, t) in enumerate([(3, 9), (17, 5), (70, 16), (130, 2)]):
        x = hidden(p + t, seed)
        cache = span.new_cache()
        span.step(x[:, :p], 0, cache)
        window = span.step(x[:, p:], p, cache)
        assert torch.equal(window, one_row_steps(span, x[:, :p], x[:, p:])), (fmt, p, t)


def test_a_tree_node_gives_the_bits_of_its_path_as_one_row_steps(wide) -> None:
    root, _ = wide
    span = span_of(root, "int4")
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 6]
    p = 23
    x = hidden(p + len(parents), 7)
    cache = span.new_cache()
    span.step(x[:, :p], 0, cache)
    tree = span.step(x[:, p:], p, cache, parents=parents)
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        alone = one_row_steps(span, x[:, :p], x[:, p:][:, path])
        assert torch.equal(tree[0, node], alone[0, -1]), (node, path)


def test_a_joint_step_gives_each_session_the_bits_of_its_own_steps(wide) -> None:
    root, _ = wide
    span = span_of(root, "q4k")
    sessions = [(40, 9, None), (70, 16, None), (9, 4, [-1, 0, 0, 1]), (101, 1, None)]  # 9 and 16 rows: batched, they differ
    windows, want = [], []
    for seed, (p, t, parents) in enumerate(sessions):
        x = hidden(p + t, 20 + seed)
        cache = span.new_cache()
        span.step(x[:, :p], 0, cache)
        windows.append(SpanWindow(x[:, p:], p, cache, parents=parents))
        if parents is None:
            want.append(one_row_steps(span, x[:, :p], x[:, p:]))
        else:
            alone = span.new_cache()
            span.step(x[:, :p], 0, alone)
            want.append(span.step(x[:, p:], p, alone, parents=parents))
    got = span.step_each(windows)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert isinstance(g, torch.Tensor) and torch.equal(g, w), k


def test_sliding_window_layers_are_batch_invariant_too(tmp_path: Path) -> None:
    """Qwen2 with sliding layers (window 6) and head dim 16: windows that cross the band's edge, one-row steps."""
    model = make_tiny_model("qwen2-sliding", layers=4)
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", model_id="sliding")
    span = Store(tmp_path / "store").load_span(0, 4, weights="int4")
    h = int(model.config.hidden_size)
    for seed, (p, t) in enumerate([(2, 9), (11, 7), (30, 3)]):
        x = torch.randn(1, p + t, h, generator=torch.Generator().manual_seed(seed)) * 3
        cache = span.new_cache()
        span.step(x[:, :p], 0, cache)
        assert torch.equal(span.step(x[:, p:], p, cache), one_row_steps(span, x[:, :p], x[:, p:])), (p, t)


@pytest.mark.parametrize("fmt", ["int4", "q4k"])
def test_speculative_greedy_text_is_the_quantized_models_own(wide, fmt: str) -> None:
    """`sd` and `dsd` (chains and trees) give `ar`'s tokens over quantized spans and an int8 head, prompt by prompt."""
    root, model = wide
    store = Store(root / ("q4k" if fmt == "q4k" else "store"))
    head = store.load_head(dtype=torch.bfloat16, weights=fmt)
    backend = LocalBackend(head, [span_of(root, fmt, 0, 2), span_of(root, fmt, 2, 4)])
    draft = noisy_copy(model, 0.05)
    rng = random.Random(1)
    for _ in range(5):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(5, 40))]
        ar = trio.run(HeadEngine(backend, None, GenerationConfig(mode="ar", max_new_tokens=40)).run, prompt).tokens
        for mode, nodes in (("sd", None), ("dsd", None), ("dsd", 8)):
            cfg = GenerationConfig(mode=mode, max_new_tokens=40, tree_nodes=nodes)
            got = trio.run(HeadEngine(backend, ModelDrafter(draft, SamplingParams()), cfg).run, prompt).tokens
            assert got == ar, (fmt, mode, nodes, prompt)


def test_a_quantized_routes_head_holds_int8_ends_with_row_invariant_logits(wide) -> None:
    root, _ = wide
    store = Store(root / "store")
    fp32, head = store.load_head(), store.load_head(dtype=torch.bfloat16, weights="int4")
    assert isinstance(head.embed_tokens, Int8Embedding) and isinstance(head.lm_head, Int8Linear)
    assert head.embed_tokens.qweight.data_ptr() == head.lm_head.qweight.data_ptr()  # tied: one int8 matrix
    assert held_bytes(head) < 0.3 * held_bytes(fp32)
    assert Store(root / "q4k").load_head(dtype=torch.bfloat16).lm_head.__class__ is Int8Linear  # a q4k store's own
    assert store.load_head(dtype=torch.bfloat16).lm_head.__class__ is torch.nn.Linear  # a float route: float ends
    ids = torch.tensor([[5, 77, 123, 9, 250, 31]])
    x = head.embed(ids)
    want = fp32.embed(ids)
    # half an int8 step (amax / 254) and three bf16 roundings (the weights read, the scale, the row: amax / 512 each)
    assert x.dtype == torch.bfloat16 and ((x.float() - want).abs() <= want.abs().amax(-1, keepdim=True) / 100).all()
    logits = head.logits(x)
    rows = torch.cat([head.logits(x[:, i : i + 1]) for i in range(ids.shape[1])], dim=1)
    assert torch.equal(logits, rows)


def test_the_rotary_table_gives_the_familys_values_at_any_position(wide) -> None:
    root, _ = wide
    span = span_of(root, "int4", 0, 1)
    table = RotaryTable(span.adapter, span.rotary_emb)
    positions = torch.tensor([[0, 1, 63, 64, 65, 200, 777]])
    x = torch.zeros(1, 7, GEOMETRY["hidden_size"], dtype=torch.bfloat16)
    got = table.rotate(x, positions, {"full_attention"})["full_attention"]
    for i, pos in enumerate(positions[0].tolist()):
        cos, sin = span.adapter.rotate(span.rotary_emb, x, torch.tensor([[pos]]), {"full_attention"})["full_attention"]
        assert torch.allclose(got[0][0, i].float(), cos[0, 0].float(), rtol=0, atol=1e-2)
        assert torch.allclose(got[1][0, i].float(), sin[0, 0].float(), rtol=0, atol=1e-2)
    later = table.rotate(x[:, :2], torch.tensor([[777, 63]]), {"full_attention"})["full_attention"]
    assert torch.equal(later[0][0], got[0][0, [6, 2]]) and torch.equal(later[1][0], got[1][0, [6, 2]])
