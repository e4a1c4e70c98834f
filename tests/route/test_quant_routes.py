"""Quantized routes on real testnets: block peers serving int8 or int4 weights (`start --weights`), a head that
asks for that format; greedy output equals the same quantized model run whole in one process, records name the
format, and a head asking for another format gets a clear no-route answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
from support.processes import cli, cli_testnet

from dsd.node.head.config import GenerationConfig
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.shard_store import Store

pytestmark = pytest.mark.network

PROMPT = [1, 17, 42, 99, 5, 17, 42, 99, 7, 3]
N_NEW = 24


def whole(store: Store, fmt: str, spans: list[tuple[int, int]]) -> list[int]:
    """Greedy tokens of the model with every layer in `fmt`, in one process (the head in bf16, as a quantized head)."""
    backend = LocalBackend(store.load_head(dtype=torch.bfloat16, weights=fmt),
                           [store.load_span(a, b, weights=fmt) for a, b in spans])
    return trio.run(HeadEngine(backend, None, GenerationConfig(mode="ar", max_new_tokens=N_NEW)).run, PROMPT).tokens


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_route_gives_the_quantized_models_own_greedy_tokens(
        fmt: str, tiny_qwen2_root: Path, tiny_qwen2_draft_store: Path, tmp_path: Path) -> None:
    store_path = tiny_qwen2_root / "store"
    store = Store(store_path)
    state = tmp_path / "testnet"
    with cli_testnet(state, "--store", str(store_path), "--peers", "2", "--weights", fmt, "--record-ttl", "10") as net:
        ready = [json.loads(p.read_text()) for p in sorted((state / "ready").glob("peer*.json"))]
        assert {(r["weights"], r["dtype"]) for r in ready} == {(fmt, "bfloat16")}

        def generate(*args: str):
            return cli("generate", "--bootstrap", net["bootstrap"], "--store", str(store_path), "--threads", "1",
                       "--json", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(N_NEW), *args)

        want = whole(store, fmt, [(0, store.num_layers)])
        for mode, extra in (("ar", []), ("dsd", ["--draft", str(tiny_qwen2_draft_store)])):
            out = generate("--mode", mode, "--weights", fmt, *extra)
            assert out.returncode == 0, out.stderr[-3000:]
            report = json.loads(out.stdout)
            assert report["tokens"] == want, (fmt, mode)
        auto = generate("--mode", "ar")  # no --weights: the only format there is, the head in its own dtype
        assert auto.returncode == 0, auto.stderr[-3000:]
        other = "int4" if fmt == "int8" else "int8"
        refused = generate("--mode", "ar", "--weights", other, "--hole-wait-s", "0")  # no peer will come to heal it
        assert refused.returncode != 0
        assert f"holds {fmt} weights; this route uses {other}" in refused.stderr, refused.stderr[-2000:]
        if fmt == "int4":  # the head serves the last layers itself in int8: a route over int4 peers only if mixing
            split = ready[0]["end"] if ready[0]["start"] == 0 else ready[1]["end"]
            mixed = generate("--mode", "ar", "--weights", "int8", "--blocks", f"{split}:{store.num_layers}",
                             "--mix-weights")
            assert mixed.returncode == 0, mixed.stderr[-3000:]
            backend_spans = LocalBackend(store.load_head(dtype=torch.bfloat16, weights="int8"),
                                         [store.load_span(0, split, weights="int4"),
                                          store.load_span(split, store.num_layers, weights="int8")])
            ref = trio.run(HeadEngine(backend_spans, None, GenerationConfig(mode="ar", max_new_tokens=N_NEW)).run,
                           PROMPT).tokens
            assert json.loads(mixed.stdout)["tokens"] == ref


def test_a_q4k_route_gives_the_q4k_models_own_greedy_tokens(tiny_qwen2_draft_store: Path, tmp_path: Path) -> None:
    """Peers serving a store converted with `--weights q4k` (the GGUF's own 4-bit blocks): exact as whole."""
    from support.gguf_files import write_tiny_gguf
    from support.models import make_tiny_model, tiny_tokenizer

    from dsd.shard_store import convert

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(make_tiny_model("qwen2", layers=4, hidden_size=256, intermediate_size=256, seed=5), gguf_path,
                    tiny_tokenizer(), types={"attn_q": "Q4_K", "attn_k": "Q4_0", "ffn_": "Q4_K", "attn_v": "Q8_0"})
    store_path = tmp_path / "q4k"
    convert(gguf_path, store_path, weights="q4k")
    store = Store(store_path)
    state = tmp_path / "testnet"
    with cli_testnet(state, "--store", str(store_path), "--peers", "2", "--record-ttl", "10") as net:
        ready = [json.loads(p.read_text()) for p in sorted((state / "ready").glob("peer*.json"))]
        assert {(r["weights"], r["dtype"]) for r in ready} == {("q4k", "bfloat16")}  # auto: the store's own
        want = whole(store, "q4k", [(0, store.num_layers)])
        for mode, extra in (("ar", []), ("dsd", ["--draft", str(tiny_qwen2_draft_store)])):
            out = cli("generate", "--bootstrap", net["bootstrap"], "--store", str(store_path), "--threads", "1",
                      "--json", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(N_NEW),
                      "--mode", mode, "--weights", "q4k", *extra)
            assert out.returncode == 0, out.stderr[-3000:]
            assert json.loads(out.stdout)["tokens"] == want, mode
