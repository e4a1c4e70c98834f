"""Load on `dsd-node serve`: 1, 4 and 8 concurrent streaming clients against a testnet with emulated WAN links.

Each arm (a `--modes` mode with `--head-batching` on or off) is its own `serve` process on the same testnet, the
arms in turn; every request's text is compared with the same prompt's at 1 client in that arm and across arms
(`exact`: greedy output does not depend on the load, the mode or the batching).

For each model kind (a tiny random target drafting for itself, or the default real pair) it starts a
testnet (bootstrap + N block peers, every link delayed), one `dsd-node serve` process on the same
emulated WAN, and then, for each client count C, C threads that each send R streamed
`/v1/completions` requests back to back from one shared queue holding each of 10 fixed prompts `--reps`
times (greedy, `max_tokens` each). Reported per
level: requests/s and completion tokens/s over the level's wall time, p50/p95 time to the first
streamed token (from sending the request), mean tokens per round trip and accepted drafts per round
(the `dsd` statistics of each answer). One JSON on stdout, also saved under results/.

    python bench/serve_load.py                          # tiny, 4 peers, 40 ms, 1/4/8 clients
    python bench/serve_load.py --models real --clients 2
    python bench/serve_load.py --clients 1 --reps 1 --max-tokens 8   # smoke check
    python bench/serve_load.py --models real --latency-ms 30 --modes ar,dsd --head-batching on,off \
        --clients 1,4,8 --reps 1 --max-tokens 32
    python bench/serve_load.py --models real --latency-ms 270 --arms ar:on,dsd:on,dsd:off --clients 1,4,8 --reps 1
    python bench/serve_load.py --plot results/A.json results/B.json   # one PNG, a panel per file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    build_tiny_store,
    comma_list,
    model_kinds,
    percentile,
    real_tokenizer_store,
    run_metadata,
    spread,
    testnet,
    today,
    write_json,
)

# Fixed before any run: ten code prompts; every level sends each of them --reps times.
PROMPTS = (
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "def is_prime(n):\n    # True when n is a prime number\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "import json\n\ndef load(path):\n    with open(path) as f:\n",
    'def reverse_words(s: str) -> str:\n    """Reverse the order of the words in s."""\n',
    "def flatten(xs):\n    # flatten a list of lists into one list\n",
    'def gcd(a: int, b: int) -> int:\n    """Greatest common divisor of a and b."""\n',
    "def count_vowels(text):\n    # how many vowels text holds\n",
    'def merge_sorted(a: list, b: list) -> list:\n    """Merge two sorted lists into one sorted list."""\n',
    "def word_frequencies(text):\n    # a dict from each word to how often it occurs\n",
)


def one_request(url: str, model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: time to the first chunk (the first tokens), tokens, the dsd statistics."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    text: list[str] = []
    with httpx.Client(timeout=600) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read().decode(errors="replace")[:300]}
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - t0
            last = json.loads(line[len("data: "):])
            text.extend(c.get("text", "") for c in last.get("choices") or [])
    elapsed = time.perf_counter() - t0
    usage, dsd = last.get("usage") or {}, last.get("dsd") or {}
    return {"status": 200, "ttft_s": first, "elapsed_s": elapsed, "tokens": int(usage.get("completion_tokens", 0)),
            "text": "".join(text),
            "tokens_per_trip": dsd.get("tokens_per_trip"), "mean_accepted": dsd.get("mean_accepted"),
            "queued_s": dsd.get("queued_s")}


def load_level(url: str, model: str, prompts: list[Any], clients: int, reps: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads sharing one queue of every prompt `reps` times (the same work at every level);
    throughput over the level's wall time."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)
    queue = [p for _ in range(reps) for p in prompts]
    load_before = os.getloadavg()

    def client(i: int) -> None:
        start.wait()
        while True:
            with lock:
                if not queue:
                    return
                index = len(prompts) * reps - len(queue)
                prompt = queue.pop(0)
            res = {**one_request(url, model, prompt, max_tokens), "prompt": index % len(prompts)}
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    per_request = [r["tokens"] / r["elapsed_s"] for r in ok if r["elapsed_s"] > 0]

    def mean(key: str) -> float | None:
        xs = [r[key] for r in ok if r.get(key) is not None]
        return round(statistics.fmean(xs), 4) if xs else None

    return {
        "clients": clients, "requests": len(results), "ok": len(ok),
        "errors": [r for r in results if r["status"] != 200][:3],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 4),
        "tokens_per_s": round(tokens / wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 3),
        "request_tokens_per_s_p50": None if not per_request else round(percentile(per_request, 0.5), 3),
        "request_tokens_per_s_p95": None if not per_request else round(percentile(per_request, 0.95), 3),
        "texts": {str(r["prompt"]): r["text"] for r in ok},
        "completion_tokens": tokens,
        "ttft_p50_s": None if not ttft else round(percentile(ttft, 0.5), 4),
        "ttft_p95_s": None if not ttft else round(percentile(ttft, 0.95), 4),
        "tokens_per_trip": mean("tokens_per_trip"),
        "mean_accepted": mean("mean_accepted"),
        "queued_s_mean": mean("queued_s"),
        "load_before": load_before, "load_after": os.getloadavg(),
    }


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One testnet and one serve process for a model kind; every client level against them."""
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    work: Path = args.state / f"serve_load-{kind}"
    if kind == "real":
        if not prepared(weights="fp32"):
            raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
        paths = default_store_paths(weights="fp32")
        target, draft = paths["target"], str(paths["draft"])
    else:
        target = build_tiny_store(work / "tiny", tokenizer_store=real_tokenizer_store())
        draft = str(target)  # the tiny target drafts for itself
    store = Store(target)
    tokenizer = store.load_tokenizer()
    prompts: list[Any] = list(PROMPTS) if tokenizer is not None else [list(p.encode()) for p in PROMPTS]
    print(f"[{kind}] starting {args.peers} peers with {args.latency_ms:g} ms links", file=sys.stderr, flush=True)
    row: dict[str, Any] = {"models": kind, "model_id": store.manifest.model_id, "peers": args.peers,
                           "latency_ms": args.latency_ms, "max_tokens": args.max_tokens, "arms": []}
    with testnet(target, args.peers, args.latency_ms, work / "net") as state:
        row["testnet_up_s"] = state.up_seconds
        for rep in range(args.passes):  # every arm once per pass, the passes one after another (ABC ABC)
            for mode, batching in args.arms:
                print(f"  [pass {rep + 1}: {mode}, head batching {batching}]", file=sys.stderr, flush=True)
                done = arm(args, kind, state, target, draft, prompts, mode, batching, work)
                row["arms"].append({**done, "pass": rep})
                write_json(args.out, {**args.meta, "runs": [*args.done, row], "partial": "the arms so far"})
    row["cells"], row["exact"] = cells(row["arms"], args.latency_ms)
    row["summary"] = summary(row["cells"])
    return row


def arm(args: argparse.Namespace, kind: str, state: Any, target: Path, draft: str, prompts: list[Any], mode: str,
        batching: str, work: Path) -> dict[str, Any]:
    """One serve process (`mode`, `--head-batching batching`) and every client level against it."""
    from dsd.node.testnet.processes import spawn, stop_processes, wait_ready

    ready = work / "serve.json"
    ready.unlink(missing_ok=True)
    proc = spawn("serve", [
        "serve", "--bootstrap", state.bootstrap, "--store", str(target), "--draft", draft, "--port", "0",
        "--ready-file", str(ready), "--max-concurrent", str(max(args.clients)), "--queue", str(max(args.clients)),
        "--threads", "1", "--wan-latency-ms", str(args.latency_ms), "--mode", mode, "--head-batching", batching,
        "--draft-quant", args.draft_quant if kind == "real" else "none",
    ], work)
    try:
        info = wait_ready(ready, proc, 600)
        out: dict[str, Any] = {"mode": mode, "head_batching": batching, "levels": []}
        one_request(info["url"], info["model"], prompts[0], 4)  # warm-up: first survey, first session
        for clients in args.clients:
            level = load_level(info["url"], info["model"], prompts, clients, args.reps, args.max_tokens)
            print(f"    {clients} clients: {level['requests_per_s']:.2f} req/s, {level['tokens_per_s']:.1f} tok/s, "
                  f"ttft p50 {level['ttft_p50_s']} s p95 {level['ttft_p95_s']} s", file=sys.stderr, flush=True)
            out["levels"].append(level)
        out["serve_log"] = proc.log
    finally:
        stop_processes([proc.pid])
    return out


def cells(arms: list[dict[str, Any]], latency_ms: float) -> tuple[list[dict[str, Any]], bool]:
    """One cell per (arm, clients); a cell is exact when every text equals its prompt's at the arm's first level,
    and the run is exact when, besides, every arm's texts are the first arm's."""
    out, exact = [], True
    first = arms[0]["levels"][0]["texts"] if arms and arms[0]["levels"] else {}
    for a in arms:
        alone = a["levels"][0]["texts"] if a["levels"] else {}
        exact = exact and alone == first
        for level in a["levels"]:
            same = all(alone.get(k) == t for k, t in level["texts"].items()) and level["ok"] == level["requests"]
            exact = exact and same
            out.append({"clients": level["clients"], "mode": a["mode"], "head_batching": a["head_batching"] == "on",
                        "pass": a.get("pass", 0), "latency_ms": latency_ms, "aggregate_tokens_per_s": level["aggregate_tokens_per_s"],
                        "request_tokens_per_s_p50": level["request_tokens_per_s_p50"],
                        "request_tokens_per_s_p95": level["request_tokens_per_s_p95"],
                        "ttft_p50_s": level["ttft_p50_s"], "ttft_p95_s": level["ttft_p95_s"], "exact": same})
    return out, exact


ARM_COLORS = {"ar on": "tab:blue", "ar off": "tab:cyan", "sd on": "tab:purple", "sd off": "tab:pink",
              "dsd on": "tab:red", "dsd off": "tab:orange"}


def arm_name(mode: str, batching: bool) -> str:
    return f"{mode} {'on' if batching else 'off'}"


def summary(cells_: list[dict[str, Any]]) -> dict[str, Any]:
    """Per client count: each arm's aggregate tokens/s over the passes (median, min, max), and the ratios the issue
    asks about taken within each pass (same machine state), then their median and range."""
    by: dict[tuple[int, str], dict[int, float]] = {}
    for c in cells_:
        by.setdefault((c["clients"], arm_name(c["mode"], c["head_batching"])), {})[c.get("pass", 0)] = c["aggregate_tokens_per_s"]

    out: dict[str, Any] = {}
    for clients in sorted({k[0] for k in by}):
        arms = {name: per for (n, name), per in by.items() if n == clients}
        row: dict[str, Any] = {name: spread(list(per.values())) for name, per in arms.items()}
        for label, top, bottom in (("dsd on / ar on", "dsd on", "ar on"), ("dsd on / dsd off", "dsd on", "dsd off"),
                                   ("dsd off / ar on", "dsd off", "ar on")):
            if top in arms and bottom in arms:
                ratios = [arms[top][p] / arms[bottom][p] for p in arms[top] if p in arms[bottom] and arms[bottom][p]]
                if ratios:
                    row[label] = spread(ratios)
        out[str(clients)] = row
    return out


def plot(paths: Sequence[Path], png: Path) -> None:
    """Aggregate tokens/s against concurrent clients, one panel per result file (link profile), one line per arm
    (median over passes, bars from min to max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for path in paths for run in json.loads(path.read_text())["runs"]]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        table = run.get("summary") or summary(run["cells"])
        names = sorted({name for row in table.values() for name in row if "/" not in name})
        for name in names:
            xs = [int(c) for c, row in table.items() if name in row]
            med = [table[str(x)][name]["median"] for x in xs]
            low = [m - table[str(x)][name]["min"] for x, m in zip(xs, med, strict=True)]
            high = [table[str(x)][name]["max"] - m for x, m in zip(xs, med, strict=True)]
            ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=3, label=name, color=ARM_COLORS.get(name))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({int(c) for c in table}), labels=[str(c) for c in sorted({int(c) for c in table})])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"{run['model_id']}, {run['peers']} peers, {run['latency_ms']:g} ms links")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny", help="comma-separated: tiny, real (default tiny)")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=40.0, help="one-way emulated latency of every link (default 40)")
    p.add_argument("--clients", default="1,4,8", help="concurrent client counts (default 1,4,8)")
    p.add_argument("--reps", type=int, default=2, help="times every prompt is sent per level (default 2: 20 requests)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default="dsd", help="comma-separated modes, one serve arm each (ar, sd, dsd; default dsd)")
    p.add_argument("--head-batching", default="on", help="comma-separated: on, off (default on): an arm each")
    p.add_argument("--arms", default=None, metavar="MODE:on|off,...",
                   help="the arms themselves, in order (e.g. ar:on,dsd:on,dsd:off), instead of --modes x --head-batching")
    p.add_argument("--passes", type=int, default=1, help="times the whole list of arms runs, in turn (default 1)")
    p.add_argument("--plot", type=Path, nargs="+", default=None, metavar="RESULT",
                   help="only draw the PNG of these result files (one panel each) next to the first, and exit")
    p.add_argument("--draft-quant", choices=("none", "int8"), default="int8",
                   help="the real draft's quantization (default int8, as in the headline; tiny drafts stay fp32)")
    p.add_argument("--state", type=Path, default=Path(".dsd/bench"), help="where stores, testnets and logs go")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/serve_load-DATE.json)")
    args = p.parse_args(argv)
    if args.plot:
        png = args.plot[0].with_suffix(".png")
        plot(args.plot, png)
        print(png)
        return 0
    kinds = model_kinds(p, args.models)
    args.clients = comma_list(p, "--clients", args.clients, int)
    args.modes = comma_list(p, "--modes", args.modes, str)
    args.head_batching = comma_list(p, "--head-batching", args.head_batching, str)
    args.arms = ([tuple(a.split(":", 1)) for a in comma_list(p, "--arms", args.arms, str)] if args.arms else
                 [(m, b) for m in args.modes for b in args.head_batching])
    if not args.arms or any(len(a) != 2 or a[0] not in ("ar", "sd", "dsd") or a[1] not in ("on", "off")
                            for a in args.arms):
        p.error("--modes takes ar, sd, dsd; --head-batching on, off; --arms MODE:on|off items")
    if (args.peers < 1 or args.reps < 1 or args.passes < 1 or args.max_tokens < 1 or not args.clients
            or min(args.clients) < 1):
        p.error("--peers, --reps, --passes, --max-tokens and every --clients value must be >= 1")
    args.out = args.out or RESULTS_DIR / f"serve_load-{today()}.json"
    args.meta, args.done = run_metadata("serve_load", args), []
    for kind in kinds:
        args.done.append(run(kind, args))
    results = {**args.meta, "runs": args.done}
    write_json(args.out, results)
    plot([args.out], args.out.with_suffix(".png"))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
