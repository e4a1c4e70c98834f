"""The README's cheap commands run: every ```bash block marked by a `<!-- runnable -->` line just before it.

Such a block holds only commands that need no model, no network and no daemon (`dsd-node --help`, …). Each
non-blank, non-comment line runs on its own with `bash -c`, from the repository root, with the venv's `bin`
first on PATH (so `dsd-node` is this checkout's), and must exit 0 within 60 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The marker line, optional blank lines, then a ```bash fence and its body up to the closing fence.
RUNNABLE = re.compile(r"^<!--\s*runnable\s*-->[ \t]*\n(?:[ \t]*\n)*```bash[ \t]*\n(.*?)^```[ \t]*$",
                      re.MULTILINE | re.DOTALL)


def runnable_commands(text: str) -> list[str]:
    """The command lines of the runnable blocks of a Markdown text, in order (comments and blank lines left out)."""
    commands = []
    for block in RUNNABLE.findall(text):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_readme_has_a_runnable_block():
    assert runnable_commands(README.read_text(encoding="utf-8")), (
        "README.md should hold at least one ```bash block preceded by a `<!-- runnable -->` line"
    )


def test_the_marker_finds_what_it_should():
    text = (
        "```bash\nnot-this\n```\n"
        "<!-- runnable -->\n```bash\n# a comment\ndsd-node --help\n\ndsd-node start --help\n```\n"
        "<!-- runnable -->\n```python\nnot_this()\n```\n"
    )
    assert runnable_commands(text) == ["dsd-node --help", "dsd-node start --help"]


@pytest.mark.parametrize("command", runnable_commands(README.read_text(encoding="utf-8")))
def test_readme_command_runs(command: str):
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    try:
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README command timed out after 60 s: {command}")
    assert done.returncode == 0, (
        f"README command failed (exit {done.returncode}): {command}\n"
        f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
    )
