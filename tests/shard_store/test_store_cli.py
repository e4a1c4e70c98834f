"""The store CLI: `convert`, `store inspect`, `store verify` — exit codes, output, clear errors."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsd.node.cli import store as cmd_store


def run(argv: list[str]) -> int:
    """Run the store subcommands exactly as dsd-node wires them (register + set_defaults func)."""
    parser = argparse.ArgumentParser(prog="dsd-node")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd_store.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def store_copy(tiny_qwen2_store: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(tiny_qwen2_store, dst)
    return dst


def test_convert_then_inspect_json(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "st"
    assert run(["convert", str(tiny_llama_dir), "--out", str(out), "--dtype", "bfloat16", "--model-id", "tl", "--json"]) == 0
    converted = json.loads(capsys.readouterr().out)
    assert converted["dtype"] == "bfloat16" and converted["model_id"] == "tl" and converted["convert_seconds"] >= 0
    assert run(["store", "inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["family"] == "llama"
    assert summary["num_layers"] == 5 and summary["hidden_size"] == 64 and summary["vocab_size"] == 300
    assert summary["tokenizer"] is True
    assert summary["total_bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")


def test_inspect_table(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["store", "inspect", str(store_copy)]) == 0
    text = capsys.readouterr().out
    for needle in ("tiny-qwen2", "qwen2", "float32", "tokenizer", "yes"):
        assert needle in text


def test_verify_ok_and_tampered(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["store", "verify", str(store_copy)]) == 0
    assert "ok:" in capsys.readouterr().out
    victim = store_copy / "layers" / "layer_003.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    (store_copy / "tokenizer" / "tokenizer.json").unlink()
    assert run(["store", "verify", str(store_copy)]) == 1
    err = capsys.readouterr().err
    assert "layers/layer_003.safetensors" in err and "tokenizer/tokenizer.json" in err
    assert "layers/layer_002.safetensors" not in err


def test_clear_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["store", "inspect", str(tmp_path / "missing")]) == 1
    assert run(["store", "verify", str(tmp_path)]) == 1
    assert run(["convert", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "no manifest.json" in err
    assert "Traceback" not in err


def test_real_dsd_node_verify_names_tampered_file(store_copy: Path) -> None:
    """End to end through the real `dsd-node` entry point in a subprocess."""
    victim = store_copy / "head.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = subprocess.run(
        [sys.executable, "-m", "dsd.node.cli", "store", "verify", str(store_copy)], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "head.safetensors" in bad.stderr and "Traceback" not in bad.stderr
