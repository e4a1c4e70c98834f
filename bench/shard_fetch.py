"""Shard-transfer benchmark (issue 16): fetch throughput of a span on loopback from 1 and from 3 seeders,
and the time from `dsd-node start --model ... --manifest-sha256 ...` (no local store) to serving.

Seeders are real daemons serving the whole store (each loads one layer; the shard protocol serves
every file its store holds). Each fetch goes into a fresh directory through `dsd-node store fetch
--json`; the numbers are the fetcher's own (first request to last file verified and renamed) and
the command's wall time. Start-to-serving is the wall time until the newcomer's ready file
appears: join, fetch, load and throughput measurement included.

    python bench/shard_fetch.py --models tiny            # a random 8-layer, 512-wide model (~100 MB)
    python bench/shard_fetch.py --models real --span 7:14   # the default target: 7 layers, ~1.7 GB fp32
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    comma_list,
    model_kinds,
    run_metadata,
    today,
    write_json,
)

from dsd.node.fetch.local import manifest_sha256
from dsd.node.testnet.processes import daemon_command, spawn, stop_processes, wait_ready
from dsd.shard_store import Store

DEFAULT_SPANS = {"tiny": "4:8", "real": "7:14"}


def store_for(kind: str, work: Path, hidden: int) -> Path:
    if kind == "tiny":
        return build_tiny_store(work / f"tiny-{hidden}", hidden=hidden, layers=8)
    from dsd.shard_store.default_models import default_store_paths, prepared

    if not prepared(weights="fp32"):
        raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
    return default_store_paths(weights="fp32")["target"]


def start_seeders(store: Path, count: int, state: Path, timeout_s: float) -> tuple[str, list[Any]]:
    """A bootstrap node and `count` seeders of `store`; returns the bootstrap address and the processes."""
    def launch(name: str, *args: str) -> Any:
        return spawn(name, ["start", *args, "--identity", str(state / f"{name}.key"),
                            "--ready-file", str(state / f"{name}.json"), "--threads", "1"], state)

    for stale in state.glob("*.json"):  # ready files of an earlier run in the same --work folder
        stale.unlink()
    boot = launch("bootstrap", "--bootstrap-only")
    procs = [boot]
    try:
        bootstrap = wait_ready(state / "bootstrap.json", boot, timeout_s)["addrs"][0]
        seeders = [launch(f"seeder{i}", "--store", str(store), "--blocks", "0:1", "--bootstrap", bootstrap)
                   for i in range(count)]
        procs += seeders
        for s in seeders:
            wait_ready(state / f"{s.name}.json", s, timeout_s)
    except BaseException:
        stop_processes([p.pid for p in reversed(procs)])
        raise
    return bootstrap, procs


def fetch_once(model: str, sha: str, span: str, bootstrap: str, peers: int, out: Path) -> dict[str, Any]:
    """One `store fetch` into `out` (removed afterwards): the fetcher's report numbers and the wall time."""
    t0 = time.perf_counter()
    run = subprocess.run(daemon_command("store", "fetch", "--model", model, "--manifest-sha256", sha, "--blocks", span,
                                        "--out", str(out), "--bootstrap", bootstrap, "--fetch-peers", str(peers),
                                        "--json"), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if run.returncode != 0:
        raise RuntimeError(f"store fetch failed: {run.stderr[-2000:]}")
    report = json.loads(run.stdout)
    used = {p: v["bytes"] for p, v in report["peers"].items() if v["bytes"]}
    return {"seeders_used": len(used), "bytes": report["bytes_needed"], "fetch_s": report["seconds"],
            "mb_per_s": report["mb_per_s"], "command_wall_s": round(wall, 3), "bytes_by_peer": used}


def start_to_serving(model: str, sha: str, span: str, bootstrap: str, state: Path, timeout_s: float) -> dict[str, Any]:
    """Wall time from `start --model` to its ready file, and the fetch inside it."""
    ready = state / "newcomer.json"
    ready.unlink(missing_ok=True)
    fetch_dir = state / "newcomer-store"
    shutil.rmtree(fetch_dir, ignore_errors=True)
    t0 = time.perf_counter()
    proc = spawn("newcomer", ["start", "--model", model, "--manifest-sha256", sha, "--blocks", span, "--fetch-dir",
                              str(fetch_dir), "--bootstrap", bootstrap, "--identity", str(state / "newcomer.key"),
                              "--ready-file", str(ready), "--threads", "1"], state)
    try:
        info = wait_ready(ready, proc, timeout_s)
        wall = time.perf_counter() - t0
    finally:
        stop_processes([proc.pid])
        shutil.rmtree(fetch_dir, ignore_errors=True)
    return {"start_to_serving_s": round(wall, 3), "fetch_s": info["fetch"]["seconds"],
            "fetch_mb_per_s": info["fetch"]["mb_per_s"], "bytes": info["fetch"]["bytes_needed"]}


def run(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    store = store_for(kind, work, args.hidden)
    manifest = Store(store).manifest
    span = args.span or DEFAULT_SPANS[kind]
    sha = manifest_sha256(store)
    state = work / f"state-{kind}"
    state.mkdir(parents=True, exist_ok=True)
    bootstrap, procs = start_seeders(store, max(args.seeders), state, args.timeout)
    try:
        fetches: dict[str, Any] = {}
        for peers in args.seeders:
            runs = [fetch_once(manifest.model_id, sha, span, bootstrap, peers, work / f"fetch-{kind}-{peers}")
                    for _ in range(args.reps)]
            fetches[str(peers)] = {"runs": runs, "median_mb_per_s": statistics.median(r["mb_per_s"] for r in runs),
                                   "median_fetch_s": statistics.median(r["fetch_s"] for r in runs)}
        serving = [start_to_serving(manifest.model_id, sha, span, bootstrap, state, args.timeout)
                   for _ in range(args.reps)]
    finally:
        stop_processes([p.pid for p in reversed(procs)])
    return {"model": manifest.model_id, "dtype": manifest.dtype, "span": span, "manifest_sha256": sha,
            "fetch_by_seeders": fetches, "start_to_serving": serving,
            "median_start_to_serving_s": statistics.median(r["start_to_serving_s"] for r in serving)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny", help="comma-separated: tiny, real (default tiny)")
    p.add_argument("--span", default=None, metavar="A:B", help="layers to fetch (default 4:8 tiny, 7:14 real)")
    p.add_argument("--seeders", default="1,3", help="seeder counts to fetch from (default 1,3)")
    p.add_argument("--reps", type=int, default=1, help="runs per setting (default 1)")
    p.add_argument("--hidden", type=int, default=512, help="tiny model width (default 512: ~12 MB per layer)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="start-up deadline of each daemon")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=None, help="results file (default bench/results/shard_fetch-<models>-<date>.json)")
    args = p.parse_args(argv)
    kinds = model_kinds(p, args.models)
    args.seeders = comma_list(p, "--seeders", args.seeders, int)
    if not args.seeders or min(args.seeders) < 1 or args.reps < 1:
        p.error("--seeders takes positive counts; --reps must be >= 1")
    out = args.out or RESULTS_DIR / f"shard_fetch-{'-'.join(kinds)}-{today()}.json"
    with tempfile.TemporaryDirectory(prefix="dsd-shard-bench-") as tmp:
        work = args.work or Path(tmp)
        results = {"meta": run_metadata("shard_fetch", args), "results": {k: run(k, args, work) for k in kinds}}
    write_json(out, results)
    summary = {k: {"mb_per_s_by_seeders": {n: r["median_mb_per_s"] for n, r in v["fetch_by_seeders"].items()},
                   "start_to_serving_s": v["median_start_to_serving_s"]} for k, v in results["results"].items()}
    print(json.dumps(summary, indent=1))
    print(f"results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
