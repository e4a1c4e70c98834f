"""The families whose quirks touch the most code, over a real 2-peer testnet (daemons on loopback) through the
user's commands: `dsd-node generate` in `sd` and `dsd` with a draft store of the same family equals
transformers' greedy `generate` token for token. Gemma 2: eager attention with soft caps, alternating sliding
and global layers split across peers, the head's embedding scale and final soft cap; Qwen3-MoE: experts inside
each peer's span, a dense first layer; Mistral: every layer sliding. The other families differ from these only
inside a layer, which tests/shard_store/test_families.py checks in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.models import hf_greedy, make_tiny_model, noisy_copy, tiny_tokenizer
from support.processes import cli, cli_testnet

from dsd.shard_store import convert

pytestmark = pytest.mark.network

PROMPT = [1, 17, 42, 99, 5, 17, 42]
NEW = 16


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe", "mistral"])
def test_generate_over_two_peers_equals_transformers(family: str, tmp_path: Path) -> None:
    model = make_tiny_model(family)
    draft = noisy_copy(model, 0.1)
    for name, m in (("target", model), ("draft", draft)):
        m.save_pretrained(tmp_path / f"{name}-hf")
        tiny_tokenizer().save_pretrained(tmp_path / f"{name}-hf")
        convert(tmp_path / f"{name}-hf", tmp_path / name, model_id=f"tiny-{family}-{name}")
    expected = hf_greedy(model, PROMPT, NEW)
    with cli_testnet(tmp_path / "net", "--store", str(tmp_path / "target"), "--peers", "2") as net:
        for mode in ("sd", "dsd"):
            out = cli("generate", "--bootstrap", net["bootstrap"], "--store", str(tmp_path / "target"),
                      "--draft", str(tmp_path / "draft"), "--prompt-ids", ",".join(map(str, PROMPT)),
                      "--max-new-tokens", str(NEW), "--mode", mode, "--json", timeout=180)
            assert out.returncode == 0, out.stderr[-3000:]
            report = json.loads(out.stdout)
            assert report["tokens"] == expected, (family, mode)
            assert len(report["route"]) == 2  # the two peers each served a span
            assert 0 < report["acceptance_rate"] < 1.0
