"""The DSD report's outputs: the markdown table, the speedup plot, the federated row and the files."""

from __future__ import annotations

import json
import math
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
    lines = ["| model | N | t1/t0 | t0 ms | t1 ms | dsd/ar | sd/ar | dsd/sd | model dsd/ar | model sd/ar | "
             "ready (dsd) | pairs | load before → after |", "|" + "---|" * 13]
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
            f"{_get(ratios, 'dsd/ar')} | {_get(ratios, 'sd/ar')} | {_get(ratios, 'dsd/sd')} | {model['dsd']}× | {model['sd']}× | "
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
            if ("-chain" in name or "-serial" in name) and not name.endswith("tokens/trip"):
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


def plot(results: dict[str, Any], path: Path) -> None:
    """Median end-to-end speedup vs t1/t0 with 95 % CI bars, one line per (N, ratio); the model dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[int, str], list[tuple[float, float, float, float, float | None]]] = {}
    for s in results["settings_runs"]:
        summ = s.get("summary") or {}
        for name, r in summ.get("ratios", {}).items():
            model = None
            if name in ("dsd/ar", "sd/ar"):
                model = (summ["modes"][name.split("/")[0]]["model"] or {}).get("speedup_vs_ar")
            series.setdefault((s["peers"], name), []).append((s["ratio"], r["median"], *r["ci95"], model))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((n, name), pts) in enumerate(sorted(series.items())):
        pts.sort()
        xs = [p[0] for p in pts]
        color = f"C{i % 10}"
        ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                    fmt="o-", color=color, capsize=3, label=f"N={n} {name}")
        if all(p[4] is not None for p in pts):
            ax.plot(xs, [p[4] for p in pts], "x--", color=color, alpha=0.6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("t1 / t0 (one-way link latency / one peer's decode step)")
    ax.set_ylabel("end-to-end speedup (median, 95 % CI; dashed: model)")
    ax.set_title("DSD over an emulated WAN (HumanEval, greedy)")
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
        for s in results["settings_runs"])
    stem.with_suffix(".md").write_text(f"# {results['name']} ({results['date']})\n\n{prov}\n\n" + markdown_table(results))
    if any(s.get("summary") for s in results["settings_runs"]):
        plot(results, stem.with_suffix(".png"))

