"""The DSD report's pure parts: HumanEval completion cutting, the timing model (checked on hand-computed
cases), the paper's formula against its own worked numbers, and the paired-speedup statistics."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from dsd_sweep import (  # noqa: E402
    cut_completion,
    merge_settings,
    option_mismatch,
    route_mismatch,
    run_setting,
    run_setting_todo,
    setting_options,
)
from sweep_model import (  # noqa: E402
    GAMMA_MAX,
    LOOKAHEAD,
    best_gamma,
    bootstrap_median,
    expected_tokens,
    interp,
    paper_prediction,
    pipelined_round,
    predict,
    ready_probability,
    summarize,
)
from sweep_options import PROBLEMS, SweepOptions  # noqa: E402

T0 = {1: 0.08, 2: 0.09, 4: 0.1, 8: 0.14, 16: 0.22}
HEAD = {1: 0.01, 16: 0.01}


def cal(**over: float) -> dict:
    base = {"peers": 4, "latency_ms": 500.0, "t0_s": 0.08, "t0_window_s": {str(k): v for k, v in T0.items()},
            "head_window_s": {str(k): v for k, v in HEAD.items()}, "alpha": 1.0, "alt_hit": 0.0,
            "draft_s_per_token": 0.05, "branch_step_s": 0.05}
    base.update(over)
    return base


def test_cut_completion_stops_at_first_top_level_block() -> None:
    text = "    return x % 1.0\n\n\ndef other():\n    pass\n# trailing"
    assert cut_completion(text) == "    return x % 1.0\n\n"
    assert cut_completion("    return 1\nprint(f(2))") == "    return 1"
    assert cut_completion("    # indented comment stays\n    return 1") == "    # indented comment stays\n    return 1"


def test_the_prompt_set_is_fixed_and_spread_over_humaneval() -> None:
    assert len(PROBLEMS) >= 10 and PROBLEMS == tuple(sorted(set(PROBLEMS)))
    assert PROBLEMS[0] == 0 and PROBLEMS[-1] >= 140


def test_interp_is_linear_between_points_and_flat_outside() -> None:
    assert interp(T0, 1) == pytest.approx(0.08)
    assert interp(T0, 6) == pytest.approx(0.12)
    assert interp(T0, 40) == pytest.approx(0.22)
    assert interp(T0, 0.5) == pytest.approx(0.08)


def test_ready_probability_counts_the_bonus_guess_and_the_alternatives() -> None:
    # Full acceptance of 4 drafts and the guessed bonus: α^(γ+1), the engine's rule (not α^γ).
    assert ready_probability(0.8, 4, 0.0) == pytest.approx(0.8**5)
    assert ready_probability(0.8, 4, 0.5) == pytest.approx(0.8**5 + (1 - 0.8**5) * 0.5)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_timing_model_hand_computed() -> None:
    r = 5 * 0.5 + 4 * interp(T0, 8) + 0.01  # N+1 links, N peers on 8 tokens, the head
    ar = predict("ar", cal(), 0)
    assert ar["s_per_token"] == pytest.approx(5 * 0.5 + 4 * 0.08 + 0.01)
    sd, dsd = predict("sd", cal(), 7), predict("dsd", cal(), 7)
    assert sd["s_per_token"] == pytest.approx((7 * 0.05 + r) / 8)
    assert dsd["p_ready"] == pytest.approx(1.0)
    assert dsd["s_per_token"] == pytest.approx(r / 8)  # 8 branch steps (0.4 s) hide behind the trip
    # Nothing accepted and no alternative ever right: dsd redrafts after every trip, like sd.
    none = cal(alpha=0.0, alt_hit=0.0)
    assert predict("dsd", none, 3)["s_per_token"] == pytest.approx(predict("sd", none, 3)["s_per_token"])
    # Half the outcomes ready: half the redrafting is exposed.
    half = cal(alpha=0.0, alt_hit=0.5)
    r3 = 5 * 0.5 + 4 * interp(T0, 4) + 0.01
    assert predict("dsd", half, 3)["s_per_token"] == pytest.approx(r3 + 0.5 * 3 * 0.05)
    assert best_gamma("sd", cal(alpha=0.0)) == 1 and best_gamma("dsd", cal()) > 4


def test_paper_formula_reproduces_its_worked_savings() -> None:
    # The paper: N=4, t1/t0=5 saves ~75 % of the communication with k = 4 tokens per sync.
    p = paper_prediction(4, 0.1, 0.5, 4.0)
    assert p["saving_s"] == pytest.approx(3 * 0.5 * 0.75)
    assert p["speedup"] == pytest.approx(1.6 / (1.6 - 1.125))
    assert paper_prediction(4, 0.1, 0.5, 1.0)["speedup"] == pytest.approx(1.0)


def test_bootstrap_median_resamples_whole_prompts() -> None:
    med, lo, hi = bootstrap_median([[1.0, 1.1, 0.9], [2.0, 2.1, 1.9], [3.0, 3.1, 2.9]])
    assert med == pytest.approx(2.0)
    assert lo < med < hi and lo >= 0.9 and hi <= 3.1
    med1, lo1, hi1 = bootstrap_median([[1.5, 1.5]])
    assert med1 == lo1 == hi1 == 1.5


def _run(task: str, rep: int, mode: str, tps: float, tokens: list[int]) -> dict:
    return {"task_id": task, "rep": rep, "mode": mode, "tokens_per_s": tps, "tokens": tokens, "new_tokens": len(tokens),
            "elapsed_s": len(tokens) / tps, "prefill_s": 0.1, "rounds": 4, "draft_rounds": 3 if mode != "ar" else 0,
            "drafted": 9 if mode != "ar" else 0, "accepted": 6 if mode != "ar" else 0, "windows_after_prefill": 3,
            "ready_rounds": 2 if mode == "dsd" else 0, "bytes_sent": 100, "bytes_received": 100,
            "time_breakdown": {"drafting_s": 0.3, "drafting_hidden_used_s": 0.2 if mode == "dsd" else 0.0,
                               "drafting_hidden_wasted_s": 0.1 if mode == "dsd" else 0.0,
                               "drafting_exposed_s": 0.0 if mode == "dsd" else 0.3}}


def test_summarize_pairs_runs_of_the_same_prompt_and_repetition() -> None:
    runs = []
    for task, base in (("A", 1.0), ("B", 2.0)):
        for rep in (1, 2):
            runs += [_run(task, rep, "ar", base, [1, 2]), _run(task, rep, "sd", 2 * base, [1, 2]),
                     _run(task, rep, "dsd", 3 * base, [1, 2] if task == "A" else [1, 3])]
    s = summarize({"peers": 4, "calibration": cal(alpha=0.7, alt_hit=0.5), "runs": runs})
    assert s["ratios"]["dsd/ar"]["median"] == pytest.approx(3.0)  # paired: base speed cancels
    assert s["ratios"]["dsd/sd"]["median"] == pytest.approx(1.5)
    assert s["ratios"]["dsd/ar"]["pairs"] == 4
    assert s["modes"]["dsd"]["identical_to_ar"] == "2/4"
    assert s["modes"]["dsd"]["ready_share"] == pytest.approx(2 / 3)
    assert s["modes"]["dsd"]["hidden_used_share"] == pytest.approx(1.0)
    assert s["modes"]["sd"]["hidden_used_share"] == 0.0
    # Decoding alone (what the timing model predicts): the prompt's trip (0.1 s in every run) left out,
    # so the ratio differs by prompt (A's runs take 2 s in ar, B's 1 s); the median lies between the two.
    a, b = (2 - 0.1) / (2 / 3 - 0.1), (1 - 0.1) / (1 / 3 - 0.1)
    assert s["ratios"]["dsd/ar decode"]["median"] == pytest.approx((a + b) / 2)
    assert "dsd/sd decode" not in s["ratios"]


def test_pipelined_dsd_is_predicted_with_two_windows_in_flight_and_deeper_pipelines_are_not() -> None:
    """Pipelined dsd has its own prediction (sending the bet ahead saves waits: faster than serial dsd);
    a pipeline deeper than the model describes is measured only."""
    runs = []
    for rep in (1, 2):
        runs += [_run("A", rep, "ar", 1.0, [1]), _run("A", rep, "dsd-serial", 2.0, [1]), _run("A", rep, "dsd", 3.0, [1])]
    slow_draft = cal(alpha=0.9, alt_hit=0.5, draft_s_per_token=0.1, branch_step_s=0.1)
    piped = summarize({"peers": 4, "calibration": slow_draft, "runs": runs, "options": {"pipeline": 2}})
    assert piped["modes"]["dsd"]["model"]["speedup_vs_ar"] > piped["modes"]["dsd-serial"]["model"]["speedup_vs_ar"] > 1.0
    assert piped["ratios"]["dsd/dsd-serial"]["median"] == pytest.approx(1.5)
    serial = summarize({"peers": 4, "calibration": slow_draft, "runs": runs, "options": {"pipeline": 1}})
    assert serial["modes"]["dsd"]["model"] == serial["modes"]["dsd-serial"]["model"]
    deep = summarize({"peers": 4, "calibration": slow_draft, "runs": runs, "options": {"pipeline": 3}})
    assert deep["modes"]["dsd"]["model"] is None and deep["modes"]["dsd-serial"]["model"] is not None
    with pytest.raises(ValueError, match="at most 2 windows"):
        predict("dsd", slow_draft, 4, pipeline=3)


def test_pipelined_model_reduces_to_serial_dsd_when_no_bet_can_win_or_go_out_in_time() -> None:
    # Never full acceptance: nothing sent ahead is ever used, so each window waits for its verdict and
    # is ready only when an alternative was right (serial dsd's rule with P = alt_hit).
    never = cal(alpha=0.0, alt_hit=0.5)
    assert predict("dsd", never, 3, pipeline=2)["s_per_token"] == pytest.approx(predict("dsd", never, 3)["s_per_token"])
    # Bets that take longer to draft than the trip never go out early: serial dsd (`dsd-batched`'s rule,
    # all branches drafted first). Drafted alone in single steps, the same bet goes out in time and helps.
    slow = cal(alpha=0.9, alt_hit=0.5, branch_step_s=1.0)
    serial = predict("dsd", slow, 3)["s_per_token"]
    assert predict("dsd", slow, 3, pipeline=2, alone=False)["s_per_token"] == pytest.approx(serial)
    assert predict("dsd", slow, 3, pipeline=2)["s_per_token"] < 0.9 * serial
    # Every bet wins and the bets are quick: two windows share each trip, so half a trip per window.
    r = 5 * 0.5 + 4 * interp(T0, 8) + 0.01
    assert predict("dsd", cal(), 7, pipeline=2)["s_per_token"] == pytest.approx(r / 2 / 8)
    # Every bet wins but drafting a bet takes longer than half a trip: windows leave one bet's drafting apart
    # (every branch batched, `dsd-batched`; the bet alone takes γ + 1 single steps).
    send = (1 + 7 + LOOKAHEAD) * 0.2
    assert predict("dsd", cal(branch_step_s=0.2), 7, pipeline=2, alone=False)["s_per_token"] == pytest.approx(send / 8)
    send = (1 + 7) * 0.2
    assert predict("dsd", cal(draft_s_per_token=0.2), 7, pipeline=2)["s_per_token"] == pytest.approx(send / 8)


def _simulated_pipeline(p: float, r: float, send: float, after: float, windows: int, seed: int) -> float:
    """The engine's policy replayed event by event: mean seconds between the verdicts of used windows."""
    rng = random.Random(seed)
    flying, last = [after], 0.0  # send times of the windows in flight, oldest first; the last verdict
    for _ in range(windows):
        verdict = flying[0] + r
        if len(flying) < 2:  # room: the newest window's bet goes once drafted, if before this verdict
            ahead = max(last, flying[-1] + send)
            if ahead < verdict:
                flying.append(ahead)
        won = rng.random() < p
        flying.pop(0)
        last = verdict
        if not (won and flying):  # a lost bet: what was sent ahead is dropped, the next goes after drafting
            flying = [verdict + after]
    return last / windows


@pytest.mark.parametrize(("p", "send"), [(0.4, 0.5), (0.7, 0.5), (0.7, 1.4), (0.95, 0.9)])
def test_pipelined_round_is_the_mean_of_the_pipeline_it_describes(p: float, send: float) -> None:
    """The closed form averages runs of won bets; replaying the policy must give the same mean."""
    r, after = 2.0, 0.3
    sim = _simulated_pipeline(p, r, send, after, 200_000, seed=1)
    assert pipelined_round(r, p, send, after) == pytest.approx(sim, rel=0.01)


def test_the_models_window_limits_are_the_engines() -> None:
    from dsd.node.head.config import LOOKAHEAD as ENGINE_LOOKAHEAD
    from dsd.node.head.config import GenerationConfig

    assert (LOOKAHEAD, GAMMA_MAX) == (ENGINE_LOOKAHEAD, GenerationConfig().gamma_max)


def test_a_failed_run_is_counted_apart_and_never_enters_the_medians() -> None:
    """A run that failed (a peer unreachable) has no counters: the summary must skip it, not crash, and count it."""
    runs = [_run("A", 1, "ar", 1.0, [1]), _run("A", 1, "sd", 2.0, [1]),
            {"task_id": "B", "rep": 1, "mode": "ar", "prompt_tokens": 5, "error": "RouteError: opening the route failed"}]
    s = summarize({"peers": 4, "calibration": cal(alpha=0.7), "runs": runs,
                   "failed": [{"task_id": "C", "rep": 1, "mode": "sd", "error": "RouteError: x"}]})
    assert s["failed_runs"] == 2
    assert s["ratios"]["sd/ar"]["pairs"] == 1
    assert s["modes"]["ar"]["identical_to_ar"] == "1/1"


def test_resume_reruns_a_prompt_whose_run_failed_in_every_mode() -> None:
    """A prompt with a failed run is not done, even though its earlier modes finished; untouched ones stay done."""
    runs = [_run("A", 1, "ar", 1.0, [1]), _run("A", 1, "sd", 2.0, [1]), _run("B", 1, "ar", 1.0, [1]),
            {"task_id": "B", "rep": 1, "mode": "sd", "prompt_tokens": 5, "error": "RouteError: x"}]
    opts, workload = SimpleNamespace(reps=2), SimpleNamespace(problems=[{"task_id": "A"}, {"task_id": "B"}])
    todo = [(rep, p["task_id"]) for rep, p in run_setting_todo(opts, {"runs": runs}, workload)]
    assert todo == [(1, "B"), (2, "A"), (2, "B")]


def test_a_discarded_run_is_shown_with_its_reason_and_its_prompt_runs_again(tmp_path: Path) -> None:
    """Runs set apart by hand (say, disturbed by other work on the machine) are named in the report with
    the reason, kept out of the medians, and their prompt is run again on resume."""
    from sweep_report import write_outputs

    discarded = {**_run("B", 1, "ar", 1.0, [1]), "reason": "ran beside the tests"}
    setting = {"key": "real-N4-r3", "models": "real", "peers": 4, "ratio": 3.0, "calibration": cal(), "runs": [_run("A", 1, "ar", 1.0, [1])],
               "discarded": [discarded],
               "provenance": {"commit": "c" * 40, "dirty": False, "command": "x", "load_before": [1.0, 1.0, 1.0]}}
    write_outputs({"name": "grid", "date": "d", "settings_runs": [setting]}, tmp_path / "grid")
    assert "1 runs; 1 runs set apart: ran beside the tests" in (tmp_path / "grid.md").read_text()
    assert summarize(setting)["modes"]["ar"]["identical_to_ar"] == "1/1"  # B's discarded run is not counted
    opts, workload = SimpleNamespace(reps=1), SimpleNamespace(problems=[{"task_id": "A"}, {"task_id": "B"}])
    assert [(rep, p["task_id"]) for rep, p in run_setting_todo(opts, setting, workload)] == [(1, "B")]


def test_a_cell_report_lists_every_paired_ratio_beyond_the_main_columns() -> None:
    """The lever (dsd vs dsd-batched) and pinning (dsd vs dsd-shared) are paired ratios of their own: the report
    prints each with its interval and pairs, not only the JSON."""
    from sweep_report import markdown_table

    runs = []
    for rep in (1, 2):
        runs += [_run("A", rep, "ar", 1.0, [1]), _run("A", rep, "sd", 2.0, [1]), _run("A", rep, "dsd", 3.0, [1]),
                 _run("A", rep, "dsd-batched", 2.5, [1]), _run("A", rep, "dsd-shared", 4.0, [1])]
    setting = {"key": "real-N4-r5", "models": "real", "peers": 4, "ratio": 5.0, "calibration": cal(), "runs": runs,
               "provenance": {"commit": "c" * 40, "dirty": False, "command": "x", "load_before": [1.0, 1.0, 1.0]}}
    setting["summary"] = summarize(setting)
    rows = {line.split(" | ")[4]: line.split(" | ")[5] for line in markdown_table({"settings_runs": [setting]}).splitlines()
            if line.count(" | ") == 7 and "/" in line.split(" | ")[4]}
    assert rows["dsd/dsd-batched"].startswith("1.20×") and rows["dsd/dsd-shared"].startswith("0.75×"), rows
    assert {"dsd-batched/ar", "dsd-batched/sd", "dsd-shared/ar-shared"} & rows.keys() == {"dsd-batched/ar", "dsd-batched/sd"}
    assert not {"dsd/ar", "sd/ar", "dsd/sd"} & rows.keys()  # those are the first table's columns


def test_a_cell_report_says_where_a_typical_run_s_time_goes() -> None:
    """Per mode, the median over runs of the run, the prompt's trip, drafting (and the part never used) and waiting:
    what the closing figures of a cell are read from. Runs that recorded no send-ahead gap show none."""
    from sweep_report import markdown_table

    runs = []
    for rep, tps in ((1, 1.0), (2, 2.0), (3, 4.0)):
        runs += [_run("A", rep, "ar", tps / 4, [1, 2]), _run("A", rep, "dsd", tps, [1, 2])]
        runs[-1]["time_breakdown"]["waiting_s"] = rep * 0.5
        runs[-1]["ahead_gap_s"] = rep * 0.25
    setting = {"key": "real-N4-r5", "models": "real", "peers": 4, "ratio": 5.0, "calibration": cal(), "runs": runs,
               "provenance": {"commit": "c" * 40, "dirty": False, "command": "x", "load_before": [1.0, 1.0, 1.0]}}
    setting["summary"] = summarize(setting)
    assert setting["summary"]["modes"]["dsd"]["run_s"] == {"run": 1.0, "prompt's trip": 0.1, "drafting": 0.3,
                                                          "drafting never used": 0.1, "waiting": 1.0,
                                                          "bet sent after its window": 0.5}
    table = markdown_table({"settings_runs": [setting]}).split("Where a run's time goes")[1]
    dsd = next(line for line in table.splitlines() if "| dsd |" in line)
    ar = next(line for line in table.splitlines() if "| ar |" in line)
    assert dsd.endswith("| dsd | 1.0 | 0.1 | 0.3 | 0.1 | 1.0 | 0.5 |") and ar.endswith("| ar | 4.0 | 0.1 | 0.3 | 0.0 | - | - |"), (dsd, ar)


def _setting(key: str, peers: int, ratio: float, opts: SweepOptions, **options: object) -> dict:
    return {"key": key, "models": "real", "peers": peers, "ratio": ratio, "runs": [_run("A", 1, "ar", 1.0, [1])],
            "options": {**setting_options(opts), **options}, "calibration": cal(), "provenance": {"commit": "c"}}


def test_a_setting_resumes_only_with_the_options_it_started_with() -> None:
    """Mixing runs of another draft quantization or mode set into a setting would make its medians meaningless."""
    opts = SweepOptions(draft_quant="int8")
    assert option_mismatch(_setting("real-N3-r3", 3, 3.0, opts), opts) == []
    diff = option_mismatch(_setting("real-N3-r3", 3, 3.0, opts, draft_quant="none", pipeline=1), opts)
    assert diff == ["draft_quant 'none' (here 'int8')", "pipeline 1 (here 2)"]
    more = _setting("real-N4-r5", 4, 5.0, opts, modes=["ar", "sd", "dsd-serial", "dsd"])
    assert option_mismatch(more, opts) == ["modes ['ar', 'sd', 'dsd-serial', 'dsd'] (here ['ar', 'sd', 'dsd'])"]
    assert option_mismatch(more, opts, more_modes=True) == []
    old = _setting("real-N3-r3", 3, 3.0, opts)
    del old["options"]["pipeline"]  # a setting from before pipelining
    assert option_mismatch(old, opts) == ["pipeline 'unset' (here 2)"]


def test_resuming_with_other_options_stops_before_any_testnet_starts() -> None:
    opts = SweepOptions(draft_quant="int8")
    setting = _setting("real-N3-r3", 3, 3.0, opts, draft_quant="none")
    workload = SimpleNamespace(problems=[{"task_id": "A"}, {"task_id": "B"}])
    with pytest.raises(SystemExit, match=r"real-N3-r3 started with other options: draft_quant 'none'"):
        run_setting(opts, setting, Path("no-store"), None, workload, frozenset(), lambda: None)


def test_a_resumed_setting_holds_its_t1_over_t0_on_a_machine_that_got_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid's axis is t1/t0: a setting resumed when a step takes 150 ms, not 127.6, gets 750 ms links, not 638."""
    import dsd_sweep
    import sweep_provenance
    from sweep_report import resumed_speed

    import dsd.node.testnet.calibrate
    import dsd.shard_store

    class Started(Exception):
        pass

    def testnet(target: Path, peers: int, latency_ms: float, state: Path, **links: object) -> None:
        raise Started(peers, latency_ms)

    monkeypatch.setattr(sweep_provenance, "machine_info", lambda: {"host_id": "b" * 12, "cpu_model": "CPU B", "cpu_count": 2})
    monkeypatch.setattr(dsd.node.testnet.calibrate, "measure_t0", lambda store, layers, weights=None: 0.150)
    monkeypatch.setattr(dsd.shard_store, "Store", lambda path: None)
    monkeypatch.setattr(dsd_sweep, "testnet", testnet)
    opts = SweepOptions(draft_quant="int8")
    setting = _setting("real-N3-r5", 3, 5.0, opts)
    setting["calibration"] = cal(peers=3, ratio=5.0, t0_s=0.1276, latency_ms=638.0, layers_per_peer=10)
    workload = SimpleNamespace(problems=[{"task_id": "A"}, {"task_id": "B"}])
    with pytest.raises(Started) as started:
        run_setting(opts, setting, Path("store"), None, workload, frozenset(), lambda: None)
    assert started.value.args == (3, pytest.approx(750.0))
    [resumed] = setting["provenance"]["resumed"]
    assert resumed["t0_s"] == 0.150 and resumed["latency_ms"] == pytest.approx(750.0)
    assert resumed["machine"] == {"host_id": "b" * 12, "cpu_model": "CPU B", "cpu_count": 2}
    assert resumed_speed(resumed) == " (t0 then 150 ms, links 750 ms)"
    assert setting["calibration"]["latency_ms"] == 638.0  # the runs made before keep their calibration


def test_merge_adopts_missing_grid_settings_run_with_the_same_options(tmp_path: Path) -> None:
    """The grid reuses the headline run: a setting another file completed is adopted, marked with its source."""
    opts = SweepOptions(draft_quant="int8", peers=[3, 4], ratios=[3.0, 5.0])
    other = tmp_path / "pipeline-2026-12-02.json"
    other.write_text(json.dumps({"settings_runs": [
        _setting("real-N4-r5", 4, 5.0, opts, modes=["ar", "sd", "dsd-serial", "dsd"]),
        _setting("real-N3-r3", 3, 3.0, opts),       # the results hold their own: theirs is kept
        _setting("real-N8-r10", 8, 10.0, opts),     # not in this sweep's grid
    ]}))
    own = _setting("real-N3-r3", 3, 3.0, opts)
    results = {"settings_runs": [own]}
    merge_settings(results, replace(opts, merge=[other]))
    assert [s["key"] for s in results["settings_runs"]] == ["real-N3-r3", "real-N4-r5"]
    assert results["settings_runs"][0] is own and "merged_from" not in own
    assert results["settings_runs"][1]["merged_from"] == "pipeline-2026-12-02.json"

    other.write_text(json.dumps({"settings_runs": [_setting("real-N4-r5", 4, 5.0, opts, draft_quant="none")]}))
    with pytest.raises(SystemExit, match=r"real-N4-r5 ran with other options: draft_quant 'none'"):
        merge_settings({"settings_runs": []}, replace(opts, merge=[other]))
    other.write_text("not json")
    with pytest.raises(SystemExit, match="not a sweep results file"):
        merge_settings({"settings_runs": []}, replace(opts, merge=[other]))


def test_a_checkout_is_dirty_for_changed_code_but_not_for_the_benchmarks_own_results(tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid's next setting starts after the bench rewrote its results file: that must not mark it dirty."""
    import subprocess

    import harness

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "grid.json").write_text("{}")
    (tmp_path / "engine.py").write_text("x = 1\n")

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    monkeypatch.setattr(harness, "REPO", tmp_path)
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "bench" / "results")
    (tmp_path / "bench" / "results" / "grid.json").write_text('{"runs": [1]}')
    assert not harness.git_commit().endswith("+dirty")
    (tmp_path / "engine.py").write_text("x = 2\n")
    assert harness.git_commit().endswith("+dirty")


def test_the_grid_matrix_places_each_setting_and_marks_the_unfinished() -> None:
    from sweep_report import grid_matrix

    def setting(peers: int, ratio: float, pairs: int) -> dict:
        r = {"median": 4.0, "ci95": [3.0, 5.0], "pairs": pairs}
        return {"peers": peers, "ratio": ratio, "options": {"problems": list(range(10)), "reps": 3},
                "summary": {"ratios": {"dsd/ar": r, "dsd/sd": {**r, "median": 1.3}}}}

    table = grid_matrix({"settings_runs": [setting(3, 3.0, 30), setting(4, 10.0, 7)]}).splitlines()
    assert table[0] == "| dsd/ar [95 % CI] (dsd/sd) machine | t1/t0 = 3 | t1/t0 = 10 |"
    assert table[2] == "| N = 3 | 4.00× [3.00, 5.00] (1.30× sd) m1 | - |"
    assert table[3] == "| N = 4 | - | 4.00× [3.00, 5.00] (1.30× sd) m1 … 7 of 30 pairs |"
    assert table[5] == "Machines: m1: not recorded."


@pytest.mark.parametrize("ratios", [(5.0,), (3.0, 5.0)])
def test_the_plot_draws_one_setting_and_a_grid(tmp_path: Path, ratios: tuple[float, ...]) -> None:
    """One t1/t0: every paired ratio side by side; several: one panel per ratio over t1/t0."""
    from sweep_report import plot

    runs = []
    for rep in (1, 2):
        runs += [_run("A", rep, "ar", 1.0, [1]), _run("A", rep, "sd", 2.0, [1]), _run("A", rep, "dsd", 3.0, [1])]
    settings = [{"peers": n, "ratio": r, "runs": runs, "calibration": cal(alpha=0.7), "options": {"pipeline": 2}}
                for n in (3, 4) for r in ratios]
    for s in settings:
        s["summary"] = summarize(s)
    plot({"settings_runs": settings}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_grid_plot_leaves_out_a_cell_still_running() -> None:
    """A cell with 2 of its 30 pairs is left out of the grid plot (the matrix marks it, tested above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sweep_report import _plot_over_ratio

    def setting(ratio: float, pairs: int, median: float) -> dict:
        r = {"median": median, "ci95": [median - 1, median + 1], "pairs": pairs}
        return {"peers": 8, "ratio": ratio, "options": {"problems": list(range(10)), "reps": 3},
                "summary": {"ratios": {"dsd/ar": r}, "modes": {}}}

    fig = _plot_over_ratio(plt, [setting(3.0, 30, 4.0), setting(5.0, 2, 9.0)])
    drawn = [y for line in fig.axes[0].lines for y in line.get_ydata()]
    plt.close(fig)
    assert 4.0 in drawn
    assert 9.0 not in drawn


def test_a_route_must_cross_n_peers_with_the_span_t0_was_measured_on() -> None:
    """N = 8 over 28 layers: spans of 4 and 3, t0 measured over 4; any other route would mislabel t1/t0."""
    calibration = cal(peers=8, layers_per_peer=4)

    def hops(*spans: tuple[int, int]) -> list[SimpleNamespace]:
        return [SimpleNamespace(start=a, end=b, local=False) for a, b in spans]

    even = hops((0, 4), (4, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 25), (25, 28))
    assert route_mismatch(even, calibration) is None
    lumpy = hops((0, 5), (5, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 25), (25, 28))
    assert "largest span has 5 layers, t0 was measured over 4" in route_mismatch(lumpy, calibration)
    assert "crosses 7 peers" in route_mismatch(even[:7], calibration)


def test_lever_modes_run_dsd_with_their_options_and_report_the_worst_prompt() -> None:
    from sweep_model import LEVERS, MODES, base_mode, lever_options, paired_by_prompt, per_prompt

    assert {f"dsd{s}" for s in LEVERS} <= set(MODES)
    assert base_mode("dsd-budget") == base_mode("dsd-levers") == "dsd"
    assert lever_options("dsd-deep") == {"pipeline": 3, "deep_min": 0.6} and lever_options("dsd") == {}
    assert lever_options("dsd-levers") == {"budget": True, "ready_trees": True, "pipeline": 3, "deep_min": 0.6,
                                           "fallback": True}
    runs = [{"task_id": t, "rep": rep, "mode": m, "tokens_per_s": v}
            for t, rep, m, v in (("a", 1, "sd", 1.0), ("a", 1, "dsd", 1.5), ("a", 2, "sd", 1.0), ("a", 2, "dsd", 1.3),
                                 ("b", 1, "sd", 2.0), ("b", 1, "dsd", 1.8))]
    summary = per_prompt(paired_by_prompt({"runs": runs}, "dsd", "sd"))
    assert summary["per_prompt"] == {"a": pytest.approx(1.4), "b": pytest.approx(0.9)}
    assert summary["worst_prompt"] == {"task_id": "b", "median": pytest.approx(0.9)}
