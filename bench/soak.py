"""The soak: hundreds of back-to-back generations over one idle testnet, each from a head that joins, generates
and leaves as `dsd-node generate` does; every failure must say why, and there must be none.

What single runs miss shows up here: a swarm whose records drift away from its live nodes as heads come
and go (issue 43), a late-but-alive hop ending a generation (issue 35). Fixed before any run:

- the prompts: 10 HumanEval problems spread over the set (`PROBLEMS`, as the DSD benchmark's);
- the mixes: modes, drafters and window shapes a user runs (`MIXES`): `ar`; `sd` with prompt lookup;
  `dsd` with the draft model; `sd` with chains; `dsd` with 8-node trees; `dsd` with one window in flight;
  `sd` with windows of at most 4;
- greedy decoding, so every mix must give `ar`'s tokens for the same prompt (checked);
- repetitions in the outer loop, mixes interleaved per prompt.

Every generation is a fresh head (`--head fresh`: a new libp2p identity in this process, as the CLI gets) or
the CLI itself (`--head cli`: a `dsd-node generate` process). The results file is rewritten after every
generation and a rerun resumes where it stopped.

    python bench/soak.py --models tiny --reps 4                        # 280 generations, ~80 min
    python bench/soak.py --models tiny --reps 1 --head cli             # 70 generations through the CLI
    python bench/soak.py --models real --reps 1                        # 70 on the real pair (about an hour)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    byte_ids,
    comma_list,
    command_line,
    generate_cli,
    run_metadata,
    swarm,
    today,
    write_json,
)

PROBLEMS = (0, 16, 32, 49, 65, 82, 98, 114, 131, 147)


@dataclass(frozen=True)
class Mix:
    """One way of generating: a mode, a drafter (`model`, `ngram` or none) and the window options."""

    mode: str
    draft: str | None = "model"
    tree_nodes: int | None = None
    pipeline: int = 2
    gamma_max: int = 16


MIXES: dict[str, Mix] = {
    "ar": Mix("ar", draft=None),
    "sd-ngram": Mix("sd", draft="ngram"),
    "dsd": Mix("dsd"),
    "sd-chain": Mix("sd", tree_nodes=0),
    "dsd-tree8": Mix("dsd", tree_nodes=8),
    "dsd-serial": Mix("dsd", pipeline=1),
    "sd-gamma4": Mix("sd", gamma_max=4),
}


@dataclass(frozen=True)
class Models:
    """The target's and the draft's stores, the prompts' token ids and what ends a completion."""

    target: Path
    draft: Path
    prompts: dict[int, list[int]]
    eos: frozenset[int]
    stops: tuple[str, ...]


def load_models(kind: str, work: Path) -> Models:
    """`tiny`: an 8-layer random target and a 2-layer random draft (other weights, same 512 ids), prompts as bytes;
    `real`: the default pair, HumanEval's stop strings and EOS."""
    from dsd.node.head.setup import eos_ids
    from dsd.node.testnet.workload import HUMANEVAL_STOPS, humaneval_problems
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    problems = humaneval_problems()
    if kind == "tiny":
        target = build_tiny_store(work / "target", layers=8)
        draft = build_tiny_store(work / "draft", layers=2, seed=1)
        return Models(target, draft, {i: byte_ids(problems[i]["prompt"])[-96:] for i in PROBLEMS}, frozenset(), ())
    if not prepared(weights="fp32"):
        raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
    paths = default_store_paths(weights="fp32")
    store = Store(paths["target"])
    tok = store.load_tokenizer()
    prompts = {i: list(tok(problems[i]["prompt"])["input_ids"]) for i in PROBLEMS}
    return Models(paths["target"], paths["draft"], prompts, eos_ids(tok, store.manifest), HUMANEVAL_STOPS)


def config_of(mix: Mix, max_new_tokens: int, models: Models) -> Any:
    from dsd.node.head.config import GenerationConfig

    return GenerationConfig(mode=mix.mode, max_new_tokens=max_new_tokens, eos_ids=models.eos, stop_strings=models.stops,
                            tree_nodes=mix.tree_nodes, pipeline=mix.pipeline, gamma_max=mix.gamma_max)


class FreshHeads:
    """Generations from heads that join and leave, in this process: the drafters loaded once, a new node each time."""

    def __init__(self, models: Models, bootstrap: str, latency_ms: float, quant: str) -> None:
        import dataclasses

        from dsd.node.head.drafters import NgramDrafter
        from dsd.node.head.sampling import SamplingParams
        from dsd.node.head.setup import load_head_setup
        from dsd.node.peer.shaper import LinkProfile

        self.models, self.bootstrap = models, bootstrap
        self.link = LinkProfile.from_options(latency_ms)
        setup, tokenizer = load_head_setup(models.target, str(models.draft), SamplingParams(), 0, quant=quant)
        self.setups = {"model": setup, "ngram": dataclasses.replace(setup, drafter=NgramDrafter())}
        self.tokenizer = tokenizer if models.stops else None

    def run(self, mix: Mix, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
        import dataclasses

        import trio

        from dsd.node.head.report import GenerationFailed
        from dsd.node.peer.generation import generate_from_fresh_head

        setup = self.setups[mix.draft or "ngram"]
        if mix.draft is None:
            setup = dataclasses.replace(setup, drafter=None)
        elif setup.drafter is not None and hasattr(setup.drafter, "reset"):
            setup.drafter.reset()
        cfg = config_of(mix, max_new_tokens, self.models)
        try:
            report = trio.run(lambda: generate_from_fresh_head([self.bootstrap], self.link, setup, prompt, cfg,
                                                               tokenizer=self.tokenizer))
        except GenerationFailed as exc:
            return {"ok": False, "tokens": exc.tokens, "failure": exc.failure.as_dict(), "error": str(exc)}
        events = report.transport.failovers
        return {"ok": True, "tokens": report.tokens, "rounds": report.result.rounds, "failovers": len(events),
                "failover_events": [e.as_dict() for e in events]}


class CliHeads:
    """Generations through `dsd-node generate --json`, a process each, exactly as a user types it."""

    def __init__(self, models: Models, bootstrap: str, latency_ms: float, quant: str) -> None:
        self.models, self.bootstrap, self.latency_ms, self.quant = models, bootstrap, latency_ms, quant

    def run(self, mix: Mix, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
        argv = ["--bootstrap", self.bootstrap, "--store", str(self.models.target), "--prompt-ids",
                ",".join(map(str, prompt)), "--mode", mix.mode, "--max-new-tokens", str(max_new_tokens),
                "--wan-latency-ms", str(self.latency_ms), "--pipeline", str(mix.pipeline), "--gamma-max",
                str(mix.gamma_max), "--threads", "1"]
        if mix.draft is not None:
            argv += ["--draft", "ngram" if mix.draft == "ngram" else str(self.models.draft)]
            if mix.draft == "model":
                argv += ["--draft-quant", self.quant]
        if mix.tree_nodes is not None:
            argv += ["--tree-nodes", str(mix.tree_nodes)]
        for stop in self.models.stops:
            argv += ["--stop", stop]
        report, out = generate_cli(argv)
        if report is None:
            return {"ok": False, "tokens": [], "error": f"exit {out.returncode}: {out.stderr[-1500:]}"}
        if out.returncode != 0:
            return {"ok": False, "tokens": report.get("tokens", []), "failure": report.get("failure"),
                    "error": report.get("error")}
        return {"ok": True, "tokens": report["tokens"], "rounds": report["rounds"], "failovers": report["failovers"],
                "failover_events": report["failover_events"]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of generations, failures (with why), failovers and exactness; wall seconds per mix (median, range)."""
    reference = {(r["rep"], r["problem"]): r["tokens"] for r in runs if r["mix"] == "ar" and r["ok"]}
    compared = [r for r in runs if r["ok"] and (r["rep"], r["problem"]) in reference]
    by_mix: dict[str, list[float]] = {}
    for r in runs:
        by_mix.setdefault(r["mix"], []).append(r["seconds"])
    return {
        "generations": len(runs),
        "failures": sum(not r["ok"] for r in runs),
        "failed": [{k: r.get(k) for k in ("i", "rep", "problem", "mix", "error", "failure")} for r in runs if not r["ok"]],
        "failovers": sum(r.get("failovers", 0) for r in runs),
        "failover_verdicts": dict(Counter(e["verdict"].split(":")[0] for r in runs for e in r.get("failover_events", []))),
        "tokens_equal_ar": f"{sum(reference[r['rep'], r['problem']] == r['tokens'] for r in compared)}/{len(compared)}",
        "wall_s_per_mix": {m: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2),
                               "n": len(v)} for m, v in by_mix.items()},
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", choices=("tiny", "real"), default="tiny")
    p.add_argument("--reps", type=int, default=5, help="repetitions of every (prompt, mix) (outer loop)")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=None, help="one-way link latency (default 100 tiny, 320 real)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 24 tiny, 32 real")
    p.add_argument("--head", choices=("fresh", "cli"), default="fresh")
    p.add_argument("--draft-quant", choices=("none", "int8"), default="int8")
    p.add_argument("--results", type=Path, default=None, help="default bench/results/soak-MODELS[-cli]-DATE.json")
    p.add_argument("--work", type=Path, default=None, help="where the tiny stores and the testnet state go")
    args = p.parse_args(argv)
    args.mix_names = comma_list(p, "--mixes", args.mixes, str)
    if not args.mix_names or any(m not in MIXES for m in args.mix_names):
        p.error(f"--mixes takes {', '.join(MIXES)}")
    args.latency_ms = args.latency_ms if args.latency_ms is not None else (100.0 if args.models == "tiny" else 320.0)
    args.max_new_tokens = args.max_new_tokens or (24 if args.models == "tiny" else 32)
    suffix = "-cli" if args.head == "cli" else ""
    args.results = args.results or RESULTS_DIR / f"soak-{args.models}{suffix}-{today()}.json"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from dsd.node.peer.shaper import LinkProfile
    from dsd.node.testnet.swarm import SwarmSpec

    args = parse_args(argv)
    torch.set_num_threads(1)
    work = args.work or Path(tempfile.mkdtemp(prefix="soak-"))
    models = load_models(args.models, work)
    data: dict[str, Any] = json.loads(args.results.read_text()) if args.results.exists() else {}
    meta = run_metadata("soak", args)
    data.setdefault("meta", meta)
    data.setdefault("command", command_line("soak.py", sys.argv[1:] if argv is None else list(argv)))
    data.setdefault("stretches", []).append({"commit": meta["commit"], "date": meta["date"], "reps": args.reps,
                                             "load_before": os.getloadavg()})
    runs: list[dict[str, Any]] = data.setdefault("runs", [])
    done = {(r["rep"], r["problem"], r["mix"]) for r in runs}
    todo = [(rep, problem, mix) for rep in range(1, args.reps + 1) for problem in PROBLEMS for mix in args.mix_names
            if (rep, problem, mix) not in done]
    print(f"soak: {len(todo)} generations to run ({len(done)} done) into {args.results}", flush=True)
    spec = SwarmSpec(state=work / "testnet", store=models.target, peers=args.peers,
                     link=LinkProfile.from_options(args.latency_ms))
    t_all = time.monotonic()
    with swarm(spec) as testnet:
        heads = (FreshHeads if args.head == "fresh" else CliHeads)(models, testnet.bootstrap, args.latency_ms,
                                                                   args.draft_quant)
        for rep, problem, mix in todo:
            t = time.monotonic()
            run = heads.run(MIXES[mix], models.prompts[problem], args.max_new_tokens)
            run.update(i=len(runs) + 1, rep=rep, problem=problem, mix=mix, seconds=round(time.monotonic() - t, 3),
                       at=round(time.time(), 3))
            runs.append(run)
            status = "ok" if run["ok"] else f"FAILED: {run.get('error')}"
            print(f"{run['i']:4d} rep {rep} problem {problem:3d} {mix:11s} {run['seconds']:7.2f} s "
                  f"{len(run['tokens']):3d} tokens {run.get('failovers', 0)} failovers  {status}", flush=True)
            data["summary"] = summarize(runs)
            write_json(args.results, data)
    data["stretches"][-1].update(load_after=os.getloadavg(), wall_s=round(time.monotonic() - t_all, 1))
    data["summary"] = summarize(runs)
    write_json(args.results, data)
    print(json.dumps(data["summary"], indent=1))
    return 0 if data["summary"]["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
