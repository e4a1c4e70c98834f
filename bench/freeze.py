"""The freeze bar (issue 53): one replica of each span frozen (SIGSTOP) mid-generation must cost a generation a
failover at most, never a minute.

The scenario, fixed before any run: a 4-peer testnet of the tiny 8-layer model (2 spans x 2 replicas, 30 ms
links), a fresh head per generation as `dsd-node generate` is (audits on at their default rate), `--mode sd
--draft ngram`, 40 new tokens, greedy, over 10 fixed prompts (HumanEval problems as bytes, as the soak's). Each
run first generates unfrozen (`unfrozen_s`: from the moment `--freeze-after` tokens were accepted to the end),
then the same prompt again, freezing at that moment one replica of each span (`after_freeze_s`: from the
freeze to the end, audits settled) and thawing them after. Which replica of each span is frozen cycles over
the four choices, so the frozen peers are on the generation's route, off it (where its audits run), or one of
each, equally often. `exact`: the frozen run's tokens equal the whole model's greedy tokens.

    python bench/freeze.py --reps 2 --results bench/results/freeze-DATE.json     # 20 runs, ~10 min

The results file is rewritten after every run; a rerun with the same file resumes.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    byte_ids,
    command_line,
    run_metadata,
    testnet,
    today,
    whole_model_greedy,
    write_json,
)

PROBLEMS = (0, 16, 32, 49, 65, 82, 98, 114, 131, 147)  # the soak's 10
BAR_S = 10.0  # a frozen run must end within its unfrozen time plus this


def one_generation(bootstrap: str, store: Path, prompt: list[int], args: argparse.Namespace,
                   freeze: list[int] | None) -> dict[str, Any]:
    """A fresh head generates once; with `freeze` (pids), they are stopped once `freeze_after` tokens were
    accepted. Returns tokens, the seconds from that moment to the end, and what the report said."""
    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import NgramDrafter
    from dsd.node.head.report import GenerationFailed
    from dsd.node.head.setup import HeadSetup
    from dsd.node.peer.generation import generate_from_fresh_head
    from dsd.node.peer.shaper import LinkProfile
    from dsd.node.route.audit import AuditOptions
    from dsd.shard_store import Store

    st = Store(store)
    setup = HeadSetup(st.load_head(), st.manifest.model_id, st.num_layers, NgramDrafter())
    cfg = GenerationConfig(mode="sd", max_new_tokens=args.tokens)
    produced, mark = [0], [None]

    def on_tokens(toks: list[int]) -> None:
        produced[0] += len(toks)
        if mark[0] is None and produced[0] >= args.freeze_after:
            for pid in freeze or ():
                os.kill(pid, signal.SIGSTOP)
            mark[0] = time.monotonic()

    link = LinkProfile.from_options(args.latency_ms)
    out: dict[str, Any] = {}
    try:
        report = trio.run(lambda: generate_from_fresh_head([bootstrap], link, setup, prompt, cfg, on_tokens=on_tokens,
                                                           audit=AuditOptions()))
        out.update(ok=True, tokens=report.tokens, failovers=len(report.transport.failovers),
                   audits=report.transport.audits.as_dict() if report.transport.audits else None)
    except GenerationFailed as exc:
        out.update(ok=False, tokens=exc.tokens, error=str(exc))
    end = time.monotonic()
    out["from_mark_s"] = None if mark[0] is None else round(end - mark[0], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2, help="repetitions of the 10 prompts (20 runs at 2)")
    p.add_argument("--tokens", type=int, default=40, help="new tokens per generation")
    p.add_argument("--freeze-after", type=int, default=12, help="accepted tokens before the freeze")
    p.add_argument("--latency-ms", type=float, default=30.0, help="the testnet's one-way link latency")
    p.add_argument("--thaw-s", type=float, default=3.0, help="seconds the thawed peers get before the next run")
    p.add_argument("--results", type=Path, default=RESULTS_DIR / f"freeze-{today()}.json")
    args = p.parse_args(argv)

    from dsd.node.testnet.workload import humaneval_problems

    problems = humaneval_problems()
    prompts = {i: byte_ids(problems[i]["prompt"])[-96:] for i in PROBLEMS}
    result: dict[str, Any] = run_metadata("freeze", args)
    if args.results.exists():
        import json

        old = json.loads(args.results.read_text())
        result["runs"] = old.get("runs", [])
    result.setdefault("runs", [])
    result["command"] = command_line("freeze.py", sys.argv[1:] if argv is None else argv)
    result["scenario"] = {"model": "tiny-qwen2 8 layers", "peers": 4, "replicas": 2, "latency_ms": args.latency_ms,
                          "mode": "sd", "draft": "ngram", "tokens": args.tokens, "freeze_after": args.freeze_after,
                          "audits": "default", "bar_s": BAR_S, "problems": list(PROBLEMS)}
    result["load_before"] = os.getloadavg()
    todo = [(rep, i) for rep in range(args.reps) for i in PROBLEMS]
    done = {(r["rep"], r["problem"]) for r in result["runs"]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = build_tiny_store(root / "target", layers=8)
        expected = {i: whole_model_greedy(root / "target" / "hf", prompts[i], args.tokens) for i in PROBLEMS}
        with testnet(store, 4, args.latency_ms, root / "net", replicas=2) as net:
            spans: dict[int, list[Any]] = {}
            for peer in net.peers:
                if peer.role == "block":
                    spans.setdefault(peer.start, []).append(peer)
            firsts = sorted(spans)
            for n, (rep, problem) in enumerate(todo):
                if (rep, problem) in done:
                    continue
                choice = n % 4  # bit s picks the replica of span s to freeze
                frozen = [spans[s][(choice >> k) & 1] for k, s in enumerate(firsts)]
                calm = one_generation(net.bootstrap, store, prompts[problem], args, None)
                try:
                    hot = one_generation(net.bootstrap, store, prompts[problem], args, [f.pid for f in frozen])
                finally:
                    for f in frozen:
                        os.kill(f.pid, signal.SIGCONT)
                run = {"rep": rep, "problem": problem, "frozen": [f.peer_id for f in frozen],
                       "after_freeze_s": hot["from_mark_s"], "unfrozen_s": calm["from_mark_s"],
                       "exact": hot["tokens"] == expected[problem], "unfrozen_exact": calm["tokens"] == expected[problem],
                       "ok": hot["ok"], "failovers": hot.get("failovers"), "audits": hot.get("audits"),
                       "error": hot.get("error")}
                result["runs"].append(run)
                print(f"rep {rep} problem {problem}: done {run['after_freeze_s']} s after the freeze "
                      f"(unfrozen {run['unfrozen_s']} s), exact {run['exact']}, failovers {run['failovers']}",
                      flush=True)
                write_json(args.results, result)
                time.sleep(args.thaw_s)
    runs = result["runs"]
    over = [r for r in runs if r["after_freeze_s"] is None or r["unfrozen_s"] is None
            or r["after_freeze_s"] > r["unfrozen_s"] + BAR_S]
    after = [r["after_freeze_s"] for r in runs if r["after_freeze_s"] is not None]
    result["summary"] = {
        "runs": len(runs), "within_bar": len(runs) - len(over), "exact": sum(r["exact"] for r in runs),
        "after_freeze_s": {"median": statistics.median(after), "min": min(after), "max": max(after)} if after else None,
        "unfrozen_s_median": statistics.median([r["unfrozen_s"] for r in runs if r["unfrozen_s"] is not None] or [0]),
    }
    result["load_after"] = os.getloadavg()
    write_json(args.results, result)
    print(result["summary"])
    return 0 if not over and all(r["exact"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
