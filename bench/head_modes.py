"""The head-mode benchmark (issue 5): ar, sd, dsd, dsd-adaptive on a 4-peer testnet with t1 ≈ 5·t0,
with the tiny model (a random target drafting for itself) and with the real pair, on 3 HumanEval
prompts. A preset of bench/dsd_sweep.py (same code, same outputs); prints the summary as JSON.

    python bench/head_modes.py                   # tiny and real
    python bench/head_modes.py --models tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dsd_sweep import run_sweep
from harness import comma_list, command_line, model_kinds
from sweep_options import SweepOptions

PROBLEMS = "0,2,7"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real")
    p.add_argument("--problems", default=PROBLEMS, help=f"HumanEval problem indices (default {PROBLEMS})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    models = model_kinds(p, args.models)
    problems = comma_list(p, "--problems", args.problems, int)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    command = command_line("head_modes.py", argv if argv is not None else sys.argv[1:])
    summary = {}
    for m in models:
        opts = SweepOptions(models=m, peers=[4], ratios=[5.0], problems=problems,
                            max_new_tokens=args.max_new_tokens, name=f"head_modes-{m}")
        s = run_sweep(opts, command)["settings_runs"][-1]
        summary[m] = {
            "t0_ms": round(s["t0_s"] * 1000, 2), "t1_ms": round(s["latency_ms"], 2),
            "modes": {mode: {"tokens_per_s": round(r["tokens_per_s"], 3), "speedup": round(r.get("speedup", 1.0), 3),
                             "mean_accepted": round(r["mean_accepted"], 3),
                             "drafting_hidden_share": round(r["hidden_share"], 3),
                             "identical_to_ar": r["identical_to_ar"]}
                      for mode, r in s["summary"].items()},
        }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
