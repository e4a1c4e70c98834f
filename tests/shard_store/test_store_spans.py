"""Head -> uneven spans -> head must reproduce the whole HF model exactly (fp32), including
incremental windows through the span KV caches and truncation back over rejected drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsd.shard_store import HeadModule, SpanCache, SpanModule, Store, StoreError

TOL = 1e-4
SPANS = [(0, 1), (1, 4), (4, 5)]  # 3 uneven spans over 5 layers
WINDOWS = [1, 6, 3, 2, 5]  # 5 incremental windows, sizes 1..6


class Pipeline:
    """The head and spans wired in order, as the route of peers would run them."""

    def __init__(self, head: HeadModule, spans: list[SpanModule], batch: int = 1) -> None:
        self.head = head
        self.spans = spans
        self.caches: list[SpanCache] = [s.new_cache() for s in spans]

    @property
    def length(self) -> int:
        lengths = {c.length for c in self.caches}
        assert len(lengths) == 1
        return lengths.pop()

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self.length
        hidden = self.head.embed(ids)
        for span, cache in zip(self.spans, self.caches, strict=True):
            hidden = span(hidden, pos, cache)
        return self.head.logits(hidden)

    def truncate(self, n: int) -> None:
        for cache in self.caches:
            cache.truncate(n)


def _reference(hf_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.no_grad()
def _full_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


@pytest.fixture(params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def hf_and_store(family: str, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    root = request.getfixturevalue(f"tiny_{family}_root")
    return root / "hf", root / "store"


def test_spans_match_whole_model_prefill_windows_and_truncate(hf_and_store: tuple[Path, Path]) -> None:
    hf_dir, store_dir = hf_and_store
    reference = _reference(hf_dir)
    store = Store(store_dir, verify=True)
    pipe = Pipeline(store.load_head(), [store.load_span(s, e) for s, e in SPANS])
    gen = torch.Generator().manual_seed(1234)
    vocab = store.manifest.vocab_size

    seq = torch.randint(0, vocab, (1, 20), generator=gen)
    got = [pipe.step(seq)]
    for size in WINDOWS:
        window = torch.randint(0, vocab, (1, size), generator=gen)
        got.append(pipe.step(window))
        seq = torch.cat([seq, window], dim=1)
    assert pipe.length == 20 + sum(WINDOWS)
    want = _full_logits(reference, seq)
    diff = (torch.cat(got, dim=1) - want).abs().max().item()
    print(f"max |logit diff| spans vs whole model: {diff:.3g}")
    assert diff <= TOL
    assert want.abs().max().item() > 1.0  # the comparison is not between near-zero tensors

    # Reject the last 3 positions, then append other tokens: must equal a full recompute.
    keep = seq.shape[1] - 3
    pipe.truncate(keep)
    seq = seq[:, :keep]
    replacement = (seq[:, -3:] + 7) % vocab  # differs from what was dropped
    got_new = pipe.step(replacement)
    seq = torch.cat([seq, replacement], dim=1)
    want_all = _full_logits(reference, seq)
    diff = (got_new - want_all[:, -3:]).abs().max().item()
    print(f"max |logit diff| after truncate: {diff:.3g}")
    assert diff <= TOL
    # ... and decoding continues correctly after the truncation.
    nxt = torch.randint(0, vocab, (1, 2), generator=gen)
    got_next = pipe.step(nxt)
    seq = torch.cat([seq, nxt], dim=1)
    assert (got_next - _full_logits(reference, seq)[:, -2:]).abs().max().item() <= TOL


def test_truncate_really_discards_rejected_entries(tiny_qwen2_store: Path) -> None:
    """Stale K/V past the truncation point must not leak into later windows."""
    store = Store(tiny_qwen2_store)
    a = Pipeline(store.load_head(), [store.load_span(0, 5)])
    b = Pipeline(store.load_head(), [store.load_span(0, 5)])
    ids = torch.arange(3, 15).unsqueeze(0)
    a.step(ids)
    b.step(ids[:, :9])
    a.truncate(9)
    tail = torch.tensor([[40, 41, 42]])
    assert (a.step(tail) - b.step(tail)).abs().max().item() <= 1e-5


def test_batch_of_two_matches_whole_model(tiny_llama_root: Path) -> None:
    reference = _reference(tiny_llama_root / "hf")
    store = Store(tiny_llama_root / "store")
    pipe = Pipeline(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    got = torch.cat([pipe.step(ids[:, :8]), pipe.step(ids[:, 8:])], dim=1)
    assert (got - _full_logits(reference, ids)).abs().max().item() <= TOL


def test_load_full_matches_hf_model_and_generates_the_same(hf_and_store: tuple[Path, Path]) -> None:
    hf_dir, store_dir = hf_and_store
    reference = _reference(hf_dir)
    full = Store(store_dir).load_full()
    ids = torch.randint(0, 300, (1, 17), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_full_logits(full, ids), _full_logits(reference, ids))
    out_ref = reference.generate(ids, max_new_tokens=8, do_sample=False)
    out_full = full.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out_ref, out_full)
    assert not any(t.is_meta for t in full.state_dict().values())


def test_head_and_full_share_tied_embeddings(tiny_qwen2_store: Path, tiny_llama_store: Path) -> None:
    qwen = Store(tiny_qwen2_store)
    assert qwen.manifest.tied_embeddings
    head = qwen.load_head()
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()
    full = qwen.load_full()
    assert full.lm_head.weight.data_ptr() == full.get_input_embeddings().weight.data_ptr()
    llama = Store(tiny_llama_store)
    assert not llama.manifest.tied_embeddings
    head = llama.load_head()
    assert not torch.equal(head.lm_head.weight, head.embed_tokens.weight)


def test_span_holds_only_its_layers(tiny_qwen2_store: Path) -> None:
    store = Store(tiny_qwen2_store)
    span = store.load_span(1, 4)
    names = {n for n, _ in span.named_parameters()}
    assert all(n.startswith(("layers.0.", "layers.1.", "layers.2.")) for n in names)
    nbytes = sum(p.numel() * p.element_size() for p in span.parameters())
    assert abs(nbytes - store.span_nbytes(1, 4)) < 0.05 * nbytes  # safetensors adds small headers
    assert not hasattr(span, "embed_tokens")


def test_span_forward_rejects_misuse(tiny_llama_store: Path) -> None:
    store = Store(tiny_llama_store)
    span = store.load_span(0, 2)
    other = store.load_span(2, 5)
    cache = span.new_cache()
    hidden = torch.randn(1, 4, 64)
    with pytest.raises(StoreError, match="start_pos 3 != cache length 0"):
        span(hidden, 3, cache)
    with pytest.raises(StoreError, match="its own new_cache"):
        span(hidden, 0, other.new_cache())
    with pytest.raises(StoreError, match=r"\[batch, tokens, 64\]"):
        span(torch.randn(1, 4, 32), 0, cache)
    with pytest.raises(StoreError, match="empty window"):
        span(torch.randn(1, 0, 64), 0, cache)
    span(hidden, 0, cache)
    assert cache.length == 4
    with pytest.raises(StoreError, match="holds only 4"):
        cache.truncate(5)
    with pytest.raises(StoreError, match="not inside the model's layers"):
        store.load_span(3, 6)
    with pytest.raises(StoreError, match="not inside the model's layers"):
        store.load_span(2, 2)
    head = store.load_head()
    with pytest.raises(StoreError, match="outside the vocabulary"):
        head.embed(torch.tensor([[1, 300]]))


def test_cache_max_length_and_nbytes(tiny_llama_store: Path) -> None:
    span = Store(tiny_llama_store).load_span(0, 1)
    cache = span.new_cache(max_length=10)
    assert cache.nbytes == 0
    span(torch.randn(1, 6, 64), 0, cache)
    assert cache.nbytes > 0
    with pytest.raises(StoreError, match="cache full"):
        span(torch.randn(1, 5, 64), 6, cache)
    assert cache.length == 6  # a refused window leaves the cache as it was
    span(torch.randn(1, 4, 64), 6, cache)
    assert cache.length == 10


def test_bfloat16_store_spans_match_bfloat16_full(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    from dsd.shard_store import convert

    manifest = convert(tiny_qwen2_dir, tmp_path / "bf16", dtype="bfloat16")
    assert manifest.dtype == "bfloat16"
    store = Store(tmp_path / "bf16", verify=True)
    head = store.load_head()
    assert head.embed_tokens.weight.dtype == torch.bfloat16
    pipe = Pipeline(head, [store.load_span(0, 3), store.load_span(3, 5)])
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(9))
    got = torch.cat([pipe.step(ids[:, :7]), pipe.step(ids[:, 7:])], dim=1).float()
    full = _full_logits(store.load_full(), ids).float()
    fp32 = _full_logits(_reference(tiny_qwen2_dir), ids)
    # same weights and kernels in bf16: close to each other, and both near the fp32 model
    assert (got - full).abs().max().item() < 0.1
    assert (got - fp32).abs().max().item() < 0.5
    assert got.argmax(-1).eq(fp32.argmax(-1)).float().mean().item() >= 0.8
