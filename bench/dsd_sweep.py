"""The DSD benchmark: ar / sd / dsd (and optionally dsd-adaptive) over an emulated WAN, with a protocol
that can be trusted.

- A prompt set fixed in advance: 10 HumanEval problems spread over the set (`PROBLEMS`), HumanEval's
  stop strings, up to 128 new tokens, greedy; modes interleaved per prompt; `--reps` (3) repetitions,
  repetitions in the outer loop so a cut-short run still covers every prompt.
- Medians with bootstrap 95 % intervals (resampling prompts) of tok/s per mode and of the paired
  speedups dsd/ar, sd/ar, dsd/sd (the runs of a pair are adjacent in time).
- Timing-model predictions from calibration done before a setting's runs only (t0 per window on the
  largest span routed, the head's own compute, the draft's step and batched branch step, and the
  draft's greedy acceptance measured on held-out prompts `CALIBRATION_PROBLEMS`).
- The engine's exact counters (drafted, accepted, ready windows, bytes read), provenance per setting and
  per stretch of it (commit, machine, step time, links, seconds run; `sweep_provenance.py`), runs set apart.

Resumable: runs already in the results file are skipped, and the file is rewritten after every prompt; a
setting resumes only with the options it started with, and with links re-set to hold its t1/t0 at the
step time measured then (the machine's speed drifts). `--merge FILE` adopts a setting another results file
completed with the same options (the grid can reuse the headline run instead of running it again).

    python bench/dsd_sweep.py --peers 4 --ratios 5                 # the headline setting (hours)
    python bench/dsd_sweep.py                                      # N in {3,4,8} x t1/t0 in {3,5,10}
    python bench/dsd_sweep.py --peers 4 --ratios 5 --modes sd-chain,sd,dsd-chain,dsd --name tree_vs_chain  # trees
    python bench/dsd_sweep.py --peers 4 --ratios 5 --modes ar,sd,dsd-serial,dsd --name pipeline  # the pipeline
    python bench/dsd_sweep.py --models tiny --problems 0,1 --reps 1 --max-new-tokens 24   # smoke test
    python bench/dsd_sweep.py --report-only --results bench/results/dsd_grid.json --merge bench/results/pipeline-2026-12-02.json
    python bench/dsd_sweep.py --results FILE.json --set-apart real-N8-r3 --rep 2 --task 32,49 --reason "tests beside it"
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness import (
    command_line,
    git_commit,
    plan_once,
    run_generation,
    run_metadata,
    testnet,
)
from sweep_model import BATCHED, CHAIN, SERIAL, base_mode, lever_options, summarize
from sweep_options import CALIBRATION_PROBLEMS, SweepOptions, parse_args
from sweep_placement import Placement
from sweep_provenance import (
    StretchClock,
    log,
    machine_record,
    merge_settings,
    now_stamp,
    option_mismatch,
    set_apart,
    setting_options,
)
from sweep_report import markdown_table, write_outputs
from sweep_setup import (
    Workload,
    check_pass,
    load_models,
    measure_acceptance,
    measure_branch_step,
    measure_draft_step,
    measure_head_table,
    measure_step_table,
)

from dsd.node.head.verify import cut_at_stop
from dsd.node.testnet.workload import HUMANEVAL_STOPS


def cut_completion(text: str, stops: Sequence[str] = HUMANEVAL_STOPS) -> str:
    """The completion up to (not including) the first stop sequence, as HumanEval scores it."""
    return cut_at_stop(text, stops)[0]


# --- calibration (before the runs) ---------------------------------------------------------------


def calibrate(opts: SweepOptions, peers: int, ratio: float | None, target: Path, setup: Any, workload: Workload,
              acceptance: dict[str, Any]) -> dict[str, Any]:
    """Everything the timing model needs, measured before the setting's testnet starts; `ratio` None: the link
    profile fixes t1, and t1/t0 is what t0 makes of it."""
    from dsd.node.testnet.calibrate import measure_t0
    from dsd.shard_store import Store

    store = Store(target)
    layers = math.ceil(store.num_layers / peers)  # the largest span of an even split is the one routed slowest
    weights = None if opts.weights == "auto" else opts.weights
    t0 = measure_t0(store, layers, weights=weights)
    prompt = workload.ids(workload.problems[0])
    latency = opts.fixed_latency_ms if ratio is None else link_latency_ms(ratio, t0)
    assert latency is not None
    cal = {
        "peers": peers, "ratio": round(latency / (t0 * 1000), 3) if ratio is None else ratio, "layers_per_peer": layers,
        "t0_s": t0,
        "t0_window_s": {str(k): v for k, v in measure_step_table(store, layers, weights=weights).items()},
        "head_window_s": {str(k): v for k, v in measure_head_table(setup.head).items()},
        "latency_ms": latency,
        "draft_s_per_token": measure_draft_step(setup.drafter, prompt),
        "branch_step_s": measure_branch_step(setup.drafter, prompt),
        **acceptance,
    }
    log(f"[N={peers} t1/t0={cal['ratio']:g}] t0 {t0 * 1000:.1f} ms over {layers} layers, t1 {cal['latency_ms']:.1f} ms, "
        f"draft {cal['draft_s_per_token'] * 1000:.1f} ms/token, branch step {cal['branch_step_s'] * 1000:.1f} ms, "
        f"α {cal['alpha']:.2f}, alt hit {cal['alt_hit']:.2f}")
    return cal


# --- runs -----------------------------------------------------------------------------------------


async def run_prompt(swarm: Any, legs: Any, hops: list[Any], setup: Any, workload: Workload, problem: dict[str, Any],
                     rep: int, opts: SweepOptions, eos: frozenset[int], placement: Placement | None = None,
                     ) -> list[dict[str, Any]]:
    """Every mode in turn on one prompt over the same route, each placed as `placement` says (a `-shared` mode:
    the head on every CPU); a failure is recorded with its mode and ends the prompt."""
    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.sampling import SamplingParams
    from dsd.protocol import WireFormat

    real = opts.models == "real"  # random tiny models write no code: no stop strings, no pass@1
    prompt = workload.ids(problem)
    out: list[dict[str, Any]] = []
    wire = WireFormat(opts.codec, opts.zstd)  # auto: the head's compute dtype's codec, as without one
    for mode in opts.modes:
        options = {
            "pipeline": 1 if mode.endswith(SERIAL) else opts.pipeline, "ahead_alone": not mode.endswith(BATCHED),
            **lever_options(mode),
        }
        cfg = GenerationConfig(
            mode=base_mode(mode), max_new_tokens=opts.max_new_tokens, params=SamplingParams(), eos_ids=eos,
            stop_strings=HUMANEVAL_STOPS if real else (), tau_max=opts.tau_max if mode == "dsd-adaptive" else 0.0,
            branches=opts.branches, tree_nodes=0 if mode.endswith(CHAIN) else opts.tree_nodes, **options,
        )
        mode_setup = replace(setup, drafter=None) if base_mode(mode) == "ar" else setup
        if mode_setup.drafter is not None:
            mode_setup.drafter.reset()  # no mode inherits another's draft cache
        run: dict[str, Any] = {"task_id": problem["task_id"], "rep": rep, "mode": mode, "prompt_tokens": len(prompt)}
        if placement is not None and (cpus := placement.apply(mode)) is not None:
            run["cpus"] = cpus
        try:
            report = await run_generation(swarm, legs, mode_setup, prompt, cfg, hops, workload.tokenizer, wire=wire)
            run.update(report.as_dict())
            run["mode"] = mode  # the benchmark's mode (sd-chain), not the engine's (sd)
        except Exception as exc:  # e.g. a peer failed; recorded, not fatal to the sweep
            run["error"] = f"{type(exc).__name__}: {exc}"
            out.append(run)
            log(f"  {problem['task_id']:14s} rep {rep} {mode:13s} FAILED {run['error'][:200]}")
            break
        text = workload.text(run["tokens"])
        if text is not None:
            run["text"] = text
            if real:
                run["completion"] = cut_completion(text)
                run["passed"], run["result"] = check_pass(problem, run["completion"], opts.exec_timeout)
        out.append(run)
        log(f"  {problem['task_id']:14s} rep {rep} {mode:13s} {run['new_tokens']:3d} tok {run['tokens_per_s']:6.2f} tok/s "
            f"rounds {run['rounds']:3d} k̄ {run['mean_accepted']:.2f} ready {run['ready_share']:.2f} "
            f"nodes {run['mean_tree_nodes']:.1f} trees {run['tree_windows']}"
            + (f" pass={run['passed']}" if "passed" in run else ""))
    return out


def link_latency_ms(ratio: float, t0_s: float) -> float:
    """The one-way link latency t1 (ms) that makes t1/t0 = `ratio` for a measured step time t0."""
    return ratio * t0_s * 1000


def route_mismatch(hops: Sequence[Any], cal: dict[str, Any]) -> str | None:
    """Why a planned route does not match the setting's calibration, or None: the route must cross N peers
    and its largest span must be the one t0 was measured on, or the run's t1/t0 is not the setting's."""
    spans = [h.end - h.start for h in hops if not getattr(h, "local", False)]
    if len(spans) != cal["peers"]:
        return f"the route crosses {len(spans)} peers, the setting is N = {cal['peers']}"
    if max(spans) != cal["layers_per_peer"]:
        return (f"the route's largest span has {max(spans)} layers, t0 was measured over {cal['layers_per_peer']}: "
                "t1/t0 would not be the setting's")
    return None


def run_setting_todo(opts: SweepOptions, setting: dict[str, Any], workload: Workload) -> list[tuple[int, dict[str, Any]]]:
    """The (rep, prompt) pairs a setting still lacks: never run, or ended by a failed run."""
    failed = {(r["rep"], r["task_id"]) for r in setting["runs"] if "error" in r}
    done = {(r["rep"], r["task_id"]) for r in setting["runs"]} - failed
    return [(rep, p) for rep in range(1, opts.reps + 1) for p in workload.problems if (rep, p["task_id"]) not in done]


def run_setting(opts: SweepOptions, setting: dict[str, Any], target: Path, setup: Any, workload: Workload,
                eos: frozenset[int], save: Any, *, fresh: bool = False, placement: Placement | None = None) -> None:
    """One (N, t1/t0) setting: start the testnet (on `placement.peers` when the head is pinned), run the missing
    (rep, prompt) pairs in every mode, stop it. Not `fresh` (calibrated by an earlier process): a new stretch,
    its machine and step time recorded."""
    import trio

    from dsd.node.peer.generation import swarm_watch
    from dsd.node.peer.host import head_node
    from dsd.node.testnet.link_profiles import build_link

    cal, prov = setting["calibration"], setting["provenance"]
    todo = run_setting_todo(opts, setting, workload)
    if not todo:
        return
    if diff := option_mismatch(setting, opts):
        raise SystemExit(f"setting {setting['key']} started with other options: {'; '.join(diff)}; "
                         "rerun with those, or write to another --results file")
    latency_ms, record = cal["latency_ms"], prov
    if not fresh:  # a setting started earlier: the machine (or its speed) may have changed since its calibration
        from dsd.node.testnet.calibrate import measure_t0
        from dsd.shard_store import Store

        t0_now = measure_t0(Store(target), cal["layers_per_peer"], weights=None if opts.weights == "auto" else opts.weights)
        if opts.fixed_latency_ms is None:
            latency_ms = link_latency_ms(cal["ratio"], t0_now)  # hold the setting's t1/t0, not its t1
        record = {"commit": git_commit(), "load_before": os.getloadavg(), "started": now_stamp(), "t0_s": t0_now,
                  "latency_ms": latency_ms, "machine": machine_record()}
        prov.setdefault("resumed", []).append(record)
        log(f"  resuming: t0 {t0_now * 1000:.1f} ms now, {cal['t0_s'] * 1000:.1f} ms at calibration; links "
            f"{latency_ms:.0f} ms (were {cal['latency_ms']:.0f})"
            + (f" so t1/t0 stays {cal['ratio']:g}" if opts.fixed_latency_ms is None else f" ({opts.link_profile})"))
    stretch, clock = len(prov.get("resumed", [])), StretchClock(setting, record)
    again = {(rep, p["task_id"]) for rep, p in todo}  # a failed prompt runs again in every mode; its failure is kept
    setting["failed"] = setting.get("failed", []) + [r for r in setting["runs"] if "error" in r]
    setting["runs"] = [r for r in setting["runs"] if (r["rep"], r["task_id"]) not in again]
    placement = placement or Placement.plan(opts.pin_head)
    record["placement"] = placement.record()
    with testnet(target, cal["peers"], latency_ms, opts.state / setting["key"], link_profile=opts.link_profile,
                 peer_profiles=opts.peer_profiles, peer_cpus=placement.peers, codec=opts.codec, zstd=opts.zstd,
                 weights=opts.weights) as state:
        log(f"  testnet up in {state.up_seconds:.1f} s; {len(todo)} prompt runs to go")
        placement.pids = [p.pid for p in state.peers]

        async def main() -> None:
            async with head_node([state.bootstrap], build_link(opts.link_profile, latency_ms)) as (node, legs):
                hops = await plan_once(node, setup.model_id, setup.num_layers)
                if why := route_mismatch(hops, cal):
                    raise SystemExit(f"setting {setting['key']}: {why}")
                setting["route"] = [[h.start, h.end] for h in hops]
                swarm = swarm_watch(node, setup)
                for rep, problem in todo:
                    runs = await run_prompt(swarm, legs, hops, setup, workload, problem, rep, opts, eos, placement)
                    setting["runs"].extend({**r, "stretch": stretch} for r in runs)
                    setting["summary"] = summarize(setting)
                    prov["load_after"] = os.getloadavg()
                    clock.tick()
                    save()

        trio.run(main)
    clock.tick()


def new_setting(opts: SweepOptions, peers: int, ratio: float | None, command: str, target: Path, setup: Any,
                workload: Workload, acceptance: dict[str, Any]) -> dict[str, Any]:
    """A setting calibrated and ready to run; `ratio` None: the link profile fixes t1 (t1/t0 as measured)."""
    load_before = os.getloadavg()
    commit = git_commit()
    started = now_stamp()
    cal = calibrate(opts, peers, ratio, target, setup, workload, acceptance)
    return {
        "key": opts.key(peers, ratio), "models": opts.models, "peers": peers,
        "ratio": cal["ratio"],
        "provenance": {"commit": commit.removesuffix("+dirty"), "dirty": commit.endswith("+dirty"), "command": command,
                       "load_before": load_before, "started": started, "machine": machine_record()},
        "options": setting_options(opts),
        "calibration": cal,
        "runs": [],
    }


# --- the sweep -----------------------------------------------------------------------------------


def run_sweep(opts: SweepOptions, command: str) -> dict[str, Any]:
    """Run what the results file does not hold yet, writing the outputs after every prompt; returns the results."""
    import torch

    placement = Placement.plan(opts.pin_head)
    placement.pin_head()  # before anything is measured: calibration times the head where it will run
    torch.set_num_threads(1)
    stem = opts.stem
    path = stem.with_suffix(".json")
    results: dict[str, Any] = {**run_metadata(opts.name), "settings_runs": []}
    if path.exists():
        results["settings_runs"] = json.loads(path.read_text()).get("settings_runs", [])
        log(f"resuming {path}: {len(results['settings_runs'])} settings started")
    merge_settings(results, opts)
    opts.state.mkdir(parents=True, exist_ok=True)
    target, setup, tokenizer, eos = load_models(opts.models, opts.state, opts.draft_quant, opts.weights)
    workload = Workload(opts.models, opts.problems, tokenizer)
    held_out = Workload(opts.models, list(CALIBRATION_PROBLEMS), tokenizer)
    acceptance: dict[str, Any] | None = None
    by_key = {s["key"]: s for s in results["settings_runs"]}
    for n in opts.peers:
        for ratio in opts.grid_ratios:
            key = opts.key(n, ratio)
            setting = by_key.get(key)
            fresh = setting is None
            if fresh:
                if acceptance is None:
                    acceptance = measure_acceptance(target, setup.drafter.model, held_out, held_out.problems)
                setting = new_setting(opts, n, ratio, command, target, setup, workload, acceptance)
                results["settings_runs"].append(setting)
            elif not run_setting_todo(opts, setting, workload):
                continue  # complete: its provenance stays as it finished
            run_setting(opts, setting, target, setup, workload, eos, lambda: write_outputs(results, stem), fresh=fresh,
                        placement=placement)
            setting["provenance"]["finished"] = now_stamp()
            write_outputs(results, stem)
            for ratio_name, r in setting.get("summary", {}).get("ratios", {}).items():
                log(f"  => {ratio_name}: median {r['median']:.2f}x  95% CI [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] "
                    f"over {r['pairs']} pairs")
    write_outputs(results, stem)
    log(f"wrote {path}, {stem.with_suffix('.md')}, {stem.with_suffix('.png')}")
    return results


def rebuild_report(opts: SweepOptions) -> dict[str, Any]:
    """Recompute the summaries, table and plot of a results file from its raw runs (and `--merge`); run nothing."""
    stem = opts.stem
    path = stem.with_suffix(".json")
    if not path.exists():
        raise SystemExit(f"--report-only: no results file {path}")
    results = json.loads(path.read_text())
    merge_settings(results, opts)
    for s in results["settings_runs"]:
        s["summary"] = summarize(s) if s["runs"] else {}
    write_outputs(results, stem)
    return results


def set_apart_runs(opts: SweepOptions, key: str, reason: str, reps: Sequence[int], tasks: Sequence[str]) -> dict[str, Any]:
    """`--set-apart`: move a setting's chosen runs out of its medians with the reason (`set_apart`), recompute its
    summary and rewrite the outputs; the sweep runs those prompts again when it resumes."""
    path = opts.stem.with_suffix(".json")
    if not path.exists():
        raise SystemExit(f"--set-apart: no results file {path}")
    results = json.loads(path.read_text())
    by_key = {s["key"]: s for s in results["settings_runs"]}
    if key not in by_key:
        raise SystemExit(f"--set-apart: {path.name} has no setting {key} (it has {', '.join(by_key)})")
    setting = by_key[key]
    try:
        entry = set_apart(setting, reason, reps=reps, tasks=tasks, commit=git_commit(), when=now_stamp())
    except ValueError as exc:
        raise SystemExit(f"--set-apart: {exc}") from None
    setting["summary"] = summarize(setting) if setting["runs"] else {}
    write_outputs(results, opts.stem)
    log(f"set apart {len(entry['runs'])} runs of {key} ({reason}); their prompts run again when the sweep resumes")
    return results


# --- CLI -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    opts, args = parse_args(argv, __doc__)
    if args.set_apart is not None:
        results = set_apart_runs(opts, args.set_apart, args.reason, args.rep, args.task)
    elif args.report_only:
        results = rebuild_report(opts)
    else:
        results = run_sweep(opts, command_line("dsd_sweep.py", argv if argv is not None else sys.argv[1:]))
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
