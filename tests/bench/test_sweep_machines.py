"""The sweep playing separate machines on one box: the head pinned to its own CPU with `-shared` modes re-pinned
per run (real processes, real affinities), named link profiles that fix t1, the wire codec, and every table
saying how each cell was run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import dsd_sweep  # noqa: E402
from sweep_model import base_mode, summarize  # noqa: E402
from sweep_options import SweepOptions, parse_args  # noqa: E402
from sweep_placement import Placement  # noqa: E402
from sweep_provenance import cell_machine, option_mismatch, setting_key, setting_options  # noqa: E402
from sweep_report import markdown_table  # noqa: E402

from dsd.node.peer.cpus import affinity_of, available_cpus, pin_process  # noqa: E402

TWO_CPUS = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="pinning the head apart needs two CPUs")


@pytest.mark.parametrize(("argv", "message"), [
    (["--link-profile", "home", "--ratios", "5"], "fixes the latency"),
    (["--modes", "ar,dsd,dsd-shared"], "add --pin-head"),
    (["--peers", "4", "--peer-profile", "4:home"], "peer index 4 is not in 0..3"),
    (["--peer-profile", "1:dialup"], "unknown link profile 'dialup'"),
    (["--codec", "int4"], "invalid choice: 'int4'"),
])
def test_the_command_line_refuses_what_cannot_be_run_and_says_why(argv: list[str], message: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_profile_with_its_own_latency_names_the_setting_and_t1_over_t0_is_measured() -> None:
    opts, _ = parse_args(["--peers", "4", "--link-profile", "home", "--pin-head", "--modes", "ar,sd,dsd,dsd-shared",
                          "--peer-profile", "2:continental", "--codec", "int8", "--zstd"])
    assert opts.fixed_latency_ms == 22.0 and opts.grid_ratios == [None]
    assert opts.key(4, None) == "real-N4-home-int8+zstd" and setting_key("real", 4, None, "home") == "real-N4-home"
    assert (opts.pin_head, opts.peer_profiles, opts.codec, opts.zstd) == (True, ["2:continental"], "int8", True)
    paper, _ = parse_args(["--ratios", "5"])
    assert paper.fixed_latency_ms is None and paper.grid_ratios == [5.0]
    assert paper.key(4, 5.0) == "real-N4-r5"
    assert base_mode("dsd-shared") == "dsd" and base_mode("ar-shared") == "ar"


def test_settings_from_before_these_options_resume_as_the_defaults_and_not_as_anything_else() -> None:
    """An older results file has no pin_head/link_profile/codec: it ran unpinned on paper links with exact codecs."""
    old_options = {k: v for k, v in setting_options(SweepOptions()).items()
                   if k not in ("pin_head", "link_profile", "peer_profiles", "codec", "zstd")}
    old = {"options": old_options}
    assert option_mismatch(old, SweepOptions()) == []
    assert option_mismatch(old, SweepOptions(pin_head=True)) == ["pin_head False (here True)"]
    assert option_mismatch(old, SweepOptions(codec="int8")) == ["codec 'auto' (here 'int8')"]


def test_every_table_says_where_the_head_ran_and_on_which_links() -> None:
    opts = SweepOptions(pin_head=True, link_profile="home", peer_profiles=["1:continental"], codec="bf16",
                        modes=["ar", "dsd", "dsd-shared"])
    runs = [{"task_id": t, "rep": 1, "mode": m, "tokens_per_s": tps, "tokens": [1], "new_tokens": 11,
             "elapsed_s": 2.0, "prefill_s": 1.0, "rounds": 11, "draft_rounds": 3, "drafted": 9, "accepted": 6,
             "windows_after_prefill": 10, "ready_rounds": 0, "bytes_sent": 100, "bytes_received": 100,
             "time_breakdown": {"drafting_s": 0.0, "drafting_hidden_used_s": 0.0, "drafting_hidden_wasted_s": 0.0,
                                "drafting_exposed_s": 0.0}}
            for t in ("A", "B") for m, tps in (("ar", 1.0), ("dsd", 4.0), ("dsd-shared", 3.2))]
    setting = {"key": "real-N4-home", "models": "real", "peers": 4, "ratio": 0.29, "runs": runs,
               "options": setting_options(opts),
               "calibration": {"peers": 4, "ratio": 0.29, "layers_per_peer": 7, "t0_s": 0.076, "latency_ms": 22.0,
                               "t0_window_s": {"1": 0.076, "16": 0.2}, "head_window_s": {"1": 0.02, "16": 0.05},
                               "alpha": 0.8, "alt_hit": 0.5, "draft_s_per_token": 0.03, "branch_step_s": 0.03},
               "provenance": {"commit": "c" * 40, "dirty": False, "command": "x", "load_before": [1.0] * 3,
                              "started": "2026-12-05T10:00:00", "placement": {"head_cpus": "0", "peer_cpus": "1"},
                              "machine": {"host_id": "a" * 12, "cpu_model": "CPU A", "cpu_count": 2}}}
    setting["summary"] = summarize(setting)
    assert setting["summary"]["ratios"]["dsd/dsd-shared"]["median"] == pytest.approx(1.25)
    label = "CPU A ×2 (aaaaaaaa); head on CPU 0, testnet on 1; links home, peer 1:continental; codec bf16"
    assert cell_machine(setting) == label
    tables = markdown_table({"settings_runs": [setting]}).split("\n\n")
    assert all(label in t for t in tables[:2])


@TWO_CPUS
def test_pinning_puts_the_head_and_the_testnet_on_separate_cpus_and_a_shared_mode_puts_both_everywhere() -> None:
    """Real processes: the head (this process) and a stand-in peer; the kernel's affinities are what is asserted."""
    every = available_cpus()
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        placement = Placement.plan(True)
        placement.pids = [peer.pid]
        head, rest = placement.head, placement.peers
        assert head == {min(every)} and rest == every - {min(every)}
        seen = placement.apply("dsd")
        assert set(affinity_of(os.getpid()) or []) == head and set(affinity_of(peer.pid) or []) == rest
        assert seen is not None and seen["head"] == str(min(every))
        placement.apply("dsd-shared")
        assert set(affinity_of(os.getpid()) or []) == every and set(affinity_of(peer.pid) or []) == every
        assert placement.record()["pin_head"] is True
        assert Placement.plan(False).apply("dsd") is None  # unpinned: nothing moves
    finally:
        peer.kill()
        peer.wait()
        pin_process(every)


@TWO_CPUS
def test_a_pinned_sweep_on_home_links_runs_each_mode_where_it_says_and_every_mode_gives_the_same_tokens(
        tmp_path: Path) -> None:
    """A real tiny testnet: the sweep pins the head, the testnet runs on the other CPUs with `home` links (22 ms,
    jitter, 10 Mbit/s), zstd on the wire; `dsd-shared` runs with everyone on every CPU."""
    every = available_cpus()
    results = tmp_path / "sweep.json"
    try:
        dsd_sweep.main(["--models", "tiny", "--peers", "2", "--problems", "0", "--reps", "1", "--max-new-tokens", "6",
                        "--modes", "ar,dsd,dsd-shared", "--pin-head", "--link-profile", "home", "--zstd",
                        "--results", str(results), "--state", str(tmp_path / "state")])
    finally:
        pin_process(every)
    [s] = json.loads(results.read_text())["settings_runs"]
    assert s["key"] == "tiny-N2-home-auto+zstd" and s["calibration"]["latency_ms"] == 22.0
    assert s["ratio"] == pytest.approx(22.0 / (s["calibration"]["t0_s"] * 1000), abs=1e-3)
    assert s["options"]["link_profile"] == "home" and s["options"]["zstd"] is True
    runs: dict[str, Any] = {r["mode"]: r for r in s["runs"]}
    assert set(runs) == {"ar", "dsd", "dsd-shared"} and not any("error" in r for r in runs.values())
    head, rest = str(min(every)), sorted(every - {min(every)})
    assert runs["dsd"]["cpus"]["head"] == head and runs["ar"]["cpus"]["head"] == head
    assert all(set(map(int, c.replace("-", ",").split(","))) <= set(rest) for c in runs["dsd"]["cpus"]["testnet"])
    assert runs["dsd-shared"]["cpus"]["head"] == runs["dsd-shared"]["cpus"]["testnet"][0] != head
    assert runs["dsd"]["tokens"] == runs["ar"]["tokens"] == runs["dsd-shared"]["tokens"]
    state = json.loads((tmp_path / "state" / s["key"] / "testnet.json").read_text())
    assert all(p["link"]["profile"] == "home" and p["link"]["mbit"] == 10.0 for p in state["peers"])
    assert all(p["cpus"] == rest for p in state["peers"])
    ready = [json.loads(f.read_text()) for f in (tmp_path / "state" / s["key"] / "ready").glob("peer*.json")]
    assert len(ready) == 2 and all(r["codec"] == "raw" and r["zstd"] is True for r in ready)  # --zstd reached the peers
    assert "head on CPU" in cell_machine(s) and "links home" in cell_machine(s)
