"""The import-linter contracts of pyproject.toml hold (layers, sans-IO protocol, no cycles), and the linter bites."""

from __future__ import annotations

import json
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


def loaded_libraries(code: str) -> list[str]:
    """Which of torch, transformers and libp2p a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport sys; print('loaded:', *[m for m in ('torch', 'transformers', 'libp2p') if m in sys.modules])"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.splitlines()[-1].split()[1:]


def test_help_loads_no_model_or_network_libraries() -> None:
    """`dsd-node --help` answers without importing torch, transformers or libp2p (the commands import them)."""
    assert loaded_libraries("from dsd.node.cli import build_parser; build_parser()") == []


def test_testnet_down_and_status_load_no_model_or_network_libraries(tmp_path: Path, tiny_qwen2_store: Path) -> None:
    """`testnet down` and `status` only read a state file and signal processes: no torch, no libp2p, so
    every test's teardown and a user's `down` return in well under a second. Reading a store's manifest
    (what `testnet up` does before it spawns the daemons) loads none of them either; the store's loaders do."""
    from dsd.node.testnet.processes import TestnetState

    TestnetState(bootstrap="/ip4/127.0.0.1/tcp/1", model="m", store=None, num_layers=2).save(tmp_path)
    for action in ("down", "status"):
        code = f"from dsd.node.cli import main; main(['testnet', '{action}', '--state', {str(tmp_path)!r}])"
        assert loaded_libraries(code) == [], action
    manifest = f"import dsd.node.testnet.swarm; from dsd.shard_store import Manifest; Manifest.read({str(tiny_qwen2_store)!r})"
    assert loaded_libraries(manifest) == []
    assert "torch" in loaded_libraries(f"from dsd.shard_store import Store; Store({str(tiny_qwen2_store)!r})")


def test_the_program_flushes_its_output_and_skips_interpreter_finalization(tmp_path: Path) -> None:
    """`dsd-node` (`run`) leaves with the command's exit code once it returned: its output is all there even
    through a pipe, and atexit hooks (the interpreter's finalization, 1.6-3 s with torch loaded) never run."""
    from dsd.node.testnet.processes import TestnetState

    TestnetState(bootstrap="/ip4/127.0.0.1/tcp/1", model="m", store=None, num_layers=2).save(tmp_path)
    code = ("import atexit, sys; atexit.register(print, 'finalized')\n"
            f"sys.argv = ['dsd-node', 'testnet', 'status', '--json', '--state', {str(tmp_path)!r}]\n"
            "from dsd.node.cli import run; run()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0  # no process recorded, so none is down
    assert json.loads(done.stdout)["bootstrap"] == "/ip4/127.0.0.1/tcp/1"
    assert "finalized" not in done.stdout
