"""The Petals comparison's pure parts: every system's output is cut by the engine's own stop rule, and the summary
pairs each of our modes with Petals' run of the same prompt and repetition and counts exactness per mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from petals_compare import cut, summarize  # noqa: E402


class Letters:
    """A decoder: token i is the i-th letter (enough for stop strings)."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join("abcdefghijklmnopqrstuvwxyz\n"[i] for i in ids)


def test_cut_keeps_the_token_that_ends_generation() -> None:
    tok = Letters()
    assert cut([0, 1, 26, 3, 4, 5], frozenset(), ["\nde"], tok) == [0, 1, 26, 3, 4]  # "ab\nde": the stop completes at e
    assert cut([0, 1, 2, 3], frozenset({2}), [], None) == [0, 1, 2]  # the eos is kept
    assert cut([0, 1, 2], frozenset(), [], None) == [0, 1, 2]


def _run(task: str, rep: int, mode: str, tps: float, tokens: list[int]) -> dict[str, object]:
    return {"task_id": task, "rep": rep, "mode": mode, "tokens_per_s": tps, "new_tokens": len(tokens),
            "elapsed_s": len(tokens) / tps, "prefill_s": 0.5, "tokens": tokens, "cut_tokens": tokens}


def test_summary_pairs_with_petals_and_counts_exactness() -> None:
    ref = {"t0": [1, 2, 3], "t1": [4, 5, 6]}
    runs = []
    for rep in (1, 2):
        for task, good in ref.items():
            runs += [_run(task, rep, "petals", 1.0, good), _run(task, rep, "ar", 2.0, good),
                     _run(task, rep, "sd", 3.0, good), _run(task, rep, "dsd", 4.0 if task == "t0" else 6.0, good)]
    runs[-1] = {**runs[-1], "cut_tokens": [4, 5, 7]}  # one dsd output differs from the target's
    runs.append({"task_id": "t1", "rep": 3, "mode": "petals", "error": "server died"})
    summ = summarize({"runs": runs, "reference": ref})
    assert summ["failed_runs"] == 1
    assert summ["ratios"]["ar/petals"]["median"] == 2.0 and summ["ratios"]["ar/petals"]["pairs"] == 4
    assert summ["ratios"]["dsd/petals"]["median"] == 5.0  # median of 4, 4, 6, 6
    assert summ["ratios"]["dsd/ar"]["median"] == 2.5
    assert summ["modes"]["dsd"]["identical_to_reference"] == "3/4"
    assert summ["modes"]["petals"]["identical_to_reference"] == "4/4"
    assert summ["modes"]["petals"]["tokens_per_s"]["median"] == 1.0
