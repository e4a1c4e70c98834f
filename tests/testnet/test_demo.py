"""`dsd-node demo` end to end on a tiny store: a WAN testnet, ar and dsd on a HumanEval prompt with its
stop strings, identical text, the result written as JSON and the testnet stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsd.node.testnet.processes import pid_alive
from dsd.node.testnet.workload import HUMANEVAL_STOPS

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
    assert "identical text" in run.stdout
    for r in reports.values():  # the completion HumanEval scores: the text before the first stop string
        assert r["text"].startswith(r["completion"]) and not any(s in r["completion"] for s in HUMANEVAL_STOPS)
    state = json.loads((tmp_path / "tn" / "testnet.json").read_text())
    assert not any(pid_alive(p["pid"]) for p in state["peers"])
