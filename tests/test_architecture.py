"""The import-linter contracts of pyproject.toml hold (layers, sans-IO protocol, no cycles), and the linter bites."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed (the test extra installs import-linter)")
    return subprocess.run([exe, "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_contract_is_kept():
    run = lint_imports()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
    assert run.stdout.count(" KEPT") >= 6


def test_a_wrong_way_import_breaks_a_contract(tmp_path):
    """Negative control: the real graph checked against reversed layers must be reported broken."""
    config = tmp_path / "reversed.ini"
    config.write_text(
        "[importlinter]\n"
        "root_packages =\n    dsd.protocol\n    dsd.node\n"
        "[importlinter:contract:reversed]\n"
        "name = protocol above node (wrong on purpose)\n"
        "type = layers\n"
        "layers =\n    dsd.protocol\n    dsd.node\n"
    )
    run = lint_imports("--config", str(config))
    assert run.returncode != 0
    assert "BROKEN" in run.stdout


def test_the_cli_offers_exactly_the_store_dtypes() -> None:
    """`models prepare --dtype` spells the dtypes out (so --help loads no torch): they must match the store's."""
    from dsd.node.cli.models import STORE_DTYPES
    from dsd.shard_store.dtypes import DTYPES

    assert tuple(DTYPES) == STORE_DTYPES


def test_help_loads_no_model_libraries() -> None:
    """`dsd-node --help` must answer without importing torch or transformers (the commands import them)."""
    code = "import sys; from dsd.node.cli import build_parser; build_parser(); print('torch' in sys.modules, 'transformers' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["False", "False"], run.stdout + run.stderr
