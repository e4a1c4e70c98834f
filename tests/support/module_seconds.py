"""Refresh tests/module_seconds.json from a pytest run's `--durations=0` report on stdin: each test module's
seconds (setup, call and teardown of its tests), which conftest uses to start the longest modules first.

    .venv/bin/python -m pytest --durations=0 | .venv/bin/python tests/support/module_seconds.py
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+([^:\s]+)::")
FILE = Path(__file__).parent.parent / "module_seconds.json"


def module_seconds(lines: list[str]) -> dict[str, float]:
    """Seconds per test module in a durations report, longest first."""
    total: Counter[str] = Counter()
    for line in lines:
        if m := LINE.match(line):
            total[m.group(2)] += float(m.group(1))
    return {module: round(s, 1) for module, s in total.most_common()}


if __name__ == "__main__":
    seconds = module_seconds(sys.stdin.read().splitlines())
    if not seconds:
        sys.exit("no durations in the input: run pytest with --durations=0")
    FILE.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{FILE.name}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")
