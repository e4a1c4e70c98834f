"""NAT traversal measured through real NATs (network namespaces, iptables MASQUERADE) with the emulated WAN on.

Three placements of the same swarm (a public bootstrap node and a second relay; two block peers and the head):
- `public`: every machine on the "internet" bridge, dialled directly;
- `nat`: the peers and the head each behind a port-preserving home NAT: relayed first, then hole-punched;
- `symmetric`: the same behind `--random-fully` NATs: punches fail, every leg stays relayed.
Each over the transports asked (`--transports tcp,quic`): every machine of a swarm listens on that one only
(`/tcp/4001` or `/udp/4001/quic-v1`), so relays, punches and windows all take it; a QUIC placement is keyed
`quic/<placement>` and compared with the same placement over TCP, paired by prompt.

Per placement: round trips from a fresh head to each peer (a ping, and a ping carrying a window's hidden states),
labelled by the link they took (direct, relayed, hole-punched); the punches the heads tried (success, seconds);
and `dsd` generations over the fixed HumanEval prompts, each from a fresh `dsd-node generate` head, with their
tokens compared across placements (they must be equal: the NAT changes the path, never the text). Needs root.

    python bench/nat.py --models tiny --latency-ms 50            # minutes
    python bench/nat.py --models real --latency-ms 50 --reps 1   # the default pair (about half an hour)
    python bench/nat.py summarize bench/results/nat-real-DATE.json   # recompute a file's summary from its runs
"""

from __future__ import annotations

import argparse
import json
import os
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
    command_line,
    generate_cli,
    percentile,
    run_metadata,
    today,
    write_json,
)
from soak import PROBLEMS, load_models

PLACEMENTS = ("public", "nat", "symmetric")
TRANSPORTS = ("tcp", "quic")
PORT = 4001
WINDOW_BYTES = 8 * 1536 * 4  # a window of 8 tokens of the real target's hidden states in float32


def listen_addr(ip: str, transport: str) -> str:
    """Where a machine of a `transport` swarm listens (its one address)."""
    return f"/ip4/{ip}/tcp/{PORT}" if transport == "tcp" else f"/ip4/{ip}/udp/{PORT}/quic-v1"


def placement_key(transport: str, kind: str) -> str:
    """A placement's key in the results: `nat` over TCP (as before QUIC was measured), `quic/nat` over QUIC."""
    return kind if transport == "tcp" else f"{transport}/{kind}"


def percentiles(xs: Sequence[float]) -> dict[str, float] | None:
    """Median with the 10th and 90th percentiles (`harness.percentile`), in milliseconds; None for no sample."""
    if not xs:
        return None
    return {"n": len(xs), **{k: round(percentile(xs, q) * 1000, 2) for k, q in
                             (("median_ms", 0.5), ("p10_ms", 0.1), ("p90_ms", 0.9))}}


# --- the head-side probe (run inside the head's namespace: `python bench/nat.py probe ...`) -----------------------

async def _probe(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    from dsd.discovery.announce import fetch_records
    from dsd.discovery.ping import measure_rtt
    from dsd.node.peer.host import head_node
    from dsd.node.peer.shaper import LinkProfile

    samples: list[dict[str, Any]] = []
    unfinished: list[dict[str, Any]] = []  # punches still running when the probe stopped waiting: counted as failed
    async with head_node([args.bootstrap], LinkProfile.from_options(args.latency_ms), listen=[args.listen]) as (
        node, _legs
    ):
        recs = []
        with trio.move_on_after(60):
            while len(recs) < args.peers:
                recs = [r for r in await fetch_records(node, args.model, 0) if r.role == "block"]
                await trio.sleep(0.5)
        for rec in recs:
            t0 = trio.current_time()
            await node.connect(rec.peer_id, rec.addrs)
            connect_s = trio.current_time() - t0
            for phase in ("first", "settled"):
                if phase == "settled":  # a punch succeeds in well under a second, or fails after ~22 s
                    with trio.move_on_after(args.settle_s):
                        while node.nat is not None and node.nat.punching(rec.peer_id):
                            await trio.sleep(0.2)
                    if node.nat is not None and node.nat.punching(rec.peer_id):
                        unfinished.append({"peer": rec.peer_id, "ok": False, "seconds": None, "unfinished": True})
                for size in (0, WINDOW_BYTES):
                    for _ in range(args.pings):
                        kind = node.link_kind(rec.peer_id)
                        rtt = await measure_rtt(node, rec.peer_id, rec.addrs, samples=1, payload=b"\0" * size,
                                                timeout=30)
                        samples.append({"peer": rec.peer_id, "phase": phase, "bytes": size, "link": kind,
                                        "rtt_s": rtt, "connect_s": connect_s})
        punches = list(node.nat.punches) if node.nat is not None else []
        punches += [u for u in unfinished if u["peer"] not in {p["peer"] for p in punches}]
    return {"samples": samples, "punches": punches}


def probe_main(argv: Sequence[str]) -> int:
    import trio

    p = argparse.ArgumentParser(prog="bench/nat.py probe")
    for name in ("--bootstrap", "--listen", "--model"):
        p.add_argument(name, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--pings", type=int, default=10)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--settle-s", type=float, default=35.0)
    print(json.dumps(trio.run(_probe, p.parse_args(argv))))
    return 0


# --- the benchmark ---------------------------------------------------------------------------------------------------

class Placement:
    """One swarm in a fresh testbed: machines placed as `kind` says; daemons up once `__enter__` returns."""

    def __init__(self, kind: str, args: argparse.Namespace, models: Any, state: Path, transport: str = "tcp") -> None:
        from dsd.node.testnet.nat_testbed import NatTestbed

        self.kind, self.args, self.models, self.state, self.transport = kind, args, models, state, transport
        self.tb = NatTestbed()
        self.procs: list[Any] = []

    def machine(self, name: str) -> Any:
        if self.kind == "public":
            return self.tb.public(name)
        return self.tb.home(name, symmetric=self.kind == "symmetric")

    def start(self, name: str, *args: str) -> dict[str, Any]:
        from dsd.node.testnet.processes import spawn, wait_ready

        host = self.tb.hosts[name]
        ready = self.state / f"{name}.json"
        proc = spawn(name, ["start", "--listen", listen_addr(host.ip, self.transport), "--identity",
                            str(self.state / f"{name}.key"), "--ready-file", str(ready),
                            "--wan-latency-ms", str(self.args.latency_ms), *args], self.state, netns=host.netns)
        self.procs.append(proc)
        return wait_ready(ready, proc, 600)

    def __enter__(self) -> Placement:
        from dsd.shard_store import Store

        self.tb.public("boot"), self.tb.public("relay2")
        for name in ("p1", "p2", "head"):
            self.machine(name)
        self.boot = self.start("boot", "--bootstrap-only")["addrs"][0]
        self.start("relay2", "--bootstrap-only", "--bootstrap", self.boot)
        layers = int(Store(self.models.target).manifest.config["num_hidden_layers"])
        half = layers // 2
        for name, blocks in (("p1", f"0:{half}"), ("p2", f"{half}:{layers}")):
            self.start(name, "--store", str(self.models.target), "--blocks", blocks, "--bootstrap", self.boot,
                       "--threads", "1")
        return self

    def __exit__(self, *exc: object) -> None:
        from dsd.node.testnet.processes import stop_processes

        stop_processes(list(reversed(self.procs)))
        self.tb.close()

    def head_listen(self) -> list[str]:
        return ["--listen", listen_addr(self.tb.hosts["head"].ip, self.transport)]

    def in_head(self) -> list[str]:
        return ["ip", "netns", "exec", self.tb.hosts["head"].netns]

    def probe(self) -> dict[str, Any]:
        from dsd.shard_store import Store

        model = Store(self.models.target).manifest.model_id
        out = subprocess.run([*self.in_head(), sys.executable, __file__, "probe", "--bootstrap", self.boot, "--model",
                              model, "--peers", "2", "--pings", str(self.args.pings), "--latency-ms",
                              str(self.args.latency_ms), *self.head_listen()], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"probe failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def generate(self, prompt: list[int]) -> dict[str, Any]:
        argv = ["--bootstrap", self.boot, "--store", str(self.models.target), "--draft", str(self.models.draft),
                "--draft-quant", "int8", "--prompt-ids", ",".join(map(str, prompt)), "--mode", "dsd",
                "--max-new-tokens", str(self.args.max_new_tokens), "--wan-latency-ms", str(self.args.latency_ms),
                "--threads", "1", *self.head_listen()]
        for stop in self.models.stops:
            argv += ["--stop", stop]
        started = time.monotonic()
        report, out = generate_cli(argv, prefix=self.in_head())
        if report is None:
            return {"ok": False, "error": f"exit {out.returncode}: {out.stderr[-1500:]}", "wall_s": time.monotonic() - started}
        links = [h["link"] for h in report.get("hops", []) if not h.get("local")] + [report.get("return_link")]
        if out.returncode != 0:
            report["error"] = f"{report.get('error')}: {out.stderr[-1500:]}"
        return {"ok": out.returncode == 0, "tokens": report.get("tokens", []), "tokens_per_s": report.get("tokens_per_s"),
                "error": report.get("error"), "failover_events": report.get("failover_events"),
                "new_tokens": report.get("new_tokens"), "failovers": report.get("failovers"), "links": links,
                "wall_s": round(time.monotonic() - started, 2)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Round trips by link kind and size, punch success and time, tok/s per placement, and exactness."""
    rtts: dict[str, dict[str, Any]] = {}
    punches: dict[str, Any] = {}
    toks: dict[str, Any] = {}
    for kind, data in result["placements"].items():
        by: dict[str, list[float]] = {}
        for s in data["probes"]["samples"]:
            by.setdefault(f"{s['link']}/{s['bytes']}B", []).append(s["rtt_s"])
        rtts[kind] = {k: percentiles(v) for k, v in sorted(by.items())}
        tried = [p for probe in data["punch_trials"] for p in probe]
        ok = [p["seconds"] for p in tried if p["ok"]]
        failed = [p["seconds"] for p in tried if not p["ok"] and p["seconds"] is not None]
        punches[kind] = {"tried": len(tried), "succeeded": len(ok), "seconds_ok": percentiles(ok),
                         "seconds_failed": percentiles(failed),
                         "unfinished": sum(1 for p in tried if p.get("unfinished"))}
        rates = [g["tokens_per_s"] for g in data["generations"] if g["ok"]]
        toks[kind] = {"generations": len(data["generations"]), "ok": len(rates),
                      "tokens_per_s_median": round(statistics.median(rates), 3) if rates else None,
                      "tokens_per_s_range": [round(min(rates), 3), round(max(rates), 3)] if rates else None}
    placements = result["placements"]
    first = "public" if "public" in placements else next(iter(placements), "public")
    ref = {(g["problem"], g["rep"]): g["tokens"] for g in placements.get(first, {}).get("generations", [])}
    same = [g["tokens"] == ref.get((g["problem"], g["rep"])) for d in placements.values()
            for g in d["generations"] if (g["problem"], g["rep"]) in ref]
    for kind, t in toks.items():  # paired by prompt and repetition: prompts differ far more than placements do
        transport = kind.split("/")[0] if "/" in kind else "tcp"
        t["vs_public_paired"] = _paired(placements, kind, placement_key(transport, "public"))
        if transport != "tcp":
            t["vs_tcp_paired"] = _paired(placements, kind, kind.split("/", 1)[1])
    return {"rtt": rtts, "punches": punches, "dsd": toks, "tokens_equal_to_public": f"{sum(same)}/{len(same)}"}


def _paired(placements: dict[str, Any], kind: str, base: str) -> dict[str, Any] | None:
    """tok/s of placement `kind` over placement `base`, paired by prompt and repetition (None without pairs)."""
    ref = {(g["problem"], g["rep"]): g for g in placements.get(base, {}).get("generations", []) if g["ok"]}
    ratios = [g["tokens_per_s"] / ref[(g["problem"], g["rep"])]["tokens_per_s"]
              for g in placements[kind]["generations"] if g["ok"] and (g["problem"], g["rep"]) in ref]
    if not ratios:
        return None
    return {"n": len(ratios), "median": round(statistics.median(ratios), 3),
            "range": [round(min(ratios), 3), round(max(ratios), 3)]}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["probe"]:
        return probe_main(argv[1:])
    if argv[:1] == ["summarize"]:  # recompute a result file's summary from its raw runs
        path = Path(argv[1])
        result = json.loads(path.read_text())
        result["summary"] = summarize(result)
        write_json(path, result)
        print(json.dumps(result["summary"], indent=1))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", choices=("tiny", "real"), default="tiny")
    p.add_argument("--latency-ms", type=float, default=50.0, help="one-way latency of every machine's link")
    p.add_argument("--reps", type=int, default=1, help="generations per prompt and placement")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--pings", type=int, default=10, help="round trips per peer, size and phase in each probe")
    p.add_argument("--punch-trials", type=int, default=5, help="fresh heads that dial both peers (nat, symmetric)")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--transports", default="tcp", help=f"comma-separated of {', '.join(TRANSPORTS)}: each placement "
                   "once per transport, every machine listening on that one only (default tcp)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("needs root: it builds network namespaces and NATs")
    placements = [k for k in args.placements.split(",") if k]
    if any(k not in PLACEMENTS for k in placements):
        p.error(f"--placements takes {', '.join(PLACEMENTS)}")
    transports = [t for t in args.transports.split(",") if t]
    if not transports or any(t not in TRANSPORTS for t in transports):
        p.error(f"--transports takes {', '.join(TRANSPORTS)}")
    out = args.out or RESULTS_DIR / f"nat-{args.models}-{today()}.json"
    with tempfile.TemporaryDirectory(prefix="dsd-nat-") as work:
        models = load_models(args.models, Path(work))
        result: dict[str, Any] = {**run_metadata("nat", args), "command": command_line("nat.py", argv),
                                  "load_before": os.getloadavg()[0], "placements": {}}
        for transport, kind in ((t, k) for t in transports for k in placements):
            key = placement_key(transport, kind)
            state = Path(work) / key.replace("/", "-")
            state.mkdir()
            with Placement(kind, args, models, state, transport) as placement:
                data: dict[str, Any] = {"probes": placement.probe(), "punch_trials": [], "generations": []}
                if kind != "public":
                    for _ in range(args.punch_trials):
                        data["punch_trials"].append(placement.probe()["punches"])
                for rep in range(args.reps):
                    for problem in PROBLEMS:
                        run = placement.generate(models.prompts[problem])
                        data["generations"].append({"problem": problem, "rep": rep, **run})
                        print(f"{key} problem {problem} rep {rep}: {run.get('tokens_per_s')} tok/s {run.get('links')}",
                              file=sys.stderr, flush=True)
                result["placements"][key] = data
                result["load_after"] = os.getloadavg()[0]
                result["summary"] = summarize(result)
                write_json(out, result)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
