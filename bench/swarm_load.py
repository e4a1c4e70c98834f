"""Many heads on one swarm: H heads generating at once over a 4-peer testnet, in `ar`, `sd` and `dsd`, with the
peers' batching on and off.

For each batching setting it starts a testnet (bootstrap + `--peers` block peers, every link `--latency-ms` one
way, pinned to every CPU but the first when `--pin-head`), and one head process (pinned to the first CPU) holding
H head nodes of their own, each with its own route session and draft cache over one loaded draft model and head
(as `dsd-node serve` does). For each H and mode, H heads take the 10 fixed prompts (`serve_load.PROMPTS`, × `--reps`)
from one shared queue and generate `--max-tokens` greedy tokens each. Reported per cell: aggregate tokens/s over
the cell's wall time, per-generation tokens/s p50/p95, time to the first token p50/p95 (the prompt's round),
mean drafts per round, the route load the heads read, and whether every output equals `ar`'s tokens for its prompt
(the reference: the first `ar` generation of that prompt in the run, batching off at H = 1 when it runs first).
With `--metrics` each cell also records what the peers' steps held (their `dsd_peer_step_windows` histograms: the
windows per step as a window saw it, and the steps' compute seconds per window) and how busy each CPU was.
One JSON on stdout, saved (after every cell: a rerun with the same --out resumes) under results/, and a PNG.

    python bench/swarm_load.py                                    # the real pair: 4 × 3 × 2 cells
    python bench/swarm_load.py --models tiny --heads 1,2 --max-tokens 8      # smoke check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    comma_list,
    command_line,
    git_commit,
    percentile,
    plan_once,
    run_generation,
    run_metadata,
    testnet,
    today,
    write_json,
)
from serve_load import PROMPTS
from sweep_placement import Placement
from sweep_setup import load_models

MODES = ("ar", "sd", "dsd")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cell_key(batching: str, heads: int, mode: str) -> str:
    return f"{batching}/H{heads}/{mode}"


def summarize(cell: dict[str, Any], reference: dict[str, list[int]]) -> dict[str, Any]:
    """A cell's figures from its runs (see the module doc)."""
    runs = cell["runs"]
    ok = [r for r in runs if "error" not in r]
    rates = [r["tokens_per_s"] for r in ok]
    ttft = [r["prefill_s"] for r in ok]
    drafts = [r["drafted"] / r["draft_rounds"] for r in ok if r["draft_rounds"]]

    def q(xs: list[float], p: float) -> float | None:
        return None if not xs else round(percentile(xs, p), 4)

    return {
        "H": cell["H"], "mode": cell["mode"], "batching": cell["batching"],
        "aggregate_tokens_per_s": round(sum(r["new_tokens"] for r in ok) / cell["wall_s"], 4),
        "exact": bool(ok) and len(ok) == len(runs) and all(r["tokens"] == reference.get(str(r["prompt"])) for r in ok),
        "generations": len(runs), "failed": len(runs) - len(ok),
        "per_head_tokens_per_s_p50": q(rates, 0.5), "per_head_tokens_per_s_p95": q(rates, 0.95),
        "per_head_tokens_per_s_min": None if not rates else round(min(rates), 4),
        "ttft_p50_s": q(ttft, 0.5), "ttft_p95_s": q(ttft, 0.95),
        "drafts_per_round": round(statistics.fmean(drafts), 3) if drafts else 0.0,
        "route_load_mean": round(statistics.fmean(r["route_load"] for r in ok), 4) if ok else None,
        "wall_s": cell["wall_s"],
        **({"steps": cell["steps"]} if "steps" in cell else {}),
    }


def targets(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, read from the cells that ran: ar batched ≥ 2× unbatched at the largest H, and dsd ≥ ar
    (aggregate) at every H of each batching setting."""
    by = {(c["batching"], c["H"], c["mode"]): c["aggregate_tokens_per_s"] for c in cells}
    out: dict[str, Any] = {}
    hs = sorted({c["H"] for c in cells})
    if hs and ("on", hs[-1], "ar") in by and ("off", hs[-1], "ar") in by:
        out[f"ar_batched_over_unbatched_H{hs[-1]}"] = round(by["on", hs[-1], "ar"] / by["off", hs[-1], "ar"], 3)
    for batching in ("off", "on"):
        ratios = {h: round(by[batching, h, "dsd"] / by[batching, h, "ar"], 3) for h in hs
                  if (batching, h, "dsd") in by and (batching, h, "ar") in by}
        if ratios:
            out[f"dsd_over_ar_batching_{batching}"] = ratios
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    """Aggregate tokens/s over H, one line per mode and batching setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batching, style in (("off", "--"), ("on", "-")):
        for mode, colour in zip(MODES, ("tab:gray", "tab:blue", "tab:red"), strict=True):
            pts = sorted((c["H"], c["aggregate_tokens_per_s"]) for c in results["cells"]
                         if c["batching"] == batching and c["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, marker="o", color=colour, label=f"{mode}, batching {batching}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("heads generating at once (H)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{results['models']} pair, {results['peers']} peers, {results['latency_ms']:g} ms links")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_cell(heads: list[Any], setup: Any, hops: list[Any], prompts: list[list[int]], mode: str, n_heads: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    """H heads sharing one queue of every prompt × reps; each generation with a drafter of its own."""
    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.report import GenerationFailed
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import request_drafter

    queue = [i for _ in range(args.reps) for i in range(len(prompts))]
    runs: list[dict[str, Any]] = []

    async def head(swarm: Any, legs: Any) -> None:
        while queue:
            i = queue.pop(0)
            cfg = GenerationConfig(mode=mode, max_new_tokens=args.max_tokens, seed=0)
            mine = dataclasses.replace(setup, drafter=request_drafter(setup.drafter, SamplingParams(), 0))
            try:
                report = await run_generation(swarm, legs, mine, prompts[i], cfg, hops)
            except GenerationFailed as exc:
                runs.append({"prompt": i, "error": str(exc)[:300]})
                continue
            d = report.result.as_dict()
            runs.append({"prompt": i, **{k: d[k] for k in ("tokens", "new_tokens", "elapsed_s", "tokens_per_s",
                                                          "prefill_s", "rounds", "draft_rounds", "drafted",
                                                          "mean_accepted", "route_load", "pipelined_rounds",
                                                          "pipelined_wasted")}})

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    async with trio.open_nursery() as nursery:
        for swarm, legs in heads[:n_heads]:
            nursery.start_soon(head, swarm, legs)
    return {"H": n_heads, "mode": mode, "runs": runs, "wall_s": round(time.perf_counter() - t0, 3),
            "load_before": load_before, "load_after": os.getloadavg()}


def cpu_times() -> dict[str, tuple[int, int]]:
    """Per CPU (cpu0, cpu1, ...): (busy, total) jiffies since boot, from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                v = [int(x) for x in fields]
                idle = v[3] + v[4]
                out[name] = (sum(v) - idle, sum(v))
    return out


def step_counts(urls: list[str]) -> dict[str, float]:
    """Summed over the peers: windows stepped, windows that shared their step (weighted by the step's size: the sum
    of the histogram), and the compute seconds of the steps each window was in (the forward histogram's sum)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = {"windows": 0.0, "batch_sum": 0.0, "compute_s": 0.0}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for s in family.samples:
                if s.name == "dsd_peer_step_windows_count":
                    total["windows"] += s.value
                elif s.name == "dsd_peer_step_windows_sum":
                    total["batch_sum"] += s.value
                elif s.name == "dsd_peer_forward_step_seconds_sum":
                    total["compute_s"] += s.value
    return total


def steps_of(before: dict[str, float], after: dict[str, float], cpu0: dict, cpu1: dict) -> dict[str, Any]:
    """A cell's steps (`step_counts` after minus before) and each CPU's busy share over it."""
    windows = after["windows"] - before["windows"]
    return {
        "windows": int(windows),
        "mean_windows_per_step_seen": round((after["batch_sum"] - before["batch_sum"]) / windows, 3) if windows else None,
        "compute_s_per_window": round((after["compute_s"] - before["compute_s"]) / windows, 4) if windows else None,
        "cpu_busy": {c: round((cpu1[c][0] - cpu0[c][0]) / max(1, cpu1[c][1] - cpu0[c][1]), 3) for c in cpu1},
    }


def run_arm(batching: str, results: dict[str, Any], target: Path, setup: Any, prompts: list[list[int]],
            placement: Placement, args: argparse.Namespace, save: Any) -> None:
    """One testnet with the peers' batching `batching`; every (H, mode) cell it still lacks."""
    import contextlib

    import trio

    from dsd.node.peer.generation import swarm_watch
    from dsd.node.peer.host import head_node
    from dsd.node.testnet.link_profiles import build_link

    done = {c["key"] for c in results["raw"]}
    todo = [(h, m) for h in args.heads for m in args.modes if cell_key(batching, h, m) not in done]
    if not todo:
        return
    log(f"[batching {batching}] starting {args.peers} peers, {args.latency_ms:g} ms links; {len(todo)} cells to go")
    with testnet(target, args.peers, args.latency_ms, args.state / f"net-{batching}", peer_cpus=placement.peers,
                 batching=batching, metrics=args.metrics) as state:
        urls = [p.metrics_url for p in state.peers if p.metrics_url and p.start is not None]
        log(f"  testnet up in {state.up_seconds:.1f} s")

        async def main() -> None:
            async with contextlib.AsyncExitStack() as stack:
                heads = []
                for _ in range(max(args.heads)):
                    node, legs = await stack.enter_async_context(
                        head_node([state.bootstrap], build_link(None, args.latency_ms)))
                    heads.append((swarm_watch(node, setup), legs))
                hops = await plan_once(heads[0][0].node, setup.model_id, setup.num_layers)
                results["route"] = [[h.start, h.end] for h in hops]
                warm = await run_cell(heads, setup, hops, prompts[:1], "ar", 1,
                                      argparse.Namespace(reps=1, max_tokens=2))  # first sessions, caches warm
                if warm["runs"] and "error" in warm["runs"][0]:
                    raise SystemExit(f"warm-up failed: {warm['runs'][0]['error']}")
                for h, mode in todo:
                    before, cpu0 = (step_counts(urls), cpu_times()) if args.metrics else (None, None)
                    cell = await run_cell(heads, setup, hops, prompts, mode, h, args)
                    if args.metrics:
                        cell["steps"] = steps_of(before, step_counts(urls), cpu0, cpu_times())
                    cell.update(key=cell_key(batching, h, mode), batching=batching, commit=git_commit())
                    for r in cell["runs"]:
                        if mode == "ar" and "tokens" in r:
                            results["reference"].setdefault(str(r["prompt"]), r["tokens"])
                    results["raw"].append(cell)
                    s = summarize(cell, results["reference"])
                    log(f"  H={h} {mode:3s} batching {batching}: {s['aggregate_tokens_per_s']:.2f} tok/s aggregate, "
                        f"per head p50 {s['per_head_tokens_per_s_p50']} p95 {s['per_head_tokens_per_s_p95']}, "
                        f"ttft p50 {s['ttft_p50_s']} s, drafts/round {s['drafts_per_round']}, "
                        f"load {s['route_load_mean']}, exact {s['exact']}, {cell['wall_s']:.0f} s")
                    save()

        trio.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", choices=("real", "tiny"), default="real")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=30.0, help="one-way emulated latency of every link (default 30)")
    p.add_argument("--heads", default="1,2,4,8", help="heads generating at once (default 1,2,4,8)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated of ar, sd, dsd (default all)")
    p.add_argument("--batching", default="off,on", help="the peers' --batching settings to run (default off,on)")
    p.add_argument("--reps", type=int, default=1, help="times every prompt is generated per cell (default 1)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--draft-quant", choices=("none", "int8"), default="int8",
                   help="the real draft's quantization (default int8, as in the headline)")
    p.add_argument("--no-pin-head", dest="pin_head", action="store_false",
                   help="let the head and the peers share every CPU (default: the head on the first CPU alone)")
    p.add_argument("--metrics", action="store_true", help="record the peers' step sizes and the CPUs' busy shares per cell")
    p.add_argument("--state", type=Path, default=Path(".dsd/bench/swarm_load"), help="testnets and logs")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/swarm_load-DATE.json)")
    args = p.parse_args(argv)
    args.heads = comma_list(p, "--heads", args.heads, int)
    args.modes = comma_list(p, "--modes", args.modes, str)
    args.batching = comma_list(p, "--batching", args.batching, str)
    if set(args.modes) - set(MODES) or set(args.batching) - {"on", "off"}:
        p.error("--modes takes ar, sd, dsd; --batching takes on, off")
    if args.peers < 1 or args.reps < 1 or args.max_tokens < 1 or min(args.heads) < 1:
        p.error("--peers, --reps, --max-tokens and every --heads value must be >= 1")
    out = args.out or RESULTS_DIR / f"swarm_load-{today()}.json"
    placement = Placement.plan(args.pin_head)
    placement.pin_head()
    torch.set_num_threads(1)
    args.state.mkdir(parents=True, exist_ok=True)
    target, setup, tokenizer, _ = load_models(args.models, args.state, args.draft_quant if args.models == "real" else "none")
    prompts = [tokenizer.encode(t) if tokenizer is not None else list(t.encode()) for t in PROMPTS]
    results: dict[str, Any] = {**run_metadata("swarm_load", args), "models": args.models, "peers": args.peers,
                               "latency_ms": args.latency_ms, "max_tokens": args.max_tokens, "reps": args.reps,
                               "prompts": len(prompts), "placement": placement.record(), "reference": {}, "raw": []}
    if out.exists():
        old = json.loads(out.read_text())
        results.update(reference=old.get("reference", {}), raw=old.get("raw", []))
        results.update({k: old[k] for k in ("set_apart", "set_apart_controller", "first_run", "resumed") if k in old})
        results.setdefault("resumed", []).append({"commit": git_commit(), "command": command_line("swarm_load.py", argv
                                                  if argv is not None else sys.argv[1:])})
        log(f"resuming {out}: {len(results['raw'])} cells done")

    def save() -> None:
        results["cells"] = [summarize(c, results["reference"]) for c in results["raw"]]
        results["targets"] = targets(results["cells"])
        write_json(out, results)

    for batching in args.batching:
        run_arm(batching, results, target, setup, prompts, placement, args, save)
    save()
    plot(results, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in results.items() if k != "raw"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
