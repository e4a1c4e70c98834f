"""Audits on a live local swarm (issue 37): how many windows a liar survives, and what auditing costs.

`detect`: a testnet of `--peers` block peers in two spans (half replicas each), peer 0 lying on purpose
(`testnet up --faulty 0:MODE`, restarted per mode). Per (mode, audit rate, seed), a head generates greedily (dsd,
n-gram drafts) over the route [liar 0:L/2, an honest L/2:L], prompt number `seed` of the fixed HumanEval set,
with the audit's choices drawn from `seed`, until an audit fails (windows to detection: the audited window's
number) or `--max-new-tokens` are made (censored). The blamed peer is checked to be the liar. `honest` (no fault)
counts false alarms over the same runs.

`overhead`: an honest testnet; per prompt and repetition, the same generation (dsd, the default draft model) with
`--audit-rate 0` and with the default rate, interleaved; tok/s paired per prompt (rate/none), median and spread.
The replicas that audit share this machine's cores with the route and the head: on separate machines an audit
costs the head nothing but the replica route's bytes, so this is an upper bound.

    python bench/integrity.py detect --model real --out bench/results/integrity-detect-real-DATE.json
    python bench/integrity.py overhead --model real --out bench/results/integrity-overhead-real-DATE.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio
from harness import (
    RESULTS_DIR,
    comma_list,
    command_line,
    percentile,
    run_metadata,
    testnet,
    today,
    write_json,
)
from soak import PROBLEMS, load_models

MODES = ("honest", "noise", "skip-layer", "identity", "stale", "int4", "intermittent:0.3")
RATES = (0.1, 0.5)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def audited_run(bootstrap: str, setup: Any, prompt: list[int], cfg: Any, hops: list[Any] | None,
                      audit: Any) -> dict[str, Any]:
    """One generation from a fresh head over `hops`, audited as `audit` says, stopped at the first failed audit
    (not regenerated): what the audits saw, and the failure if any."""
    from dsd.discovery.swarm import SwarmWatch
    from dsd.node.head.generation import generate
    from dsd.node.head.report import GenerationFailed
    from dsd.node.peer.host import head_node
    from dsd.node.route.audit import AuditFailure, AuditLedger
    from dsd.node.route.open import open_route

    ledger = AuditLedger(audit)
    async with head_node([bootstrap]) as (node, legs):
        watch = SwarmWatch(node, setup.model_id, setup.num_layers)
        t0 = time.perf_counter()
        try:
            async with open_route(node, legs, watch, setup.head, max_len=cfg.session_len(len(prompt)), hops=hops,
                                  audits=ledger) as backend:
                report = await generate(backend, setup.drafter, cfg, prompt)
            tokens, failure, route = report.tokens, None, report.transport.route
        except GenerationFailed as exc:
            tokens, route = exc.tokens, getattr(exc.transport, "route", [])
            failure = exc.failure.as_dict() if isinstance(exc.failure, AuditFailure) else {"error": str(exc)}
        seconds = time.perf_counter() - t0
    return {"tokens": len(tokens), "seconds": round(seconds, 3), "tok_s": round(len(tokens) / seconds, 4),
            "audits": ledger.as_dict(), "banned": ledger.banned, "failure": failure, "route": list(route)}


def detect_main(argv: list[str]) -> int:
    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import NgramDrafter
    from dsd.node.head.setup import HeadSetup
    from dsd.node.route.audit import AuditOptions
    from dsd.protocol import Hop
    from dsd.shard_store import Store

    p = argparse.ArgumentParser(prog="integrity.py detect", description=__doc__)
    p.add_argument("--model", choices=("tiny", "real"), default="real")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rates", default=",".join(map(str, RATES)))
    p.add_argument("--seeds", type=int, default=5, help="runs per (mode, rate): prompt number and audit seed")
    p.add_argument("--peers", type=int, default=6, help="block peers, half on each half of the layers (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency of every link (default 0)")
    p.add_argument("--tolerance", type=float, default=None, help="--audit-tolerance (default: the head's default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("/tmp/dsd-integrity"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    modes = comma_list(p, "--modes", args.modes, str)
    rates = comma_list(p, "--rates", args.rates, float)
    out = args.out or RESULTS_DIR / f"integrity-detect-{args.model}-{today()}.json"
    models = load_models(args.model, args.work)
    store = Store(models.target)
    setup = HeadSetup(store.load_head(), store.manifest.model_id, store.num_layers, NgramDrafter())
    half = store.num_layers // 2
    tolerance = AuditOptions().tolerance if args.tolerance is None else args.tolerance
    result: dict[str, Any] = {**run_metadata("integrity-detect", args), "command": command_line("integrity.py detect",
                              argv), "load_before": os.getloadavg(), "runs": []}
    for mode in modes:
        faults = [] if mode == "honest" else [f"0:{mode}"]
        with testnet(models.target, args.peers, args.latency_ms, args.work / "net", replicas=args.peers // 2,
                     faults=faults, threads=args.threads) as net:
            blocks = [q for q in net.peers if q.role == "block"]
            liar, honest = blocks[0], next(q for q in blocks if q.start == half)
            hops = [Hop(liar.peer_id, (liar.multiaddr,), 0, half),
                    Hop(honest.peer_id, (honest.multiaddr,), half, store.num_layers)]
            for rate in rates:
                for seed in range(args.seeds):
                    problem = PROBLEMS[seed % len(PROBLEMS)]
                    cfg = GenerationConfig(mode="dsd", max_new_tokens=args.max_new_tokens, gamma=4,
                                           eos_ids=models.eos)
                    run = trio.run(audited_run, net.bootstrap, setup, models.prompts[problem], cfg, hops,
                                   AuditOptions(rate=rate, seed=seed, tolerance=tolerance))
                    failure = run["failure"] or {}
                    window = failure.get("evidence", {}).get("window")
                    run.update(mode=mode, rate=rate, seed=seed, problem=problem, liar=liar.peer_id,
                               detected_at=window, blamed_right=failure.get("blamed") == [liar.peer_id])
                    result["runs"].append(run)
                    log(f"{mode} rate {rate} seed {seed}: detected at window {window} of {run['audits']['windows']}"
                        f" ({failure.get('verdict')}, right peer {run['blamed_right']}), {run['seconds']} s")
                    result["summary"] = detect_summary(result["runs"])
                    write_json(out, result)
    result["load_after"] = os.getloadavg()
    result["summary"] = detect_summary(result["runs"])
    write_json(out, result)
    print(out)
    return 0


def detect_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and rate: runs, caught, blamed right, windows to detection (median, max; censored runs apart)."""
    out: dict[str, Any] = {}
    for run in runs:
        key = f"{run['mode']}@{run['rate']}"
        out.setdefault(key, []).append(run)
    summary = {}
    for key, group in out.items():
        caught = [r["detected_at"] for r in group if r["detected_at"] is not None]
        summary[key] = {
            "runs": len(group), "caught": len(caught), "blamed_right": sum(r["blamed_right"] for r in group),
            "windows_to_detection_median": percentile(caught, 0.5) if caught else None,
            "windows_to_detection_max": max(caught) if caught else None,
            "windows_uncaught": [r["audits"]["windows"] for r in group if r["detected_at"] is None],
            "audited": sum(r["audits"]["audited"] for r in group),
            "closest_honest": max(r["audits"]["closest"] for r in group),
        }
    return summary


def overhead_main(argv: list[str]) -> int:
    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import load_head_setup
    from dsd.node.route.audit import AuditOptions
    from dsd.node.route.audit_rules import DEFAULT_AUDIT_RATE

    p = argparse.ArgumentParser(prog="integrity.py overhead", description=__doc__)
    p.add_argument("--model", choices=("tiny", "real"), default="real")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peers", type=int, default=4, help="block peers, half on each half of the layers (default 4)")
    p.add_argument("--rate", type=float, default=DEFAULT_AUDIT_RATE)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--latency-ms", type=float, default=50.0, help="one-way latency of every link (default 50, the "
                   "paper's WAN)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("/tmp/dsd-integrity"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or RESULTS_DIR / f"integrity-overhead-{args.model}-{today()}.json"
    models = load_models(args.model, args.work)
    setup, _ = load_head_setup(models.target, str(models.draft), SamplingParams(), 0)
    result: dict[str, Any] = {**run_metadata("integrity-overhead", args), "command": command_line(
        "integrity.py overhead", argv), "load_before": os.getloadavg(), "runs": []}
    with testnet(models.target, args.peers, args.latency_ms, args.work / "net", replicas=args.peers // 2,
                 threads=args.threads) as net:
        for rep in range(1, args.reps + 1):
            for problem in PROBLEMS:
                for rate in ((0.0, args.rate) if (rep + problem) % 2 else (args.rate, 0.0)):
                    cfg = GenerationConfig(mode="dsd", max_new_tokens=args.max_new_tokens, eos_ids=models.eos)
                    run = trio.run(audited_run, net.bootstrap, setup, models.prompts[problem], cfg, None,
                                   AuditOptions(rate=rate))
                    run.update(rep=rep, problem=problem, rate=rate)
                    result["runs"].append(run)
                    log(f"rep {rep} problem {problem} rate {rate}: {run['tokens']} tokens, {run['tok_s']} tok/s, "
                        f"audited {run['audits']['audited']}, failed {run['audits']['failed']}")
                    result["summary"] = overhead_summary(result["runs"], args.rate)
                    write_json(out, result)
    result["load_after"] = os.getloadavg()
    write_json(out, result)
    print(out)
    return 0


def overhead_summary(runs: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    """tok/s with audits over tok/s without, paired per (rep, problem): median, p10 and p90; audits and failures."""
    by: dict[tuple[int, int], dict[float, dict[str, Any]]] = {}
    for run in runs:
        by.setdefault((run["rep"], run["problem"]), {})[run["rate"]] = run
    ratios = [pair[rate]["tok_s"] / pair[0.0]["tok_s"] for pair in by.values()
              if rate in pair and 0.0 in pair and pair[0.0]["tok_s"] > 0]
    audited = [r for r in runs if r["rate"] == rate]
    return {"pairs": len(ratios), "tok_s_ratio_median": percentile(ratios, 0.5),
            "tok_s_ratio_p10": percentile(ratios, 0.1), "tok_s_ratio_p90": percentile(ratios, 0.9),
            "tok_s_none_median": percentile([r["tok_s"] for r in runs if r["rate"] == 0.0], 0.5),
            "tok_s_audited_median": percentile([r["tok_s"] for r in audited], 0.5),
            "windows_audited": sum(r["audits"]["audited"] for r in audited),
            "audits_failed": sum(r["audits"]["failed"] for r in audited),
            "closest_honest": max((r["audits"]["closest"] for r in audited), default=0.0)}
