"""Wire codecs under a bandwidth limit: one cell (N peers on a link profile with a bandwidth, `home` by default:
10 Mbit/s uplinks) run once per hidden-state codec — exact (fp32 raw for the fp32 models), bf16, int8 + zstd —
with the peers and the head both encoding as the codec says. Per codec and mode: tok/s (median, 95 % CI over
prompts), bytes per new token on the head's two links (sent to the first peer; received from the last, which
the middle links carry alike), the speedup over the exact codec paired by prompt and repetition, and how many
outputs equal the exact codec's (bf16 and int8 round the activations: greedy output may change).

The settings are the sweep's own (`dsd_sweep.py`, same results file, resumable, provenance per setting); the
codecs run one after another (each needs its own testnet), so their pairs are the same prompt and repetition,
not adjacent in time. Prints the comparison as JSON and writes it beside the sweep's results (<stem>-codecs.json
and .md).

    python bench/wire_codecs.py --pin-head                     # N = 4, home links, ar/sd/dsd, 10 prompts x 3
    python bench/wire_codecs.py --models tiny --peers 2 --problems 0 --reps 1 --max-new-tokens 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsd_sweep import run_sweep
from harness import MODEL_KINDS, comma_list, command_line, write_json
from sweep_model import MODES, ratio_summary
from sweep_options import PROBLEMS, SweepOptions
from sweep_provenance import wire_label
from sweep_report import fmt_interval

from dsd.node.cli.options import HIDDEN_CODECS
from dsd.node.testnet.link_profiles import PROFILES, named

CODECS = ("auto", "bf16", "int8+zstd")  # exact (the compute dtype's), half, 8-bit blocks compressed


def wire_of(label: str) -> tuple[str, bool]:
    """`int8+zstd` -> ("int8", True); `auto` -> ("auto", False)."""
    codec, _, z = label.partition("+")
    return codec, z == "zstd"


def per_token_bytes(run: dict[str, Any]) -> tuple[float, float]:
    """Bytes per new token the head sent (to the first peer) and received (from the last) in one run."""
    n = max(1, run["new_tokens"])
    return run["bytes_sent"] / n, run["bytes_received"] / n


def compare(settings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per codec setting and mode: tok/s, bytes per token, the paired speedup over the exact codec's runs and the
    share of outputs equal to them. `settings` in order, the exact codec first."""
    exact = settings[0]
    exact_runs = {(r["mode"], r["task_id"], r["rep"]): r for r in exact["runs"] if "error" not in r}
    out: dict[str, Any] = {}
    for s in settings:
        label = wire_label(s["options"].get("codec", "auto"), bool(s["options"].get("zstd")))
        modes: dict[str, Any] = {}
        for mode in [m for m in MODES if any(r["mode"] == m for r in s["runs"])]:
            mine = [r for r in s["runs"] if r["mode"] == mode and "error" not in r]
            row = s.get("summary", {}).get("modes", {}).get(mode, {})
            sent, received = zip(*(per_token_bytes(r) for r in mine), strict=True) if mine else ((), ())
            groups: dict[str, list[float]] = {}
            same = []
            for r in mine:
                ref = exact_runs.get((mode, r["task_id"], r["rep"]))
                if ref is not None and ref["tokens_per_s"] > 0:
                    groups.setdefault(r["task_id"], []).append(r["tokens_per_s"] / ref["tokens_per_s"])
                    same.append(r["tokens"] == ref["tokens"])
            modes[mode] = {
                "runs": len(mine), "tokens_per_s": row.get("median_tokens_per_s"),
                "tokens_per_s_mc": row.get("median_tokens_per_s_mc"),
                "sent_bytes_per_token": statistics.median(sent) if sent else None,
                "received_bytes_per_token": statistics.median(received) if received else None,
                "vs_exact": ratio_summary(list(groups.values())) if groups and s is not exact else None,
                "identical_to_exact": f"{sum(same)}/{len(same)}" if same else "-",
            }
        out[label] = {"key": s["key"], "modes": modes}
    return out


def markdown(comparison: dict[str, Any], profile: str) -> str:
    """The comparison as one table."""
    lines = [f"Wire codecs on `{profile}` links: tok/s median (95 % CI over prompts), bytes per new token on the "
             "head's links, speedup over the exact codec (same prompt and repetition), outputs equal to its.", "",
             "| codec | mode | runs | tok/s | sent B/token | received B/token | vs exact | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for label, c in comparison.items():
        for mode, m in c["modes"].items():
            tps = m["tokens_per_s"]
            tok = f"{tps[0]:.3f} {fmt_interval(tps[1], tps[2], m['tokens_per_s_mc'])}" if tps else "-"
            vs = m["vs_exact"]
            vs_text = f"{vs['median']:.2f}× {fmt_interval(*vs['ci95'], vs.get('ci95_mc'))}" if vs else "-"
            lines.append(f"| {label} | {mode} | {m['runs']} | {tok} | {m['sent_bytes_per_token'] or 0:,.0f} | "
                         f"{m['received_bytes_per_token'] or 0:,.0f} | {vs_text} | {m['identical_to_exact']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> tuple[SweepOptions, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", choices=MODEL_KINDS, default="real")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--link-profile", choices=sorted(PROFILES), default="home",
                   help="a profile with a bandwidth limit and its own latency (default home)")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"codecs in order, the exact one first (default {','.join(CODECS)})")
    p.add_argument("--modes", default="ar,sd,dsd")
    p.add_argument("--problems", default=",".join(map(str, PROBLEMS)))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-quant", choices=("none", "int8"), default="int8")
    p.add_argument("--pin-head", action="store_true", help="the head on its own CPU (as dsd_sweep.py)")
    p.add_argument("--results", type=Path, default=None, help="the sweep's results JSON (default bench/results/wire_codecs-<date>.json)")
    p.add_argument("--state", type=Path, default=Path(".dsd/bench"))
    args = p.parse_args(argv)
    if named(args.link_profile).latency_ms is None or named(args.link_profile).mbit is None:
        p.error(f"--link-profile {args.link_profile}: choose one with its own latency and a bandwidth limit (home)")
    codecs = comma_list(p, "--codecs", args.codecs, str)
    if codecs[0] != "auto":
        p.error("--codecs: the exact codec (auto) comes first: the others are compared with it")
    for c in codecs:
        if wire_of(c)[0] not in HIDDEN_CODECS:
            p.error(f"--codecs: unknown codec {c!r}")
    modes = comma_list(p, "--modes", args.modes, str)
    opts = SweepOptions(models=args.models, peers=[args.peers], problems=comma_list(p, "--problems", args.problems, int),
                        modes=modes, reps=args.reps, max_new_tokens=args.max_new_tokens, draft_quant=args.draft_quant,
                        pin_head=args.pin_head, link_profile=args.link_profile, name="wire_codecs",
                        results=args.results, state=args.state)
    return opts, codecs


def main(argv: Sequence[str] | None = None) -> int:
    opts, codecs = parse_args(argv)
    command = command_line("wire_codecs.py", argv if argv is not None else sys.argv[1:])
    settings = []
    for label in codecs:
        codec, zstd = wire_of(label)
        one = replace(opts, codec=codec, zstd=zstd, results=opts.stem.with_suffix(".json"))
        results = run_sweep(one, command)
        settings.append(next(s for s in results["settings_runs"] if s["key"] == one.key(opts.peers[0], None)))
    comparison = {"profile": opts.link_profile, "peers": opts.peers[0], "codecs": compare(settings)}
    stem = opts.stem
    write_json(Path(f"{stem}-codecs.json"), comparison)
    Path(f"{stem}-codecs.md").write_text(markdown(comparison["codecs"], opts.link_profile))
    print(json.dumps(comparison, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
