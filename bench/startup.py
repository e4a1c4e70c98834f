"""Start-up costs of the command line and of a local testnet: what every command and every test pays.

Per repetition, interleaved (the machine is shared, so compare within a run):
- `dsd-node --help` and `dsd-node testnet status` (a command that only reads a state file);
- `testnet up` of a tiny 3-peer testnet with `--spawn exec` (a new interpreter per daemon, as before
  forking) and `--spawn fork` (the daemons forked from `testnet up`), in alternating order, and the
  `testnet down` of each.
Reports the median, min and max of each time over the repetitions and the per-repetition ratio exec/fork,
with the load average before and after; writes bench/results/startup-DATE.json.

    python bench/startup.py            # 5 repetitions, about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    command_line,
    run_metadata,
    spread,
    today,
    write_json,
)


def dsd_node(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    """Run `dsd-node ARGS` as a user's shell would; its wall time and result (a failure stops the benchmark)."""
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dsd.node.cli", *args], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"dsd-node {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done


def one_testnet(store: Path, state: Path, spawn: str, peers: int) -> dict[str, float]:
    """Bring a testnet up with `--spawn` and down again; the seconds each took."""
    up_s, up = dsd_node("testnet", "up", "--store", str(store), "--peers", str(peers), "--state", str(state),
                        "--spawn", spawn, "--json")
    status_s, _ = dsd_node("testnet", "status", "--state", str(state))
    down_s, _ = dsd_node("testnet", "down", "--state", str(state))
    return {"up_s": up_s, "up_reported_s": json.loads(up.stdout)["up_seconds"], "status_s": status_s,
            "down_s": down_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--peers", type=int, default=3, help="block peers of the tiny testnet (default 3)")
    args = p.parse_args(argv)
    results: dict[str, Any] = {**run_metadata("startup", args), "command": command_line("startup.py", sys.argv[1:]),
                               "peers": args.peers, "load_before": os.getloadavg(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="dsd-startup-") as tmp:
        store = build_tiny_store(Path(tmp) / "tiny", layers=5)
        for rep in range(args.reps):
            help_s, _ = dsd_node("--help")
            order = ("exec", "fork") if rep % 2 == 0 else ("fork", "exec")
            for spawn in order:
                run = {"rep": rep, "spawn": spawn, "help_s": help_s,
                       **one_testnet(store, Path(tmp) / f"state-{rep}-{spawn}", spawn, args.peers)}
                results["runs"].append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    results["load_after"] = os.getloadavg()
    runs = results["runs"]
    summary: dict[str, Any] = {"help_s": spread([r["help_s"] for r in runs if r["spawn"] == "fork"])}
    for spawn in ("exec", "fork"):
        mine = [r for r in runs if r["spawn"] == spawn]
        summary[spawn] = {k: spread([r[k] for r in mine]) for k in ("up_s", "up_reported_s", "status_s", "down_s")}
    by_rep = {(r["rep"], r["spawn"]): r for r in runs}
    summary["up_exec_over_fork"] = spread([by_rep[(i, "exec")]["up_s"] / by_rep[(i, "fork")]["up_s"]
                                           for i in range(args.reps)])
    results["summary"] = summary
    write_json(RESULTS_DIR / f"startup-{today()}.json", results)
    print(json.dumps(summary, indent=1))
    return results


if __name__ == "__main__":
    main()
