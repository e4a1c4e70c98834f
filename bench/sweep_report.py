"""The DSD report's outputs: the markdown table, the speedup plot, the federated row and the files."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, write_json


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _ci(r: dict[str, Any]) -> str:
    return f"{r['median']:.2f}× [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"


def _get(ratios: dict[str, Any], key: str) -> str:
    return _ci(ratios[key]) if key in ratios else "-"


def markdown_table(results: dict[str, Any]) -> str:
    """Two tables: the paired speedups per setting (median, 95 % CI), then every mode's figures."""
    lines = ["| model | N | t1/t0 | t0 ms | t1 ms | dsd/ar | sd/ar | dsd/sd | dsd/ar decoding | model dsd/ar | "
             "sd/ar decoding | model sd/ar | ready (dsd) | pairs | load before → after |", "|" + "---|" * 15]
    rows = ["| model | N | t1/t0 | mode | tok/s (median, 95 % CI) | tokens/trip | k̄ | drafted/window | tree windows "
            "| ready | sent ahead | drafting hidden & used | wasted s | exposed s | bytes/tok | = ref | pass@1 |", "|" + "---|" * 17]
    trees = ["| model | N | t1/t0 | ratio | tok/s (median, 95 % CI) | tokens/trip (median, 95 % CI) | pairs |",
             "|" + "---|" * 7]
    for s in results["settings_runs"]:
        summ, cal, prov = s.get("summary") or {}, s["calibration"], s["provenance"]
        ratios, modes = summ.get("ratios", {}), summ.get("modes", {})
        dsd = modes.get("dsd", {})
        model = {m: fmt((modes.get(m, {}).get("model") or {}).get("speedup_vs_ar")) for m in ("dsd", "sd")}
        load = f"{prov['load_before'][0]:.1f} → {prov.get('load_after', [float('nan')])[0]:.1f}"
        lines.append(
            f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {cal['t0_s'] * 1000:.0f} | {cal['latency_ms']:.0f} | "
            f"{_get(ratios, 'dsd/ar')} | {_get(ratios, 'sd/ar')} | {_get(ratios, 'dsd/sd')} | {_get(ratios, 'dsd/ar decode')} | {model['dsd']}× | "
            f"{_get(ratios, 'sd/ar decode')} | {model['sd']}× | "
            f"{fmt(dsd.get('ready_share'))} | {ratios.get('dsd/ar', {}).get('pairs', 0)} | {load} |")
        for mode, r in modes.items():
            med, lo, hi = r["median_tokens_per_s"]
            same = next((v for k, v in r.items() if k.startswith("identical_to_")), "-")
            rows.append(
                f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {mode} | {med:.2f} [{lo:.2f}, {hi:.2f}] | "
                f"{r['tokens_per_trip']:.2f} | {r['mean_accepted']:.2f} | {r['mean_gamma']:.1f} | "
                f"{r.get('tree_window_share', 0.0) * 100:.0f} % | {r['ready_share'] * 100:.0f} % | "
                f"{r.get('pipelined_share', 0.0) * 100:.0f} % | {r['hidden_used_share'] * 100:.0f} % | {r['drafting_hidden_wasted_s']:.1f} | "
                f"{r['drafting_exposed_s']:.1f} | {r['bytes_per_token'] / 1024:.0f} KiB | {same} | "
                f"{fmt(r.get('pass_at_1'))} |")
        for name, r in ratios.items():
            if ("-chain" in name or "-serial" in name) and not name.endswith(("tokens/trip", "decode")):
                trip = ratios.get(f"{name} tokens/trip")
                trees.append(f"| {s['models']} | {s['peers']} | {s['ratio']:g} | {name} | {_ci(r)} | "
                             f"{_ci(trip) if trip else '-'} | {r['pairs']} |")
    out = "\n".join(lines) + "\n\n" + "\n".join(rows) + "\n"
    if len(trees) > 2:
        out += ("\nToken trees (--tree-nodes as given; auto: the controller decides) vs chains, and dsd's pipeline vs one "
                "window in flight (dsd-serial), paired per prompt and repetition:\n\n")
        out += "\n".join(trees) + "\n"
    fed = results.get("federated")
    if fed:
        out += f"\nFederated (from `{fed['source']}`): {fed['summary']}\n"
    return out


PANELS = ("dsd/ar", "sd/ar", "dsd/sd", "dsd/ar decode", "sd/ar decode")  # the grid plot's; the rest stay in the tables


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
    """The settings as an N × t1/t0 matrix of dsd/ar (dsd/sd): the grid at a glance; '…' = not finished."""
    cells: dict[tuple[int, float], str] = {}
    for s in results["settings_runs"]:
        ratios = (s.get("summary") or {}).get("ratios", {})
        if "dsd/ar" in ratios:
            cells[(s["peers"], s["ratio"])] = (f"{_ci(ratios['dsd/ar'])} ({ratios['dsd/sd']['median']:.2f}× sd)"
                                               + ("" if cell_complete(s) else f" … {ratios['dsd/ar']['pairs']} of {_planned_pairs(s)} pairs"))
    if not cells:
        return ""
    ns, rs = sorted({n for n, _ in cells}), sorted({r for _, r in cells})
    lines = ["| dsd/ar [95 % CI] (dsd/sd) | " + " | ".join(f"t1/t0 = {r:g}" for r in rs) + " |", "|---" * (len(rs) + 1) + "|"]
    lines += [f"| N = {n} | " + " | ".join(cells.get((n, r), "-") for r in rs) + " |" for n in ns]
    return "\n".join(lines) + "\n"


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


def write_outputs(results: dict[str, Any], stem: Path) -> None:
    attach_federated(results)
    write_json(stem.with_suffix(".json"), results)
    prov = "\n".join(
        f"- {s['key']}{f' (from {m})' if (m := s.get('merged_from')) else ''}: commit {s['provenance']['commit'][:12]}{' (dirty)' if s['provenance']['dirty'] else ''}, "
        f"`{s['provenance']['command']}`, {len(s['runs'])} runs"
        + "".join(f"; resumed on {r['commit'][:12]} at {r['started']}{resumed_speed(r)}"
                  for r in s["provenance"].get("resumed", []))
        + (f"; {n} failed (not counted, their prompts ran again)" if (n := len(s.get("failed", []))) else "")
        + "".join(f"; {n} discarded ({why})" for why, n in Counter(r["reason"] for r in s.get("discarded", [])).items())
        for s in results["settings_runs"])
    matrix = grid_matrix(results)
    stem.with_suffix(".md").write_text(f"# {results['name']} ({results['date']})\n\n{prov}\n\n"
                                       + (f"{matrix}\n" if matrix else "") + markdown_table(results))
    if any(s.get("summary") for s in results["settings_runs"]):
        plot(results, stem.with_suffix(".png"))

