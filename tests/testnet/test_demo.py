"""`dsd-node demo` end to end on tiny stores: a WAN testnet, ar and dsd on a HumanEval prompt with its
stop strings, identical text, the result written as JSON (naming the weight format) and the testnet stopped;
the default pair runs q4k by default (its prepared stores: tiny q4k ones here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.gguf_files import write_q4k_gguf

from dsd.node.testnet.processes import pid_alive
from dsd.node.testnet.workload import HUMANEVAL_STOPS
from dsd.shard_store import convert
from dsd.shard_store.default_models import DRAFT, TARGET, store_path

pytestmark = pytest.mark.network


def test_demo_runs_end_to_end_and_writes_its_result(tiny_qwen2_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    run = subprocess.run(
        [sys.executable, "-m", "dsd.node.cli", "demo", "--target", str(tiny_qwen2_root / "store"), "--draft", "ngram",
         "--peers", "2", "--ratio", "5", "--max-new-tokens", "12", "--state", str(tmp_path / "tn"),
         "--results", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    reports = result["reports"]
    assert set(reports) == {"ar", "dsd"} and result["task_id"] == "HumanEval/0"
    assert reports["dsd"]["tokens"] == reports["ar"]["tokens"] and 1 <= len(reports["ar"]["tokens"]) <= 12
    assert result["spec"]["max_new_tokens"] == 12 and "load_after" in result
    assert result["identical"] is True and result["weights"] == "fp32" and result["draft_weights"] == "ngram"
    assert result["timing"]["prepare_s"] is None and result["timing"]["command_s"] > 0  # --target: nothing prepared
    assert "identical text" in run.stdout and "== result (fp32 weights, draft ngram)" in run.stdout
    for r in reports.values():  # the completion HumanEval scores: the text before the first stop string
        assert r["text"].startswith(r["completion"]) and not any(s in r["completion"] for s in HUMANEVAL_STOPS)
    state = json.loads((tmp_path / "tn" / "testnet.json").read_text())
    assert not any(pid_alive(p["pid"]) for p in state["peers"])


def test_the_demo_runs_the_default_pair_in_q4k(tmp_path: Path) -> None:
    """No --target and no --weights: the prepared default pair in q4k (a tiny Q4_K GGUF converted as `models
    prepare` converts it, drafting for itself: int8 from its q4k store), peers and t0 in q4k, the head in bf16,
    the result naming both formats."""
    cache = tmp_path / "cache"
    gguf = write_q4k_gguf(tmp_path / "tiny.gguf")
    for model in (TARGET, DRAFT):
        convert(gguf, store_path(model, cache), model_id=model.model_id, weights="q4k")
    out = tmp_path / "demo.json"
    run = subprocess.run(
        [sys.executable, "-m", "dsd.node.cli", "demo", "--cache", str(cache), "--peers", "2", "--ratio", "5",
         "--max-new-tokens", "12", "--state", str(tmp_path / "tn"), "--results", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "stored as q4k" in run.stdout and "nothing to do" in run.stdout  # prepared already: no conversion
    result = json.loads(out.read_text())
    assert 0 <= result["timing"]["prepare_s"] < result["timing"]["command_s"]  # recorded: a first run's time
    assert result["weights"] == "q4k" and result["draft_weights"] == "int8 from q4k" and result["identical"] is True
    assert result["spec"]["weights"] == "q4k" and result["spec"]["draft_quant"] == "int8"
    assert result["spec"]["draft"] == "Qwen2.5-Coder-0.5B-Instruct-q4k"  # the store's name: no path of this machine
    assert result["reports"]["dsd"]["tokens"] == result["reports"]["ar"]["tokens"]
    assert "== result (q4k weights, draft int8 from q4k)" in run.stdout and "head bfloat16" in run.stdout
    ready = [json.loads(p.read_text()) for p in sorted((tmp_path / "tn" / "ready").glob("peer*.json"))]
    assert len(ready) == 2 and {(r["weights"], r["dtype"]) for r in ready} == {("q4k", "bfloat16")}
