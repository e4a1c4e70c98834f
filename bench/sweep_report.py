"""The DSD report's outputs: the markdown table, the speedup plot, the federated row and the files."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, write_json
from sweep_model import RUN_PARTS
from sweep_provenance import cell_machine, set_apart_groups, stretches_table


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def stable_decimals(error: float, most: int = 2) -> int:
    """The decimals worth printing for a value with this Monte-Carlo error: the most (up to `most`) whose last
    digit's unit is at least the error, so a rerun with another seed moves that digit by one at most."""
    return next((d for d in range(most, 0, -1) if 10.0**-d >= error), 0)


def fmt_bound(x: float, error: float | None) -> str:
    """A bootstrap bound to its stable digits (two decimals when its error was not recorded)."""
    return f"{x:.{2 if error is None else stable_decimals(error)}f}"


def fmt_interval(lo: float, hi: float, errors: Sequence[float] | None) -> str:
    """`[lo, hi]`, each bound printed only to the digits its Monte-Carlo error leaves stable."""
    lo_err, hi_err = errors if errors else (None, None)
    return f"[{fmt_bound(lo, lo_err)}, {fmt_bound(hi, hi_err)}]"


def _ci(r: dict[str, Any]) -> str:
    return f"{r['median']:.2f}× {fmt_interval(*r['ci95'], r.get('ci95_mc'))}"


def _span(span: Sequence[float] | None) -> str:
    """A [low, high] reading as one value when the two agree to a decimal, else `low–high`."""
    if not span:
        return "-"
    lo, hi = (format(x, ".1f") for x in span)
    return lo if lo == hi else f"{lo}–{hi}"


def effective(summ: dict[str, Any]) -> str:
    """t1/t0 from the `ar` rounds, excess on the links; excess on the peers' steps (`effective_ratio`); a range
    where older runs could not be placed in the stretches, whose links differed."""
    eff = summ.get("effective_ratio")
    return f"{_span(eff['t1_eff_over_t0'])}; {_span(eff['t1_over_t0_eff'])}" if eff else "-"


def set_apart_count(setting: dict[str, Any]) -> int:
    """How many runs of a setting were set apart (reasons in the provenance list above the tables)."""
    return sum(len(g["runs"]) for g in set_apart_groups(setting))


def _get(ratios: dict[str, Any], key: str) -> str:
    return _ci(ratios[key]) if key in ratios else "-"


PANELS = ("dsd/ar", "sd/ar", "dsd/sd", "dsd/ar decode", "sd/ar decode")  # the grid plot's; the rest stay in the tables
MAIN_RATIOS = frozenset(PANELS)  # the first table's ratio columns; every other ratio goes to the table of the rest


def markdown_table(results: dict[str, Any]) -> str:
    """The tables, each cell with its machine: the paired speedups per setting (median, 95 % CI; bounds to their
    stable digits) with t1/t0 as the `ar` rounds measured it, every mode's figures, where a run's time goes, and
    the other paired ratios (trees, pipelines, send-ahead rules, pinning)."""
    lines = ["| model | N | t1/t0 | t1/t0 from ar (links; peers) | machine | t0 ms | t1 ms | dsd/ar | sd/ar | dsd/sd | "
             "dsd/ar decoding | model dsd/ar | sd/ar decoding | model sd/ar | ready (dsd) | pairs | set apart | "
             "load before → after |", "|" + "---|" * 18]
    rows = ["| model | N | t1/t0 | machine | mode | tok/s (median, 95 % CI) | tokens/trip | k̄ | drafted/window | tree windows "
            "| ready | sent ahead | drafting hidden & used | wasted s | exposed s | bytes/tok | = ref | pass@1 |", "|" + "---|" * 18]
    times = ["| model | N | t1/t0 | machine | mode | " + " | ".join(RUN_PARTS) + " |", "|" + "---|" * (5 + len(RUN_PARTS))]
    trees = ["| model | N | t1/t0 | machine | ratio | tok/s (median, 95 % CI) | tokens/trip (median, 95 % CI) | pairs |",
             "|" + "---|" * 8]
    for s in results["settings_runs"]:
        summ, cal, prov = s.get("summary") or {}, s["calibration"], s["provenance"]
        machine = cell_machine(s)
        ratios, modes = summ.get("ratios", {}), summ.get("modes", {})
        dsd = modes.get("dsd", {})
        model = {m: fmt((modes.get(m, {}).get("model") or {}).get("speedup_vs_ar")) for m in ("dsd", "sd")}
        load = f"{prov['load_before'][0]:.1f} → {prov.get('load_after', [float('nan')])[0]:.1f}"
        lines.append(
            f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {effective(summ)} | {machine} | {cal['t0_s'] * 1000:.0f} | "
            f"{cal['latency_ms']:.0f} | "
            f"{_get(ratios, 'dsd/ar')} | {_get(ratios, 'sd/ar')} | {_get(ratios, 'dsd/sd')} | {_get(ratios, 'dsd/ar decode')} | {model['dsd']}× | "
            f"{_get(ratios, 'sd/ar decode')} | {model['sd']}× | "
            f"{fmt(dsd.get('ready_share'))} | {ratios.get('dsd/ar', {}).get('pairs', 0)} | {set_apart_count(s)} | {load} |")
        for mode, r in modes.items():
            med, lo, hi = r["median_tokens_per_s"]
            same = next((v for k, v in r.items() if k.startswith("identical_to_")), "-")
            rows.append(
                f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {machine} | {mode} | "
                f"{med:.2f} {fmt_interval(lo, hi, r.get('median_tokens_per_s_mc'))} | "
                f"{r['tokens_per_trip']:.2f} | {r['mean_accepted']:.2f} | {r['mean_gamma']:.1f} | "
                f"{r.get('tree_window_share', 0.0) * 100:.0f} % | {r['ready_share'] * 100:.0f} % | "
                f"{r.get('pipelined_share', 0.0) * 100:.0f} % | {r['hidden_used_share'] * 100:.0f} % | {r['drafting_hidden_wasted_s']:.1f} | "
                f"{r['drafting_exposed_s']:.1f} | {r['bytes_per_token'] / 1024:.0f} KiB | {same} | "
                f"{fmt(r.get('pass_at_1'))} |")
            parts = r.get("run_s") or {}
            times.append(f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {machine} | {mode} | "
                         + " | ".join(fmt(parts.get(p), ".1f") for p in RUN_PARTS) + " |")
        for name, r in ratios.items():
            if name not in MAIN_RATIOS and not name.endswith(("tokens/trip", "decode")):
                trip = ratios.get(f"{name} tokens/trip")
                trees.append(f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {machine} | {name} | {_ci(r)} | "
                             f"{_ci(trip) if trip else '-'} | {r['pairs']} |")
    out = "\n".join(lines) + "\n\n" + "\n".join(rows) + "\n"
    out += ("\nWhere a run's time goes (s, the median over the mode's runs of each part; the prompt's trip yields "
            "the first token; waiting is for verdicts, that trip included; drafting is the head's; medians of parts "
            "need not add up to the run's; a bet on a window in flight leaves this long after that window):\n\n" + "\n".join(times) + "\n")
    if len(trees) > 2:
        out += ("\nThe other paired ratios, per prompt and repetition: token trees (--tree-nodes as given; auto: the "
                "controller decides) vs chains (-chain), dsd's pipeline vs one window in flight (-serial), the bet sent "
                "ahead alone vs once every branch is drafted (-batched), the head on its own CPU vs sharing every CPU "
                "(-shared):\n\n")
        out += "\n".join(trees) + "\n"
    fed = results.get("federated")
    if fed:
        out += f"\nFederated (from `{fed['source']}`): {fed['summary']}\n"
    return out


def _model(summ: dict[str, Any], name: str) -> float | None:
    """The model's speedup for a `mode/ar decode` ratio: it describes decoding after the prompt's trip."""
    if not name.endswith("/ar decode"):
        return None
    return (summ["modes"][name.split("/")[0]]["model"] or {}).get("speedup_vs_ar")


def plot(results: dict[str, Any], path: Path) -> None:
    """Median speedups with 95 % CI bars, the model as crosses beside decoding: over t1/t0 (one panel
    per ratio, one line per N) when the file holds several t1/t0, else every paired ratio side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in results["settings_runs"] if (s.get("summary") or {}).get("ratios")]
    if len({s["ratio"] for s in settings}) > 1:
        fig = _plot_over_ratio(plt, settings)
    else:
        fig = _plot_one_ratio(plt, settings)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_over_ratio(plt: Any, settings: list[dict[str, Any]]) -> Any:
    """The grid's panels from its complete cells: a running cell's few pairs would read as a result."""
    settings = [s for s in settings if cell_complete(s)]
    series: dict[tuple[str, int], list[tuple[float, float, float, float, float | None]]] = {}
    ready: dict[int, list[tuple[float, float]]] = {}
    for s in settings:
        for name, r in s["summary"]["ratios"].items():
            if name in PANELS:
                series.setdefault((name, s["peers"]), []).append((s["ratio"], r["median"], *r["ci95"], _model(s["summary"], name)))
        if "dsd" in s["summary"]["modes"]:
            ready.setdefault(s["peers"], []).append((s["ratio"], 100 * s["summary"]["modes"]["dsd"]["ready_share"]))
    peers = sorted({n for _, n in series})
    fig, axes = plt.subplots(2, 3, figsize=(12, 7.5))
    for ax, name in zip(axes.flat, PANELS, strict=False):
        for i, n in enumerate(peers):
            pts = sorted(series.get((name, n), []))
            if not pts:
                continue
            shift = 0.08 * (i - (len(peers) - 1) / 2)  # side by side, so the CI bars of one t1/t0 do not hide each other
            xs = [p[0] + shift for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        fmt="o-", color=f"C{i}", capsize=3, label=f"N = {n}")
            if all(p[4] is not None for p in pts):
                ax.plot(xs, [p[4] for p in pts], "x--", color=f"C{i}", alpha=0.6)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(name.replace(" decode", ", decoding (x: model)") + ("" if name.endswith("decode") else ", end to end"))
        ax.set_xlabel("t1 / t0")
        ax.legend(fontsize=8)
    ax = axes.flat[len(PANELS)]
    for i, n in enumerate(peers):
        pts = sorted(ready.get(n, []))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=f"N = {n}")
    ax.set_ylim(0, 100)
    ax.set_title("dsd: windows ready at the verdict (%)")
    ax.set_xlabel("t1 / t0")
    ax.legend(fontsize=8)
    for row in axes:
        row[0].set_ylabel("speedup (median, 95 % CI)")
    fig.suptitle("DSD over an emulated WAN (HumanEval, greedy; t1 one-way link latency, t0 one peer's step; "
                 "complete cells only)")
    return fig


def _plot_one_ratio(plt: Any, settings: list[dict[str, Any]]) -> Any:
    names = [n for n in dict.fromkeys(k for s in settings for k in s["summary"]["ratios"]) if not n.endswith("tokens/trip")]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.2))
    for i, s in enumerate(settings):
        ratios, shift = s["summary"]["ratios"], 0.1 * (i - (len(settings) - 1) / 2)
        xs = [j + shift for j, n in enumerate(names) if n in ratios]
        rs = [ratios[n] for n in names if n in ratios]
        ax.errorbar(xs, [r["median"] for r in rs], yerr=[[r["median"] - r["ci95"][0] for r in rs],
                                                         [r["ci95"][1] - r["median"] for r in rs]],
                    fmt="o", color=f"C{i}", capsize=3, label=f"N = {s['peers']}, t1/t0 = {s['ratio']:g}")
        model = [(j + shift, m) for j, n in enumerate(names) if n in ratios and (m := _model(s["summary"], n)) is not None]
        if model:
            ax.plot(*zip(*model, strict=True), "x", color=f"C{i}", ms=9, label="model" if i == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("speedup (median, 95 % CI); decode: after the prompt's trip")
    ax.set_title("Paired speedups over an emulated WAN (HumanEval, greedy)")
    ax.legend(fontsize=8)
    return fig


def _planned_pairs(setting: dict[str, Any]) -> int:
    """How many (prompt, repetition) pairs the setting's options ask for; 0 when the file predates options."""
    opts = setting.get("options") or {}
    return len(opts.get("problems", ())) * opts.get("reps", 0)


def cell_complete(setting: dict[str, Any]) -> bool:
    """Whether a setting has paired every prompt and repetition it planned: a running cell's partial
    medians are shown as such in the matrix and left out of the plot."""
    ratios = (setting.get("summary") or {}).get("ratios", {})
    return "dsd/ar" not in ratios or ratios["dsd/ar"]["pairs"] >= _planned_pairs(setting)


def grid_matrix(results: dict[str, Any]) -> str:
    """The settings as an N × t1/t0 matrix of dsd/ar (dsd/sd) with each cell's machine as a mark explained below
    it: the grid at a glance, and which cells may be compared; '…' = not finished."""
    cells: dict[tuple[int, float], str] = {}
    marks: dict[str, str] = {}
    for s in results["settings_runs"]:
        ratios = (s.get("summary") or {}).get("ratios", {})
        if "dsd/ar" in ratios:
            mark = marks.setdefault(cell_machine(s), f"m{len(marks) + 1}")
            vs_sd = f" ({ratios['dsd/sd']['median']:.2f}× sd)" if "dsd/sd" in ratios else ""
            cells[(s["peers"], s["ratio"])] = (f"{_ci(ratios['dsd/ar'])}{vs_sd} {mark}"
                                               + ("" if cell_complete(s) else f" … {ratios['dsd/ar']['pairs']} of {_planned_pairs(s)} pairs"))
    if not cells:
        return ""
    ns, rs = sorted({n for n, _ in cells}), sorted({r for _, r in cells})
    lines = ["| dsd/ar [95 % CI] (dsd/sd) machine | " + " | ".join(f"t1/t0 = {r:g}" for r in rs) + " |", "|---" * (len(rs) + 1) + "|"]
    lines += [f"| N = {n} | " + " | ".join(cells.get((n, r), "-") for r in rs) + " |" for n in ns]
    return "\n".join(lines) + "\n\nMachines: " + "; ".join(f"{m}: {label}" for label, m in marks.items()) + ".\n"


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


def resumed_speed(resume: dict[str, Any]) -> str:
    """The step time re-measured when a setting resumed, and the link latency that then held its t1/t0."""
    if "t0_s" not in resume:
        return ""
    links = f", links {resume['latency_ms']:.0f} ms" if "latency_ms" in resume else ""
    return f" (t0 then {resume['t0_s'] * 1000:.0f} ms{links})"


def set_apart_note(setting: dict[str, Any]) -> str:
    """The runs set apart from a setting, per reason, when and on which commit (older files: reason only)."""
    return "".join(f"; {len(g['runs'])} runs set apart"
                   + (f" on {g['when']} ({(g['commit'] or '?')[:12]})" if g.get("when") else "") + f": {g['reason']}"
                   for g in set_apart_groups(setting))


def write_outputs(results: dict[str, Any], stem: Path) -> None:
    """The results JSON, and the Markdown (provenance, stretches, matrix, tables) and plot made from it."""
    attach_federated(results)
    write_json(stem.with_suffix(".json"), results)
    prov = "\n".join(
        f"- {s['key']}{f' (from {m})' if (m := s.get('merged_from')) else ''}: commit {s['provenance']['commit'][:12]}{' (dirty)' if s['provenance']['dirty'] else ''}, "
        f"`{s['provenance']['command']}`, {len(s['runs'])} runs"
        + "".join(f"; resumed on {r['commit'][:12]} at {r['started']}{resumed_speed(r)}"
                  for r in s["provenance"].get("resumed", []))
        + (f"; {n} failed (not counted, their prompts ran again)" if (n := len(s.get("failed", []))) else "")
        + set_apart_note(s)
        for s in results["settings_runs"])
    matrix = grid_matrix(results)
    stem.with_suffix(".md").write_text(f"# {results['name']} ({results['date']})\n\n{prov}\n\n"
                                       + "Where and when each setting ran (its start, then each resume):\n\n"
                                       + f"{stretches_table(results)}\n"
                                       + (f"{matrix}\n" if matrix else "") + markdown_table(results))
    if any(s.get("summary") for s in results["settings_runs"]):
        plot(results, stem.with_suffix(".png"))
