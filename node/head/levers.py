"""dsd's levers on the work it does ahead of a verdict (issue 57), by name: the `GenerationConfig` options each sets.

`budget`: a bet goes ahead, and a branch is drafted, only where its chance pays for its cost; `trees`: a matched
pre-drafted chain gives way to a tree drafted after the verdict when the tree pays more; `deep`: a third window in
flight while most bets win; `fallback`: decode as `sd` while working ahead costs more than it saves. Off by
default until the pinned cell says which pay (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LEVERS: dict[str, dict[str, Any]] = {
    "budget": {"budget": True},
    "trees": {"ready_trees": True},
    "deep": {"pipeline": 3, "deep_min": 0.6},
    "fallback": {"fallback": True},
}


def lever_options(names: Iterable[str], pipeline: int = 2) -> dict[str, Any]:
    """The options the named levers set (`all`: every one); `deep` keeps a deeper `pipeline` asked for."""
    chosen = [n.strip() for n in names if n.strip() and n.strip() != "none"]
    if "all" in chosen:
        chosen = list(LEVERS)
    unknown = sorted(set(chosen) - set(LEVERS))
    if unknown:
        raise ValueError(f"unknown lever(s) {', '.join(unknown)}; choose from {', '.join(LEVERS)}, all or none")
    out: dict[str, Any] = {}
    for name in chosen:
        out.update(LEVERS[name])
    if "pipeline" in out:
        out["pipeline"] = max(out["pipeline"], pipeline)
    return out
