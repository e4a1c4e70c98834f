"""Churn: heads generate back to back while block peers leave and join; the swarm heals itself (issue 56).

A bootstrap node and `--peers` block peers join one by one with `--blocks auto --num-blocks N` (each takes the least
covered span), looking at the swarm every `--rebalance-s` to move where coverage is worst. `--heads` heads (each its
own libp2p node and swarm view, in this process) then generate greedily back to back over 10 fixed prompts:

1. **stable** (`--stable-s`): nobody leaves; every span move counts against "a swarm without churn stays still";
2. **churn** (`--churn-s`): every `--churn-every-s` a random live peer is killed (SIGKILL) or stopped (SIGTERM:
   it drains), alternately at random, and a fresh peer joins with `--blocks auto`.

Coverage is followed from the processes' side, every second: a peer counts from its ready file (its span, later
its last "moved to blocks" log line) until it is signalled. A hole opens when some block has no such peer and heals
when every block has one again; a block *under* the stable swarm's coverage (each block twice, by default) is
refilled when every block has that coverage again (`refill_p50_s`, `refill_p95_s`). Every generation's tokens are compared with the model's own greedy tokens
(transformers, in this process): `exact`.

    python bench/churn.py                                   # 8 peers, 4 heads, 5 min stable + 10 min churn
    python bench/churn.py --stable-s 60 --churn-s 120       # a shorter look
    python bench/churn.py --peers 6 --churn-every-s 15 --stable-s 120   # a thinner swarm, churned twice as often
    python bench/churn.py --report results/churn-DATE.json  # holes and refills again from a result's samples

Record: results/churn-DATE.json (`generations_finished`, `generations_failed`, `exact`, `heal_p95_s`,
`moves_per_peer_stable`, `duration_s`, and the timeline) and a PNG of coverage and tokens/s over time beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    percentile,
    run_metadata,
    today,
    whole_model_greedy,
    write_json,
)

PROMPTS = [[1, 17, 42, 99, 5, 17, 42, 99], [1, 250, 3, 3, 3, 3, 8], [1, 8, 8, 3], [4, 200, 31, 7, 7, 2],
           [1, 9, 9, 40, 41, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301, 2, 300, 301], [1, 60, 61, 62, 63],
           [77, 12, 77, 12, 77], [2, 4, 8, 16, 32, 64, 128]]
MOVED = re.compile(r"moved to blocks (\d+):(\d+)")


@dataclass
class Peer:
    """A block peer process as the bench follows it: its span now, when it joined and when it was signalled."""

    name: str
    proc: Any
    peer_id: str
    span: tuple[int, int]
    joined: float
    left: float | None = None
    how: str = ""  # kill | stop
    moves: list[tuple[int, int]] = field(default_factory=list)
    moved_at: list[float] = field(default_factory=list)  # when the bench first saw each move (monotonic)

    def refresh(self) -> None:
        """Its span after the moves its log reports so far."""
        found = [(int(a), int(b)) for a, b in MOVED.findall(Path(self.proc.log).read_text(errors="replace"))]
        self.moved_at += [time.monotonic()] * (len(found) - len(self.moves))
        self.moves = found
        if found:
            self.span = found[-1]


class Swarm:
    """The peer processes of the run: start one (`--blocks auto`), signal one, and the coverage they give now."""

    def __init__(self, args: argparse.Namespace, store: Path, state: Path, layers: int) -> None:
        self.args, self.store, self.state, self.layers = args, store, state, layers
        self.peers: list[Peer] = []
        self.bootstrap = ""
        self.boot_proc: Any = None
        self.count = 0

    def start_bootstrap(self) -> None:
        from dsd.node.testnet.processes import spawn, wait_ready

        ready = self.state / "bootstrap.json"
        self.boot_proc = spawn("bootstrap", ["start", "--bootstrap-only", "--ready-file", str(ready),
                                             "--identity", str(self.state / "bootstrap.key")], self.state)
        self.bootstrap = wait_ready(ready, self.boot_proc, 120)["addrs"][0]

    def start_peer(self) -> Peer:
        """A fresh block peer with `--blocks auto`, once it serves (blocking: run it in a thread)."""
        from dsd.node.testnet.processes import spawn, wait_ready

        a = self.args
        self.count += 1
        name = f"peer{self.count}"
        ready = self.state / f"{name}.json"
        proc = spawn(name, [
            "start", "--store", str(self.store), "--blocks", "auto", "--num-blocks", str(a.num_blocks),
            "--bootstrap", self.bootstrap, "--threads", "1", "--record-ttl", str(a.record_ttl),
            "--rebalance-s", str(a.rebalance_s), "--drain-s", str(a.drain_s), "--wan-latency-ms", str(a.latency_ms),
            *(["--throughput", str(a.peer_throughput)] if a.peer_throughput else []),
            "--ready-file", str(ready), "--identity", str(self.state / f"{name}.key"),
        ], self.state)
        info = wait_ready(ready, proc, 180)
        peer = Peer(name, proc, info["peer_id"], (info["start"], info["end"]), time.monotonic())
        self.peers.append(peer)
        return peer

    def live(self) -> list[Peer]:
        return [p for p in self.peers if p.left is None]

    def coverage(self) -> list[int]:
        """Per block, how many live (not signalled) peers serve it now."""
        per = [0] * self.layers
        for p in self.live():
            p.refresh()
            for b in range(*p.span):
                per[b] += 1
        return per

    def signal(self, peer: Peer, how: str) -> None:
        import os
        import signal

        peer.left, peer.how = time.monotonic(), how
        os.kill(peer.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGTERM)

    def stop_all(self) -> None:
        from dsd.node.testnet.processes import stop_processes

        stop_processes([p.proc for p in reversed(self.peers)] + ([self.boot_proc] if self.boot_proc else []))


async def run(args: argparse.Namespace, swarm: Swarm, reference: list[list[int]]) -> dict[str, Any]:
    """The two phases with the heads generating throughout; the record of what happened."""
    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import NgramDrafter
    from dsd.node.head.report import GenerationFailed
    from dsd.node.head.setup import HeadSetup
    from dsd.node.peer.generation import generate_over_swarm, swarm_watch
    from dsd.node.peer.host import head_node
    from dsd.shard_store import Store

    store = Store(swarm.store)
    head = store.load_head()
    model_id, layers = store.manifest.model_id, int(store.manifest.num_layers)
    t0 = time.monotonic()
    gens: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    stop = trio.Event()
    rng = random.Random(args.seed)

    def now() -> float:
        return round(time.monotonic() - t0, 3)

    async def head_loop(i: int, node: Any, legs: Any) -> None:
        setup = HeadSetup(head, model_id, layers, NgramDrafter())
        watch = swarm_watch(node, setup)
        k = i
        while not stop.is_set():
            p = k % len(PROMPTS)
            k += 1
            rec: dict[str, Any] = {"head": i, "prompt": p, "start": now(), "phase": phase[0]}
            gens.append(rec)
            try:
                report = await generate_over_swarm(node, legs, watch, setup, PROMPTS[p],
                                                   GenerationConfig(mode="dsd", max_new_tokens=args.max_tokens))
            except GenerationFailed as exc:
                rec.update(end=now(), ok=False, error=str(exc)[:500], tokens=len(exc.result.tokens))
                continue
            rec.update(end=now(), ok=True, tokens=len(report.tokens), exact=report.tokens == reference[p],
                       failovers=[e.as_dict() for e in report.transport.failovers])

    async def monitor() -> None:
        while not stop.is_set():
            per = await trio.to_thread.run_sync(swarm.coverage)
            samples.append({"t": now(), "coverage": per, "live": len(swarm.live())})
            await trio.sleep(1.0)

    async def churn() -> None:
        while not stop.is_set():
            await trio.sleep(args.churn_every_s)
            if stop.is_set():
                return
            victim = rng.choice(swarm.live())
            how = rng.choice(("kill", "stop"))
            swarm.signal(victim, how)
            events.append({"t": now(), "kind": how, "peer": victim.name, "span": list(victim.span)})
            fresh = await trio.to_thread.run_sync(swarm.start_peer)
            events.append({"t": now(), "kind": "join", "peer": fresh.name, "span": list(fresh.span)})

    phase = ["stable"]
    async with AsyncExitStack() as stack:
        heads = [await stack.enter_async_context(head_node([swarm.bootstrap])) for _ in range(args.heads)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor)
            for i, (node, legs) in enumerate(heads):
                nursery.start_soon(head_loop, i, node, legs)
            await trio.sleep(args.stable_s)
            stable_end = now()
            phase[0] = "churn"
            nursery.start_soon(churn)
            await trio.sleep(args.churn_s)
            stop.set()
            churn_end = now()
    return {"gens": gens, "samples": samples, "events": events, "stable_end": stable_end, "churn_end": churn_end,
            "t0": t0}


def holes(samples: list[dict[str, Any]], below: int = 1) -> list[dict[str, Any]]:
    """Every stretch of samples with some block served by fewer than `below` live peers (1: by none, a hole): when it
    opened, how long until every block had `below` again, which blocks."""
    out, open_at, blocks = [], None, set()
    for s in samples:
        missing = {b for b, n in enumerate(s["coverage"]) if n < below}
        if missing and open_at is None:
            open_at, blocks = s["t"], set(missing)
        elif missing:
            blocks |= missing
        elif open_at is not None:
            out.append({"opened": open_at, "healed": s["t"], "seconds": round(s["t"] - open_at, 3),
                        "blocks": sorted(blocks)})
            open_at = None
    if open_at is not None:
        out.append({"opened": open_at, "healed": None, "seconds": None, "blocks": sorted(blocks)})
    return out


def summarize(swarm: Swarm, out: dict[str, Any]) -> dict[str, Any]:
    """The run in figures: generations by phase, holes and refills, moves."""
    gens, stable_end = out["gens"], out["stable_end"]
    done = [g for g in gens if "end" in g]
    by_phase: dict[str, Any] = {}
    for ph in ("stable", "churn"):
        g = [x for x in done if x["phase"] == ph]
        ok = [x for x in g if x["ok"]]
        span = stable_end if ph == "stable" else out["churn_end"] - stable_end
        by_phase[ph] = {"seconds": round(span, 1), "generations_started": sum(1 for x in gens if x["phase"] == ph),
                        "generations_finished": len(ok), "generations_failed": len(g) - len(ok),
                        "exact": all(x["exact"] for x in ok), "inexact": sum(1 for x in ok if not x["exact"]),
                        "tokens_per_s": round(sum(x["tokens"] for x in ok) / span, 3) if span else None,
                        "failovers": sum(len(x["failovers"]) for x in ok)}
    stable_moves = {p.name: sum(1 for at in p.moved_at if at - out["t0"] < stable_end) for p in swarm.peers
                    if p.name in out["first_peers"]}
    per_peer_10min = (sum(stable_moves.values()) / max(1, len(stable_moves))) * 600.0 / max(1.0, stable_end)
    return {
        "generations_finished": by_phase["churn"]["generations_finished"] + by_phase["stable"]["generations_finished"],
        "generations_failed": by_phase["churn"]["generations_failed"] + by_phase["stable"]["generations_failed"],
        "exact": by_phase["churn"]["exact"] and by_phase["stable"]["exact"],
        **coverage_report(out),
        "moves_per_peer_stable": round(per_peer_10min, 3), "moves_in_stable_phase": stable_moves,
        "moves_per_peer_churn": {p.name: len(p.moves) for p in swarm.peers},
        "duration_s": round(out["churn_end"], 1), "phases": by_phase,
    }


def coverage_report(result: dict[str, Any]) -> dict[str, Any]:
    """From a result's samples: the holes of the churn phase and the stretches under the stable swarm's coverage."""
    stable_end = result["stable_end"]
    churn = [s for s in result["samples"] if s["t"] >= stable_end]
    hs = holes(churn)
    healed = [h["seconds"] for h in hs if h["seconds"] is not None]
    full = min(min(s["coverage"]) for s in result["samples"] if s["t"] < stable_end)  # what the stable swarm had
    thin = holes(churn, below=full)
    rebuilt = [h["seconds"] for h in thin if h["seconds"] is not None]
    return {"heal_p50_s": percentile(healed, 0.5), "heal_p95_s": percentile(healed, 0.95), "holes": hs,
            "unhealed_holes": sum(1 for h in hs if h["seconds"] is None), "full_coverage": full,
            "under_full": thin, "refill_p50_s": percentile(rebuilt, 0.5), "refill_p95_s": percentile(rebuilt, 0.95),
            "under_full_share": round(sum(1 for s in churn if min(s["coverage"]) < full) / max(1, len(churn)), 3)}


def plot(result: dict[str, Any], path: Path) -> None:
    """Coverage (least-served block, and holes shaded) and finished tokens/s in 10 s bins, churn events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in result["samples"]]
    least = [min(s["coverage"]) for s in result["samples"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax1.step(t, least, where="post", color="tab:blue", label="peers serving the least-served block")
    for h in result["holes"]:
        ax1.axvspan(h["opened"], h["healed"] if h["healed"] is not None else t[-1], color="tab:red", alpha=0.25)
    ax1.set_ylabel("coverage")
    ax1.legend(loc="upper right")
    end = result["duration_s"]
    bins = [0.0] * (int(end // 10) + 1)
    for g in result["generations"]:
        if g.get("ok"):
            bins[min(len(bins) - 1, int(g["end"] // 10))] += g["tokens"] / 10.0
    ax2.plot([10 * i + 5 for i in range(len(bins))], bins, color="tab:green")
    ax2.set_ylabel("tokens/s (finished, 10 s bins)")
    ax2.set_xlabel("seconds")
    for ax in (ax1, ax2):
        ax.axvline(result["stable_end"], color="black", linestyle="--")
        for e in result["events"]:
            if e["kind"] != "join":
                ax.axvline(e["t"], color="tab:red" if e["kind"] == "kill" else "tab:orange", alpha=0.4, linewidth=0.8)
    ax1.set_title(f"churn: {result['settings']['peers']} peers, {result['settings']['heads']} heads; "
                  f"red lines SIGKILL, orange SIGTERM; dashed: churn starts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--layers", type=int, default=8, help="layers of the tiny random model (default 8)")
    p.add_argument("--num-blocks", type=int, default=2, help="layers each peer serves (default 2: each block twice)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--stable-s", type=float, default=300.0)
    p.add_argument("--churn-s", type=float, default=600.0)
    p.add_argument("--churn-every-s", type=float, default=30.0)
    p.add_argument("--rebalance-s", type=float, default=15.0, help="the peers' --rebalance-s (default 15)")
    p.add_argument("--drain-s", type=float, default=10.0, help="the peers' --drain-s (default 10)")
    p.add_argument("--record-ttl", type=float, default=10.0, help="the peers' --record-ttl (default 10)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="one-way latency every peer adds (default 20)")
    p.add_argument("--peer-throughput", type=float, default=100.0,
                   help="tokens/s every peer announces (`--throughput`; 0 = each measures its own at start). The "
                        "default is one value for all: the peers share this machine's cores, so a start-up "
                        "measurement says more about what else ran at that moment than about the peer, and moves "
                        "would chase that noise")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state", type=Path, default=Path(".dsd/bench/churn"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, metavar="RESULT",
                   help="only recompute the holes and refills of a result file from its samples, write them back "
                        "with its PNG, and exit")
    args = p.parse_args(argv)
    if args.report is not None:
        result = json.loads(args.report.read_text())
        result.update(coverage_report(result))
        write_json(args.report, result)
        plot(result, args.report.with_suffix(".png"))
        print(json.dumps({k: result[k] for k in ("heal_p50_s", "heal_p95_s", "unhealed_holes", "refill_p50_s",
                                                   "refill_p95_s", "under_full_share")}, indent=1))
        return 0
    if args.peers < 2 or args.heads < 1 or not 1 <= args.num_blocks <= args.layers:
        p.error("need --peers >= 2, --heads >= 1 and 1 <= --num-blocks <= --layers")
    out_path = args.out or RESULTS_DIR / f"churn-{today()}.json"
    import trio

    args.state.mkdir(parents=True, exist_ok=True)
    store = build_tiny_store(args.state / f"tiny-{args.layers}", layers=args.layers)
    reference = [whole_model_greedy(store.parent / "hf", prompt, args.max_tokens) for prompt in PROMPTS]
    swarm = Swarm(args, store, args.state / f"run-{int(time.time())}", args.layers)
    swarm.state.mkdir(parents=True)
    meta = run_metadata("churn", args)
    try:
        swarm.start_bootstrap()
        for _ in range(args.peers):
            peer = swarm.start_peer()
            print(f"{peer.name} serves {peer.span[0]}:{peer.span[1]}", file=sys.stderr, flush=True)
        first = [p.name for p in swarm.peers]
        out = trio.run(run, args, swarm, reference)
        out["first_peers"] = first
    finally:
        swarm.stop_all()
    result = {**meta, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              **summarize(swarm, out), "events": out["events"], "samples": out["samples"],
              "stable_end": out["stable_end"], "generations": out["gens"]}
    write_json(out_path, result)
    plot(result, out_path.with_suffix(".png"))
    keys = ("generations_finished", "generations_failed", "exact", "heal_p50_s", "heal_p95_s", "unhealed_holes",
            "refill_p50_s", "refill_p95_s", "moves_per_peer_stable", "duration_s")
    print(json.dumps({k: result[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
