"""The DSD report's pure parts: HumanEval completion cutting, the acceptance fit, the timing model and
the paper's communication-saving formula (checked against the paper's own worked numbers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from dsd_sweep import (  # noqa: E402
    cut_completion,
    interp,
    paper_prediction,
    predict,
    solve_alpha,
)

T0 = {1: 0.08, 2: 0.09, 4: 0.1, 8: 0.14, 16: 0.22}


def test_cut_completion_stops_at_first_top_level_block() -> None:
    text = "    return x % 1.0\n\n\ndef other():\n    pass\n# trailing"
    assert cut_completion(text) == "    return x % 1.0\n\n"
    assert cut_completion("    return 1\nprint(f(2))") == "    return 1"
    assert cut_completion("    # indented comment stays\n    return 1") == "    # indented comment stays\n    return 1"


def test_interp_is_linear_between_points_and_flat_outside() -> None:
    assert interp(T0, 1) == pytest.approx(0.08)
    assert interp(T0, 6) == pytest.approx(0.12)
    assert interp(T0, 40) == pytest.approx(0.22)
    assert interp(T0, 0.5) == pytest.approx(0.08)


@pytest.mark.parametrize("alpha,gamma", [(0.3, 4), (0.7, 6), (0.9, 12), (0.99, 3)])
def test_solve_alpha_inverts_truncated_geometric_mean(alpha: float, gamma: int) -> None:
    k_mean = sum(alpha**i for i in range(1, gamma + 1))
    assert solve_alpha(k_mean, gamma) == pytest.approx(alpha, abs=1e-6)
    assert solve_alpha(gamma, gamma) == 1.0
    assert solve_alpha(0.0, gamma) == 0.0


def test_paper_formula_reproduces_its_worked_savings() -> None:
    # The paper: N=4, t1/t0=5 saves ~75 % of the communication with k = 4 tokens per sync.
    p = paper_prediction(4, 0.1, 0.5, 4.0)
    assert p["comm_saving_share"] == pytest.approx(0.75)
    assert p["saving_s"] == pytest.approx(3 * 0.5 * 0.75)
    assert p["speedup"] == pytest.approx(1.6 / (1.6 - 1.125))
    assert paper_prediction(4, 0.1, 0.5, 1.0)["speedup"] == pytest.approx(1.0)


def test_timing_model_ar_sd_dsd() -> None:
    n, t1, head, d = 4, 0.5, 0.01, 0.05
    ar = predict("ar", n=n, t1=t1, t0_table=T0, head_s=head, verify_s=0.0, draft_s=0, gamma=0, k_mean=0)
    assert ar["s_per_token"] == pytest.approx(5 * 0.5 + 4 * 0.08 + 0.01)
    # Perfect acceptance, gamma 7: sd pays drafting on top of the trip, dsd hides it (7·d < R).
    kw = dict(n=n, t1=t1, t0_table=T0, head_s=head, verify_s=0.0, draft_s=d, gamma=7.0, k_mean=7.0)
    sd, dsd = predict("sd", **kw), predict("dsd", **kw)
    r = 5 * 0.5 + 4 * interp(T0, 8) + head
    assert sd["s_per_token"] == pytest.approx((7 * d + r) / 8)
    assert dsd["p_full"] == pytest.approx(1.0)
    assert dsd["s_per_token"] == pytest.approx(r / 8)
    # Nothing accepted: dsd redrafts after every trip, like sd.
    kw0 = {**kw, "k_mean": 0.0}
    assert predict("dsd", **kw0)["s_per_token"] == pytest.approx(predict("sd", **kw0)["s_per_token"])
