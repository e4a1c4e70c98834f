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

import dsd_sweep
from harness import RESULTS_DIR, today

PROBLEMS = "0,2,7"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real")
    p.add_argument("--problems", default=PROBLEMS, help=f"HumanEval problem indices (default {PROBLEMS})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if any(m not in ("tiny", "real") for m in models):
        p.error(f"--models takes tiny and/or real, got {args.models!r}")
    summary = {}
    for m in models:
        name = f"head_modes-{m}"
        rc = dsd_sweep.main(["--models", m, "--peers", "4", "--ratios", "5", "--problems", args.problems,
                             "--max-new-tokens", str(args.max_new_tokens), "--name", name])
        if rc:
            return rc
        data = json.loads((RESULTS_DIR / f"{name}-{today()}.json").read_text())
        s = data["settings_runs"][-1]
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
