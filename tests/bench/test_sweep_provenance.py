"""A sweep's provenance and statistics that can be trusted: runs set apart by a command with their reason, wall
time kept across stretches, each cell's machine, bootstrap bounds printed to their stable digits, and t1/t0 as
the `ar` rounds measured it."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import dsd_sweep  # noqa: E402
import sweep_provenance  # noqa: E402
from dsd_sweep import run_setting, set_apart_runs  # noqa: E402
from sweep_model import bootstrap_interval, effective_ratio, summarize  # noqa: E402
from sweep_options import SweepOptions, parse_args  # noqa: E402
from sweep_provenance import (  # noqa: E402
    StretchClock,
    cell_machine,
    set_apart,
    set_apart_groups,
    stretches_table,
)
from sweep_report import fmt_interval, markdown_table, stable_decimals, write_outputs  # noqa: E402

CPU_A = {"host_id": "a" * 12, "cpu_model": "CPU A", "cpu_count": 2}
CPU_B = {"host_id": "b" * 12, "cpu_model": "CPU B", "cpu_count": 4}


def cal(**over: Any) -> dict[str, Any]:
    base = {"peers": 4, "ratio": 3.0, "layers_per_peer": 7, "t0_s": 0.1, "latency_ms": 300.0,
            "t0_window_s": {"1": 0.1, "16": 0.2}, "head_window_s": {"1": 0.02, "16": 0.05},
            "alpha": 0.8, "alt_hit": 0.5, "draft_s_per_token": 0.05, "branch_step_s": 0.05}
    return {**base, **over}


def run(task: str, rep: int, mode: str, tps: float = 1.0, *, round_s: float = 1.0, **extra: Any) -> dict[str, Any]:
    """A run with the counters the summary reads; its decoding rounds take `round_s` each (10 after a 1 s prompt)."""
    return {"task_id": task, "rep": rep, "mode": mode, "tokens_per_s": tps, "tokens": [1], "new_tokens": 11,
            "elapsed_s": 1.0 + 10 * round_s, "prefill_s": 1.0, "rounds": 11, "draft_rounds": 0 if mode == "ar" else 3,
            "drafted": 0 if mode == "ar" else 9, "accepted": 0 if mode == "ar" else 6, "windows_after_prefill": 10,
            "ready_rounds": 0, "bytes_sent": 100, "bytes_received": 100,
            "time_breakdown": {"drafting_s": 0.0, "drafting_hidden_used_s": 0.0, "drafting_hidden_wasted_s": 0.0,
                               "drafting_exposed_s": 0.0}, **extra}


def setting(runs: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    return {"key": "real-N4-r3", "models": "real", "peers": 4, "ratio": 3.0, "calibration": cal(), "runs": runs,
            "options": {"problems": [0, 1], "modes": ["ar", "sd", "dsd"], "reps": 2, "pipeline": 2},
            "provenance": {"commit": "c" * 40, "dirty": False, "command": "x", "load_before": [1.0, 1.0, 1.0],
                           "started": "2026-12-03T14:05:09"}, **over}


def grid_runs() -> list[dict[str, Any]]:
    return [run(t, rep, m, 1.0 if m == "ar" else 2.0 + rep) for t in ("HumanEval/0", "HumanEval/32")
            for rep in (1, 2) for m in ("ar", "sd", "dsd")]


# --- runs set apart ---------------------------------------------------------------------------------


def test_set_apart_moves_the_chosen_prompts_every_mode_with_the_reason_and_the_summary_leaves_them_out() -> None:
    s = setting(grid_runs())
    entry = set_apart(s, "network tests ran beside it", reps=[2], tasks=["32"], commit="d" * 40, when="2026-12-03T15:12:00")
    assert [r["mode"] for r in entry["runs"]] == ["ar", "sd", "dsd"]
    assert {(r["task_id"], r["rep"]) for r in entry["runs"]} == {("HumanEval/32", 2)}
    assert entry["reason"] == "network tests ran beside it" and entry["commit"] == "d" * 40
    assert entry["when"] == "2026-12-03T15:12:00" and entry["selection"] == {"reps": [2], "tasks": ["HumanEval/32"]}
    assert len(s["runs"]) == 9 and s["discarded"] == [entry]
    summ = summarize(s)
    assert summ["ratios"]["sd/ar"]["pairs"] == 3
    assert summ["set_apart"] == [{"reason": "network tests ran beside it", "when": "2026-12-03T15:12:00",
                                  "commit": "d" * 40, "runs": 3}]
    with pytest.raises(ValueError, match="needs a reason"):
        set_apart(s, " ", reps=[1], commit="d", when="w")
    with pytest.raises(ValueError, match="no run of real-N4-r3"):
        set_apart(s, "again", reps=[2], tasks=["HumanEval/32"], commit="d", when="w")


def test_hand_made_discarded_runs_of_older_files_are_read_as_groups_by_reason() -> None:
    """The grid's N = 4, t1/t0 = 3 cell was set apart by hand: each run carries its reason, no time or commit."""
    old = [{**run("HumanEval/32", 1, m), "reason": "tests at 14:15"} for m in ("ar", "sd")]
    old.append({**run("HumanEval/49", 2, "ar"), "reason": "tests at 15:09"})
    s = setting(grid_runs(), discarded=old)
    set_apart(s, "new reason", reps=[1], tasks=["HumanEval/0"], commit="d" * 40, when="2026-12-05T10:00:00")
    groups = set_apart_groups(s)
    assert [(g["reason"], len(g["runs"]), g["when"]) for g in groups] == [
        ("tests at 14:15", 2, None), ("tests at 15:09", 1, None), ("new reason", 3, "2026-12-05T10:00:00")]
    assert [g["runs"] for g in summarize(s)["set_apart"]] == [2, 1, 3]


def test_the_set_apart_command_rewrites_the_results_and_the_report_says_how_many_and_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(dsd_sweep, "git_commit", lambda: "e" * 40)
    path = tmp_path / "grid.json"
    s = setting(grid_runs())
    s["summary"] = summarize(s)
    path.write_text(json.dumps({"name": "grid", "date": "d", "settings_runs": [s]}))
    assert dsd_sweep.main(["--results", str(path), "--set-apart", "real-N4-r3", "--rep", "1",
                           "--reason", "a backup ran beside it"]) == 0
    stored = json.loads(path.read_text())["settings_runs"][0]
    assert {r["rep"] for r in stored["runs"]} == {2} and len(stored["discarded"][0]["runs"]) == 6
    assert stored["summary"]["ratios"]["sd/ar"]["pairs"] == 2
    assert "6 runs set apart on " in (tmp_path / "grid.md").read_text()
    assert "(eeeeeeeeeeee): a backup ran beside it" in (tmp_path / "grid.md").read_text()
    assert "| 2 | 6 |" in capsys.readouterr().out  # the table's pairs, then runs set apart
    with pytest.raises(SystemExit, match="has no setting real-N8-r3"):
        set_apart_runs(SweepOptions(results=path), "real-N8-r3", "why", [1], [])


@pytest.mark.parametrize("argv", [
    ["--results", "r.json", "--set-apart", "real-N4-r3", "--rep", "1"],                     # no reason
    ["--results", "r.json", "--set-apart", "real-N4-r3", "--reason", "why"],                # no runs chosen
    ["--results", "r.json", "--set-apart", "real-N4-r3", "--rep", "1", "--all-runs", "--reason", "why"],
    ["--set-apart", "real-N4-r3", "--all-runs", "--reason", "why"],                         # no --results
    ["--rep", "2"],                                                                         # not setting apart
])
def test_set_apart_needs_a_results_file_a_reason_and_a_choice_of_runs(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


# --- stretches: wall time and machines -----------------------------------------------------------------


def test_the_stretch_clock_adds_each_stretch_to_wall_s_at_every_save() -> None:
    now = [0.0]
    s = setting([])
    first = StretchClock(s, s["provenance"], clock=lambda: now[0])
    now[0] = 10.0
    first.tick()
    now[0] = 25.0
    first.tick()  # then the process is killed: nothing runs at the end of the setting
    resumed = {"started": "later"}
    s["provenance"]["resumed"] = [resumed]
    now[0] = 1000.0
    second = StretchClock(s, resumed, clock=lambda: now[0])
    now[0] = 1007.5
    second.tick()
    assert s["wall_s"] == 32.5 and s["provenance"]["stretch_s"] == 25.0 and resumed["stretch_s"] == 7.5


class Killed(Exception):
    pass


def test_a_setting_killed_mid_stretch_and_resumed_on_another_host_keeps_both_stretches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Run two prompts, die in the third; resume from the file last saved: wall_s holds both stretches, each run
    names its stretch, the resume records its machine, and the tables say the cell ran on several hosts."""
    import dsd.node.peer.generation
    import dsd.node.peer.host
    import dsd.node.testnet.calibrate
    import dsd.shard_store

    now = [0.0]
    kill_at: list[str] = ["HumanEval/2"]

    @contextlib.contextmanager
    def testnet(target: Path, peers: int, latency_ms: float, state: Path, **links: Any) -> Iterator[SimpleNamespace]:
        yield SimpleNamespace(up_seconds=0.0, bootstrap="b", peers=[])

    @contextlib.asynccontextmanager
    async def head_node(bootstrap: list[str], links: Any) -> AsyncIterator[tuple[None, None]]:
        yield None, None

    async def plan_once(node: Any, model_id: str, layers: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(start=a, end=a + 7, local=False) for a in (0, 7, 14, 21)]

    async def run_prompt(swarm: Any, legs: Any, hops: Any, setup: Any, workload: Any, problem: dict[str, Any],
                         rep: int, opts: SweepOptions, eos: frozenset[int], placement: Any = None) -> list[dict[str, Any]]:
        now[0] += 10.0
        if problem["task_id"] in kill_at:
            raise Killed
        return [run(problem["task_id"], rep, m) for m in opts.modes]

    monkeypatch.setattr(sweep_provenance, "monotonic", lambda: now[0])
    monkeypatch.setattr(sweep_provenance, "machine_info", lambda: CPU_B)
    monkeypatch.setattr(dsd.node.testnet.calibrate, "measure_t0", lambda store, layers, weights=None: 0.1)
    monkeypatch.setattr(dsd.shard_store, "Store", lambda path: None)
    monkeypatch.setattr(dsd.node.peer.host, "head_node", head_node)
    monkeypatch.setattr(dsd.node.peer.generation, "swarm_watch", lambda node, setup: None)
    monkeypatch.setattr(dsd_sweep, "testnet", testnet)
    monkeypatch.setattr(dsd_sweep, "plan_once", plan_once)
    monkeypatch.setattr(dsd_sweep, "run_prompt", run_prompt)
    opts = SweepOptions(modes=["ar", "sd"], reps=1, problems=[0, 1, 2])
    workload = SimpleNamespace(problems=[{"task_id": f"HumanEval/{i}"} for i in (0, 1, 2)])
    setup = SimpleNamespace(model_id="m", num_layers=28)
    s = setting([], options=sweep_provenance.setting_options(opts))
    s["provenance"]["machine"] = CPU_A
    saved: list[str] = []
    with pytest.raises(Killed):
        run_setting(opts, s, Path("store"), setup, workload, frozenset(), lambda: saved.append(json.dumps(s)), fresh=True)
    s = json.loads(saved[-1])  # what the file held when the process died
    assert s["wall_s"] == 20.0 and len(s["runs"]) == 4
    now[0], kill_at[:] = 5000.0, []
    run_setting(opts, s, Path("store"), setup, workload, frozenset(), lambda: None)
    assert s["wall_s"] == 30.0 and s["provenance"]["stretch_s"] == 20.0 and s["provenance"]["resumed"][0]["stretch_s"] == 10.0
    assert [r["stretch"] for r in s["runs"]] == [0, 0, 0, 0, 1, 1]
    assert s["provenance"]["resumed"][0]["machine"] == CPU_B
    machine = "several: CPU A ×2 (aaaaaaaa); CPU B ×4 (bbbbbbbb)"
    assert cell_machine(s) == machine
    s["summary"] = summarize(s)
    tables = markdown_table({"settings_runs": [s]}).split("\n\n")
    assert all(f"| {machine} |" in t for t in tables[:2])
    rows = stretches_table({"settings_runs": [s]}).splitlines()
    assert rows[2].startswith("| real-N4-r3 | start | 2026-12-03 14:05 |") and "| CPU A ×2 (aaaaaaaa) | 20 |" in rows[2]
    assert rows[3].startswith("| real-N4-r3 | resume 1 |") and rows[3].endswith("| 100.0 | 300 | CPU B ×4 (bbbbbbbb) | 10 |")


def test_a_cells_machine_is_one_host_several_or_not_recorded() -> None:
    s = setting([])
    assert cell_machine(s) == "not recorded"
    s["provenance"]["resumed"] = [{"started": "x", "machine": CPU_A}]
    assert cell_machine(s) == "CPU A ×2 (aaaaaaaa) (1 of 2 stretches not recorded)"
    s["provenance"]["machine"] = CPU_A
    assert cell_machine(s) == "CPU A ×2 (aaaaaaaa)"


def test_the_report_of_an_older_file_says_machines_were_not_recorded(tmp_path: Path) -> None:
    s = setting(grid_runs())
    s["provenance"]["resumed"] = [{"commit": "f" * 40, "started": "2026-12-03T15:32:56"}]  # no t0: an older resume
    s["summary"] = summarize(s)
    write_outputs({"name": "grid", "date": "d", "settings_runs": [s]}, tmp_path / "grid")
    text = (tmp_path / "grid.md").read_text()
    assert "| real-N4-r3 | resume 1 | 2026-12-03 15:32 | not recorded | fffffff | - | - | not recorded | not recorded |" in text
    assert "Machines: m1: not recorded." in text


# --- statistics --------------------------------------------------------------------------------------


def test_bounds_are_printed_only_to_the_digits_their_monte_carlo_error_leaves_stable() -> None:
    assert [stable_decimals(e) for e in (0.0, 0.004, 0.01, 0.03, 0.1, 0.3, 0.9)] == [2, 2, 2, 1, 1, 0, 0]
    assert fmt_interval(2.3456, 8.1234, [0.004, 0.3]) == "[2.35, 8]"
    assert fmt_interval(2.3456, 8.1234, [0.06, 0.0]) == "[2.3, 8.12]"
    assert fmt_interval(2.3456, 8.1234, None) == "[2.35, 8.12]"  # summaries from before errors were kept


def test_the_monte_carlo_band_holds_the_bounds_other_seeds_give() -> None:
    """Lumpy data (10 prompts, 3 repetitions): each seed's bound lies within the bands of seed 0's, and printed
    to its stable digits every seed's bound reads the same up to one unit of its last digit."""
    groups = [[1.0 + 0.37 * i + 0.05 * j + (0.9 if i == 3 else 0.0) for j in range(3)] for i in range(10)]
    runs = [bootstrap_interval(groups, seed=seed) for seed in range(12)]
    med, lo, hi, lo_err, hi_err = runs[0]
    assert lo < med < hi
    for _, lo2, hi2, lo2_err, hi2_err in runs[1:]:
        assert abs(lo2 - lo) <= lo_err + lo2_err + 1e-9 and abs(hi2 - hi) <= hi_err + hi2_err + 1e-9
        for x, y, err in ((lo, lo2, max(lo_err, lo2_err)), (hi, hi2, max(hi_err, hi2_err))):
            d = stable_decimals(err)
            assert abs(round(x, d) - round(y, d)) <= 10.0**-d + 1e-9


def test_effective_t1_over_t0_from_the_ar_rounds_hand_computed() -> None:
    """N = 4, t0 = 100 ms, links 300 ms (nominal 3), h(1) = 20 ms: the model's ar round is 5·0.3 + 4·0.1 + 0.02
    = 1.92 s. A round of 2.42 s has 0.5 s more: on the links t1_eff = (2.42 − 0.42)/5 = 0.4 s, 4.0·t0; on the
    peers t0_eff = (2.42 − 1.5 − 0.02)/4 = 0.225 s, t1/t0_eff = 1.33. A resumed stretch twice as slow (t0 200 ms,
    links 600 ms) with the model's round, 5·0.6 + 2·0.42 = 3.84 s, reads exactly 3 both ways."""
    exact = effective_ratio(setting([run("A", 1, "ar", round_s=1.92)]))
    assert exact["t1_eff_over_t0"] == pytest.approx([3.0, 3.0]) and exact["t1_over_t0_eff"] == pytest.approx([3.0, 3.0])
    assert exact["model_round_s"] == pytest.approx(1.92) and exact["nominal"] == 3.0
    slow = effective_ratio(setting([run("A", 1, "ar", round_s=2.42), run("A", 1, "sd", round_s=0.1)]))
    assert slow["t1_eff_over_t0"] == pytest.approx([4.0, 4.0])
    assert slow["t1_over_t0_eff"] == pytest.approx([0.3 / 0.225] * 2)
    assert slow["round_s"] == pytest.approx(2.42) and slow["ar_runs"] == 1
    assert "| 4.0; 1.3 |" in markdown_table({"settings_runs": [{**setting([]), "summary": {"effective_ratio": slow}}]})
    resumed = setting([run("A", 1, "ar", round_s=3.84, stretch=1)])
    resumed["provenance"]["resumed"] = [{"started": "x", "t0_s": 0.2, "latency_ms": 600.0}]
    eff = effective_ratio(resumed)
    assert eff["t1_eff_over_t0"] == pytest.approx([3.0, 3.0]) and eff["t1_over_t0_eff"] == pytest.approx([3.0, 3.0])
    assert eff["runs_placed_in_stretches"] == 1
    # An older file's run of 1.92 s, its stretch unknown: read in the first it is 3 both ways; in the resumed one
    # t1_eff = (1.92 − 2·0.42)/5 = 0.216 s, 1.08·t0 then, and its round is shorter than its links (no t0_eff).
    del resumed["runs"][0]["stretch"]
    resumed["runs"][0]["elapsed_s"] = 1.0 + 10 * 1.92
    eff = effective_ratio(resumed)
    assert eff["t1_eff_over_t0"] == pytest.approx([1.08, 3.0]) and eff["t1_over_t0_eff"] is None
    assert "| 1.1–3.0; - |" in markdown_table({"settings_runs": [{**resumed, "summary": {"effective_ratio": eff}}]})
