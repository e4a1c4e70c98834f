"""What a result file records about where things were: never a path of the machine that made it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from harness import REPO, command_line, run_metadata  # noqa: E402


def test_result_files_show_paths_relative_to_the_repo_or_by_their_last_part(tmp_path: Path) -> None:
    args = argparse.Namespace(results=REPO / "bench" / "results" / "x.json", work=tmp_path / "soak-work", reps=3)
    settings = run_metadata("t", args)["settings"]
    assert settings == {"results": "bench/results/x.json", "work": "<soak-work>", "reps": 3}
    line = command_line("soak.py", ["--work", str(tmp_path / "w"), "--results", str(REPO / "bench" / "r.json")])
    assert line == "python bench/soak.py --work <w> --results bench/r.json"
    assert str(tmp_path) not in line and str(REPO) not in line
