"""Fixtures of the federated tests: a second worker model and a live two-worker testnet."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from support.models import save_tiny_model
from support.processes import cli


@pytest.fixture(scope="module")
def worker_b_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second worker model: another seed and depth (3 layers), same vocabulary and tokenizer, model id
    tiny-qwen2-b: `hf/` and `store/`."""
    from dsd.shard_store import convert

    root = tmp_path_factory.mktemp("worker_b")
    convert(save_tiny_model("qwen2", root / "hf", seed=1, layers=3), root / "store", model_id="tiny-qwen2-b")
    return root


@pytest.fixture(scope="module")
def federated_net(tiny_qwen2_root: Path, worker_b_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`testnet up --federated` with worker "a" (tiny-qwen2, 5 layers) and "b" (tiny-qwen2-b), fp32 top-K;
    a worker a test stopped (SIGSTOP) is resumed before `testnet down`."""
    state = tmp_path_factory.mktemp("fednet")
    up = cli("testnet", "up", "--federated", "--store", str(tiny_qwen2_root / "store"), "--store2",
             str(worker_b_root / "store"), "--state", str(state), "--topk-codec", "fp32", "--record-ttl", "10", "--json")
    assert up.returncode == 0, up.stderr[-3000:]
    info = json.loads(up.stdout)
    workers = [p for p in info["peers"] if p["role"] == "federated"]
    info["a"], info["b"] = workers[0], workers[1]
    yield info
    for w in workers:  # a test may have stopped one
        try:
            os.kill(w["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    down = cli("testnet", "down", "--state", str(state), timeout=60)
    assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def federated_models(tiny_qwen2_root: Path, worker_b_root: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Both workers' models as transformers runs them (float32, eval)."""
    from transformers import AutoModelForCausalLM

    def load(root: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()

    return load(tiny_qwen2_root), load(worker_b_root)
