"""bench/churn.py's account of coverage: holes (a block no live peer serves) and refills (back to the stable swarm's
coverage), from the per-second samples, as its result files report them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from churn import coverage_report, holes  # noqa: E402


def sample(t: float, *coverage: int) -> dict:
    return {"t": t, "coverage": list(coverage), "live": 0}


SAMPLES = [sample(0, 2, 2, 2), sample(1, 2, 2, 2),  # stable until t = 2
           sample(2, 2, 1, 2), sample(3, 2, 0, 2), sample(4, 2, 0, 1), sample(5, 2, 1, 2), sample(6, 2, 2, 2),
           sample(7, 0, 2, 2)]  # a hole still open at the end


def test_holes_are_stretches_with_a_block_below_the_bar_and_say_how_long_and_which_blocks() -> None:
    assert holes(SAMPLES) == [{"opened": 3, "healed": 5, "seconds": 2, "blocks": [1]},
                              {"opened": 7, "healed": None, "seconds": None, "blocks": [0]}]
    assert holes(SAMPLES, below=2) == [{"opened": 2, "healed": 6, "seconds": 4, "blocks": [1, 2]},
                                       {"opened": 7, "healed": None, "seconds": None, "blocks": [0]}]


def test_the_report_counts_the_churn_phase_against_the_stable_swarms_coverage() -> None:
    report = coverage_report({"samples": SAMPLES, "stable_end": 2})
    assert report["full_coverage"] == 2 and report["unhealed_holes"] == 1
    assert report["heal_p50_s"] == report["heal_p95_s"] == 2
    assert report["refill_p50_s"] == 4 and report["under_full_share"] == round(5 / 6, 3)
