"""The DSD report's pure parts: the timing model (fed only by calibration done before a setting's runs),
the paper's formula, and the per-setting statistics (medians with bootstrap confidence intervals).

No testnet, no torch: plain functions (numpy for the bootstrap) over the numbers a sweep records (see
docs/benchmarks.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sweep_provenance import set_apart_groups, stretches

from dsd.node.head.levers import LEVERS as ENGINE_LEVERS
from dsd.node.head.levers import lever_options as engine_lever_options

# Issue 57's levers on dsd's ahead-of-verdict work, each a mode of its own (`dsd-levers`: all of them), and the
# engine options each sets (`dsd.node.head.levers`).
LEVERS: dict[str, dict[str, Any]] = {f"-{name}": engine_lever_options([name]) for name in ENGINE_LEVERS}
LEVERS["-levers"] = engine_lever_options(["all"])
MODES = ("ar", "sd", "dsd", "dsd-adaptive", "sd-chain", "dsd-chain", "dsd-serial", "dsd-batched", "ar-shared",
         "sd-shared", "dsd-shared", *(f"dsd{suffix}" for suffix in LEVERS))
# Paired ratios reported when both modes ran: the speedups, trees (the controller's choice) vs chains, the
# pipeline, and a pinned head vs one sharing every CPU (with the speedups of the shared placement).
RATIOS = (("dsd", "ar"), ("sd", "ar"), ("dsd", "sd"), ("sd", "sd-chain"), ("dsd", "dsd-chain"),
          ("dsd-chain", "sd-chain"), ("dsd", "dsd-serial"), ("dsd-serial", "sd"), ("dsd", "dsd-batched"),
          ("dsd-batched", "ar"), ("dsd-batched", "sd"),
          ("dsd", "dsd-shared"), ("sd", "sd-shared"), ("ar", "ar-shared"),
          ("dsd-shared", "ar-shared"), ("sd-shared", "ar-shared"), ("dsd-shared", "sd-shared"),
          *((f"dsd{suffix}", den) for suffix in LEVERS for den in ("dsd", "sd", "ar")))
CHAIN = "-chain"  # a mode with this suffix is its base mode with token trees off (windows are chains)
SERIAL = "-serial"  # dsd with one window in flight (`--pipeline 1`): the pre-drafting overlap alone
BATCHED = "-batched"  # dsd sending a window ahead only once every outcome branch is drafted (before 2026-12-05)
SHARED = "-shared"  # the base mode with the head on every CPU beside the peers (`--pin-head` pins the others)
# The engine's window limits the model follows (node/head/config.py; a test checks they agree):
GAMMA_MAX = 16  # the longest chain window
LOOKAHEAD = 3  # dsd pre-drafts each branch this many tokens past the window it expects next
DRAWS = 10_000  # bootstrap draws per interval
BAND_Z = 2.0  # a bound's Monte-Carlo band: ±2 binomial sd of its rank among the drawn medians


def base_mode(mode: str) -> str:
    """The engine's mode of a benchmark mode: `sd-chain` runs `sd` with chains only, `dsd-serial` runs `dsd`
    with one window in flight, `dsd-batched` sends it ahead after all branches, `dsd-shared` runs `dsd` with
    the head sharing the peers' CPUs."""
    for suffix in LEVERS:
        mode = mode.removesuffix(suffix)
    return mode.removesuffix(SHARED).removesuffix(CHAIN).removesuffix(SERIAL).removesuffix(BATCHED)


def lever_options(mode: str) -> dict[str, Any]:
    """The engine options a lever mode sets (`dsd-budget`: budget on), none for any other mode."""
    return next((dict(opts) for suffix, opts in LEVERS.items() if mode.endswith(suffix)), {})


def interp(table: dict[int, float], x: float) -> float:
    """Piecewise-linear interpolation in a {window: seconds} table (flat beyond its ends)."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:], strict=False):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    return table[xs[-1]]


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ) = (1 − α^{γ+1}) / (1 − α): tokens a window of γ drafts emits (accepted + correction/bonus)."""
    return float(gamma + 1) if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def ready_probability(alpha: float, gamma: int, alt_hit: float) -> float:
    """P(the next window is pre-drafted): full acceptance with the bonus guessed (α^{γ+1}), or any other
    outcome whose token is among the draft's alternatives there (measured share `alt_hit`)."""
    full = alpha ** (gamma + 1)
    return full + (1.0 - full) * alt_hit


def round_time(n: int, t1: float, t0w: float, head: float) -> float:
    """One trip of a window around the ring: N+1 link crossings, N peers' compute, the head's embed+logits."""
    return (n + 1) * t1 + n * t0w + head


def pipelined_round(r: float, p: float, send: float, after: float) -> float:
    """Mean seconds per window of dsd with two windows in flight (`--pipeline 2`).

    The head sends the full-acceptance branch of the window in flight as the next window once that
    branch is drafted (`send` seconds after the window went). A window sent after a verdict (the
    first, or the one after a lost bet) costs its trip and the drafting before it (`r + after`);
    while bets keep winning (probability p each) the windows sent ahead cost `send`, then
    max(r − send, send) (the pipeline had no room until the older verdict), alternately. Over the
    runs of won bets (geometric) that averages to the expression returned (docs/benchmarks.md)."""
    return (1.0 - p) * (r + after) + (send * p + max(r - send, send) * p * p) / (1.0 + p)


def predict(mode: str, cal: dict[str, Any], gamma: int, pipeline: int = 1, alone: bool = True) -> dict[str, float]:
    """Seconds per token of `mode` with window γ, from the calibration record only (see docs/benchmarks.md).

    `pipeline` is dsd's windows in flight: 1 (`dsd-serial`) or 2 (the default); deeper pipelines
    are not modelled (ValueError). `alone`: the bet is drafted by itself and sent first (`dsd`), not
    once every branch is (`dsd-batched`)."""
    n, t1 = cal["peers"], cal["latency_ms"] / 1000
    t0 = {int(k): v for k, v in cal["t0_window_s"].items()}
    head = {int(k): v for k, v in cal["head_window_s"].items()}
    if mode == "ar" or gamma == 0:
        r = round_time(n, t1, t0[1], interp(head, 1))
        return {"round_s": r, "tokens_per_round": 1.0, "s_per_token": r, "gamma": 0}
    alpha, d = cal["alpha"], cal["draft_s_per_token"]
    r = round_time(n, t1, interp(t0, gamma + 1), interp(head, gamma + 1))
    tokens = expected_tokens(alpha, gamma)
    if mode == "sd":
        t, p = r + gamma * d, 0.0
    else:  # dsd: the next window is ready when the verdict matches a pre-drafted branch
        p = ready_probability(alpha, gamma, cal["alt_hit"])
        step = cal.get("branch_step_s", d)
        t = r + p * max(0.0, (gamma + 1) * step - r) + (1.0 - p) * gamma * d
        if pipeline > 2:
            raise ValueError(f"the timing model describes at most 2 windows in flight, not {pipeline}")
        # The bonus guess, then γ tokens in single steps (alone), or every branch past γ in batched steps.
        send = (1 + gamma) * d if alone else (1 + min(gamma + LOOKAHEAD, GAMMA_MAX)) * step
        if pipeline == 2 and send < r:  # the bet goes out before the verdict; else dsd runs serially
            alt = cal["alt_hit"]
            after = alt * max(0.0, (gamma + 1) * step - r) + (1.0 - alt) * gamma * d
            won = alpha ** (gamma + 1)  # the window sent ahead is used only on full acceptance + bonus
            t = pipelined_round(r, won, send, after)
    return {"round_s": r, "tokens_per_round": tokens, "s_per_token": t / tokens, "gamma": gamma, "p_ready": p}


def best_gamma(mode: str, cal: dict[str, Any], gamma_max: int = GAMMA_MAX, pipeline: int = 1, alone: bool = True) -> int:
    """The window the model says is fastest (what the engine's controller aims for)."""
    if mode == "ar":
        return 0
    return min(range(1, gamma_max + 1), key=lambda g: (predict(mode, cal, g, pipeline, alone)["s_per_token"], g))


def paper_prediction(n: int, t0: float, t1: float, tokens_per_round: float) -> dict[str, float]:
    """The paper's model: T_std = t0 + (N−1)·t1 per token; DSD saves (N−1)·t1·(k−1)/k of it."""
    t_std = t0 + (n - 1) * t1
    k = max(1.0, tokens_per_round)
    saving = (n - 1) * t1 * (k - 1) / k
    return {"t_std_s": t_std, "saving_s": saving, "speedup": t_std / (t_std - saving)}


def bootstrap_interval(groups: Sequence[Sequence[float]], *, draws: int = DRAWS,
                       seed: int = 0) -> tuple[float, float, float, float, float]:
    """Median of all values, its 95 % interval resampling whole groups (one group = one prompt's repetitions), and
    each bound's Monte-Carlo error: half the spread of the drawn medians within ±2 binomial sd of the bound's rank,
    the band where a rerun with another seed puts the bound 19 times in 20 (the bounds are only printed to it)."""
    values = [v for g in groups for v in g]
    if not values:
        return (math.nan,) * 5
    table = np.full((len(groups), max(len(g) for g in groups)), np.nan)  # ragged groups padded with NaN
    for i, g in enumerate(groups):
        table[i, : len(g)] = g
    pick = np.random.default_rng(seed).integers(len(groups), size=(draws, len(groups)))
    meds = np.sort(np.nanmedian(table[pick].reshape(draws, -1), axis=1))
    out = [statistics.median(values)]
    for p, k in ((0.025, int(0.025 * draws)), (0.975, int(0.975 * draws) - 1)):
        d = math.ceil(BAND_Z * math.sqrt(draws * p * (1 - p)))
        out.append(float(meds[k]))
        out.append(float(meds[min(k + d, draws - 1)] - meds[max(k - d, 0)]) / 2)
    med, lo, lo_err, hi, hi_err = out
    return med, lo, hi, lo_err, hi_err


def bootstrap_median(groups: Sequence[Sequence[float]], *, draws: int = DRAWS, seed: int = 0) -> tuple[float, float, float]:
    """Median of all values and its 95 % interval, resampling whole groups (one group = one prompt's repetitions)."""
    return bootstrap_interval(groups, draws=draws, seed=seed)[:3]


def aggregate(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Totals of one mode over a setting's runs (sums first, then ratios); counters are the engine's own."""
    tokens = sum(r["new_tokens"] for r in runs)
    elapsed = sum(r["elapsed_s"] for r in runs)
    prefill = sum(r["prefill_s"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    draft_rounds = sum(r["draft_rounds"] for r in runs)
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    windows = sum(r["windows_after_prefill"] for r in runs)
    tb = [r["time_breakdown"] for r in runs]
    used, exposed = sum(t["drafting_hidden_used_s"] for t in tb), sum(t["drafting_exposed_s"] for t in tb)
    return {
        "new_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "decode_tokens_per_s": (tokens - len(runs)) / (elapsed - prefill) if elapsed > prefill else 0.0,
        "rounds": rounds,
        "tokens_per_trip": tokens / rounds if rounds else 0.0,
        "mean_accepted": accepted / draft_rounds if draft_rounds else 0.0,
        "mean_gamma": drafted / draft_rounds if draft_rounds else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "tree_window_share": sum(r.get("tree_windows", 0) for r in runs) / draft_rounds if draft_rounds else 0.0,
        "ready_share": sum(r["ready_rounds"] for r in runs) / windows if windows else 0.0,
        "pipelined_share": sum(r.get("pipelined_rounds", 0) for r in runs) / windows if windows else 0.0,
        "pipelined_wasted": sum(r.get("pipelined_wasted", 0) for r in runs),
        "bytes_per_token": sum(r["bytes_sent"] + r["bytes_received"] for r in runs) / tokens if tokens else 0.0,
        "drafting_s": sum(t["drafting_s"] for t in tb),
        "drafting_hidden_used_s": used,
        "drafting_hidden_wasted_s": sum(t["drafting_hidden_wasted_s"] for t in tb),
        "drafting_exposed_s": exposed,
        "hidden_used_share": used / (used + exposed) if used + exposed > 0 else 0.0,
        "run_s": run_medians(runs),
    }


RUN_PARTS = {"run": lambda r: r["elapsed_s"], "prompt's trip": lambda r: r.get("prefill_s"),
             "drafting": lambda r: r.get("time_breakdown", {}).get("drafting_s"),
             "drafting never used": lambda r: r.get("time_breakdown", {}).get("drafting_hidden_wasted_s"),
             "waiting": lambda r: r.get("time_breakdown", {}).get("waiting_s"),
             "bet sent after its window": lambda r: r.get("ahead_gap_s")}


def run_medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where a typical run's time goes: the median over runs of each part (s); and how soon a bet on a window in
    flight left after that window (each run's median gap) where the runs recorded it."""
    out: dict[str, float | None] = {}
    for name, part in RUN_PARTS.items():
        values = [v for r in runs if (v := part(r)) is not None]
        out[name] = round(statistics.median(values), 3) if values else None
    return out


def decode_tokens_per_s(run: dict[str, Any]) -> float:
    """A run's speed after the prompt's trip (which yields its first token and costs every mode the same)."""
    decoding = run["elapsed_s"] - run["prefill_s"]
    return (run["new_tokens"] - 1) / decoding if decoding > 0 and run["new_tokens"] > 1 else 0.0


def paired_ratios(setting: dict[str, Any], num: str, den: str,
            value: Callable[[dict[str, Any]], float] = lambda r: r["tokens_per_s"]) -> list[list[float]]:
    """Per prompt: the ratio num/den of a run's `value` in each repetition (the two runs were adjacent in time)."""
    return list(paired_by_prompt(setting, num, den, value).values())


def paired_by_prompt(setting: dict[str, Any], num: str, den: str,
                     value: Callable[[dict[str, Any]], float] = lambda r: r["tokens_per_s"]) -> dict[str, list[float]]:
    """`paired_ratios` keyed by the prompt's task id."""
    by: dict[tuple[str, int], dict[str, float]] = {}
    for r in setting["runs"]:
        if "error" not in r:
            by.setdefault((r["task_id"], r["rep"]), {})[r["mode"]] = value(r)
    groups: dict[str, list[float]] = {}
    for (task, _), modes in by.items():
        if num in modes and den in modes and modes[den] > 0:
            groups.setdefault(task, []).append(modes[num] / modes[den])
    return groups


def per_prompt(groups: dict[str, list[float]]) -> dict[str, Any]:
    """Each prompt's median ratio over its repetitions, and the worst prompt's: a lever must pay on every prompt."""
    medians = {task: statistics.median(g) for task, g in groups.items() if g}
    worst = min(medians, key=lambda t: medians[t]) if medians else None
    return {"per_prompt": medians, "worst_prompt": None if worst is None else {"task_id": worst, "median": medians[worst]}}


def ratio_summary(groups: list[list[float]]) -> dict[str, Any]:
    """A paired ratio's median, its bootstrap 95 % interval (with each bound's Monte-Carlo error) and its pairs."""
    med, lo, hi, lo_err, hi_err = bootstrap_interval(groups)
    return {"median": med, "ci95": [lo, hi], "ci95_mc": [lo_err, hi_err], "draws": DRAWS,
            "pairs": sum(len(g) for g in groups)}


def _ratio_readings(rt: float, n: int, cal: dict[str, Any], mark: dict[str, Any]) -> tuple[float, float | None]:
    """One `ar` round of `rt` seconds read in a stretch (its t0 and links; compute scaled by t0 then / t0 at
    calibration): (t1_eff/t0, the excess on the links; t1/t0_eff, the excess on the peers' steps, None when the
    round was shorter than its links)."""
    t0 = mark["t0_s"] or cal["t0_s"]
    t1 = (mark["latency_ms"] or cal["latency_ms"]) / 1000
    scale, head = t0 / cal["t0_s"], interp({int(k): v for k, v in cal["head_window_s"].items()}, 1)
    step = (rt - (n + 1) * t1 - scale * head) / n
    return (rt - scale * (n * cal["t0_window_s"]["1"] + head)) / (n + 1) / t0, t1 / step if step > 0 else None


def effective_ratio(setting: dict[str, Any]) -> dict[str, Any] | None:
    """t1/t0 as the `ar` runs' decoding rounds measured it, beside the nominal one links were set to: a round costs
    (N+1)·t1 + N·t0(1) + h(1) (`round_time`); what it costs beyond that is put on the links (t1_eff/t0) or on the
    peers' steps (t1/t0_eff), the two ends of where the excess may lie. A run is read in its stretch; one of an
    older file (no stretch recorded) in each of the setting's stretches, so each reading is a [low, high] range of
    medians over the runs that holds the median of the true stretches (a single value when they agree)."""
    cal, n = setting["calibration"], setting["peers"]
    ar = [r for r in setting["runs"] if r["mode"] == "ar" and "error" not in r and r.get("windows_after_prefill")]
    if not ar or "1" not in cal.get("t0_window_s", {}):
        return None
    marks = stretches(setting)
    rounds, links, peers = [], [], []
    for r in ar:
        rt = (r["elapsed_s"] - r["prefill_s"]) / r["windows_after_prefill"]
        placed = 0 <= r.get("stretch", -1) < len(marks)
        readings = [_ratio_readings(rt, n, cal, m) for m in ([marks[r["stretch"]]] if placed else marks)]
        rounds.append(rt)
        links.append((min(x for x, _ in readings), max(x for x, _ in readings)))
        if all(y is not None for _, y in readings):
            peers.append((min(y for _, y in readings), max(y for _, y in readings)))

    def span(pairs: list[tuple[float, float]]) -> list[float] | None:
        """The median of the low readings and of the high ones (None without any)."""
        return [statistics.median(lo for lo, _ in pairs), statistics.median(hi for _, hi in pairs)] if pairs else None

    head = interp({int(k): v for k, v in cal["head_window_s"].items()}, 1)
    return {"nominal": setting.get("ratio", cal.get("ratio")), "t1_eff_over_t0": span(links),
            "t1_over_t0_eff": span(peers), "round_s": statistics.median(rounds),
            "model_round_s": round_time(n, cal["latency_ms"] / 1000, cal["t0_window_s"]["1"], head),
            "ar_runs": len(ar), "runs_placed_in_stretches": sum(1 for r in ar if "stretch" in r)}


def pipeline_depth(mode: str, setting: dict[str, Any]) -> int:
    """Windows the mode's runs had in flight at most (dsd's `--pipeline`; serial modes and older results: 1)."""
    if mode.startswith("dsd") and not mode.endswith(SERIAL):
        return int(setting.get("options", {}).get("pipeline", 1))
    return 1


def sends_alone(mode: str, runs: Sequence[dict[str, Any]]) -> bool:
    """Whether the mode's runs sent the bet ahead drafted alone: not `dsd-batched`, and an engine that does
    (its runs record `ahead_gap_s`; runs before that rule sent it once every branch was drafted)."""
    return not mode.endswith(BATCHED) and any("ahead_gap_s" in r for r in runs)


def summarize(setting: dict[str, Any]) -> dict[str, Any]:
    """Per mode: totals, the median tok/s with its interval, the model's prediction; plus the paired speedups."""
    runs = [r for r in setting["runs"] if "error" not in r]  # a failed run has no counters; it is counted apart
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    cal = setting["calibration"]
    out: dict[str, Any] = {"modes": {}, "ratios": {}, "failed_runs": len(setting["runs"]) - len(runs) + len(setting.get("failed", [])),
                           "set_apart": [{"reason": g["reason"], "when": g["when"], "commit": g["commit"], "runs": len(g["runs"])}
                                         for g in set_apart_groups(setting)],
                           "effective_ratio": effective_ratio(setting)}
    ar_pred = predict("ar", cal, 0)
    ref = "ar" if "ar" in modes else modes[0]  # greedy output must be the same in every mode: checked against ref
    for m in modes:
        mine = [r for r in runs if r["mode"] == m]
        row: dict[str, Any] = aggregate(mine)
        by_task: dict[str, list[float]] = {}
        for r in mine:
            by_task.setdefault(r["task_id"], []).append(r["tokens_per_s"])
        med, lo, hi, lo_err, hi_err = bootstrap_interval(list(by_task.values()))
        row["median_tokens_per_s"], row["median_tokens_per_s_mc"] = [med, lo, hi], [lo_err, hi_err]
        depth = pipeline_depth(m, setting)
        alone = sends_alone(m, mine)
        gamma = best_gamma(base_mode(m), cal, pipeline=min(depth, 2), alone=alone)
        pred = predict(base_mode(m), cal, gamma, pipeline=min(depth, 2), alone=alone)
        # The model describes up to two windows in flight; a deeper pipeline is measured only, never "predicted".
        # A lever mode is measured only: the timing model does not describe the levers.
        modelled = depth <= 2 and not lever_options(m)
        row["model"] = {**pred, "speedup_vs_ar": ar_pred["s_per_token"] / pred["s_per_token"]} if modelled else None
        row["paper"] = paper_prediction(setting["peers"], cal["t0_s"], cal["latency_ms"] / 1000, pred["tokens_per_round"])
        ref_tokens = {(r["task_id"], r["rep"]): r["tokens"] for r in runs if r["mode"] == ref}
        same = [r["tokens"] == ref_tokens[(r["task_id"], r["rep"])] for r in mine if (r["task_id"], r["rep"]) in ref_tokens]
        row["identical_to_ar" if ref == "ar" else f"identical_to_{ref}"] = f"{sum(same)}/{len(same)}" if same else "-"
        first = [r.get("passed") for r in mine if r["rep"] == 1]
        if first and all(isinstance(x, bool) for x in first):
            row["pass_at_1"] = sum(first) / len(first)
        out["modes"][m] = row
    for num, den in RATIOS:
        by_prompt = paired_by_prompt(setting, num, den)
        groups = list(by_prompt.values())
        if groups:
            out["ratios"][f"{num}/{den}"] = {**ratio_summary(groups), **per_prompt(by_prompt)}
            if base_mode(den) == "ar":  # what the timing model predicts: decoding, without the prompt's trip
                out["ratios"][f"{num}/{den} decode"] = ratio_summary(paired_ratios(setting, num, den, decode_tokens_per_s))
            if num.removesuffix(CHAIN) == den.removesuffix(CHAIN):  # trees vs chains: tokens per trip too
                out["ratios"][f"{num}/{den} tokens/trip"] = ratio_summary(paired_ratios(setting, num, den, lambda r: r["tokens_per_trip"]))
    return out
