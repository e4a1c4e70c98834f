"""A model no machine here holds in fp32: a Llama-3-8B-shaped random q4k store served by 4 peers on one box.

1. **Store.** A random-weight model with Llama-3-8B's config (hidden 4096, 32 layers, 32 heads, 8 KV heads,
   intermediate 14336, vocab 128256, rope theta 500000, untied lm_head; random weights, not Meta's) is written straight
   into the q4k layout (`dsd.shard_store.random_q4k`: 4-bit values and bf16 scales per group of 32, never a float
   copy) into `--store` (default: the model cache, `$DSD_CACHE` or ~/.cache/dsd/models, under stores/), unless a
   complete store is already there. Reported: its bytes, the fp32 bytes of the same parameters, the write's seconds
   and this process's peak RSS while writing.
2. **Spans.** With `--threads` torch threads (the peers'), each of the `--peers` even spans is loaded alone (seconds,
   bytes held, RSS growth), a `--prompt-len`-token prompt's embeddings run through it (the output feeding the next
   span: finite through all layers, its RMS reported), then t0(w): the median seconds of a step of w ∈ {1, 8} rows
   right after the prompt, over `--t0-reps` repetitions, divided by the span's layers.
3. **Route.** `dsd-node testnet up` (bootstrap + `--peers` block peers forked from it, `--latency-ms` one-way links),
   then per repetition and prompt a `dsd-node generate --mode ar --weights q4k` head process (greedy,
   `--max-new-tokens`, random token-id prompts; `--head-weights`): its tokens/s, its peak RSS and its RSS while it
   generates; every peer's RSS (now and peak) after the start and after the generations; then `testnet down`.

Also recorded: the CPU (lscpu's Model name), the load average and the other processes using CPU before, during and
after. Writes bench/results/bigmodel-DATE.json and prints it.

    python bench/bigmodel.py                                    # 8B, 4 peers, 30 ms links (about 7 min on 2 cores)
    python bench/bigmodel.py --config llama3.2-3b               # a smaller real config where 8B does not fit
    python bench/bigmodel.py --config tiny --store /tmp/tiny --out /tmp/tiny.json   # the benchmark itself, in a minute
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, command_line, run_metadata, shown_path, spread, today, write_json

# Real configs, random weights: (what it is, transformers' LlamaConfig arguments)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("Meta-Llama-3-8B's config.json (random weights)", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)),
    "llama3.2-3b": ("Llama-3.2-3B's shape without its rope scaling (random weights)", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True)),
    "tiny": ("a tiny Llama-shaped config: a quick run of this benchmark itself, no figure to quote", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, rope_theta=500000.0, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)),
}
WINDOWS = (1, 8)
MB = 1 << 20


def log(msg: str) -> None:
    print(f"[bigmodel {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llama_config(name: str) -> Any:
    """The named config as a transformers LlamaConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIGS[name][1])


def parameter_count(config: Any) -> int:
    """Parameters of the whole model (embeddings and lm_head included), counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def cpu_model() -> str:
    """lscpu's "Model name"."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def dirty_files() -> list[str]:
    """Tracked files that differ from the commit when the run starts (others' work in progress in a shared tree)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    return sorted(line[3:] for line in out.splitlines() if line.strip())


def _cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per process: its CPU ticks so far (user + system) and its nice value."""
    ticks = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                ticks[int(entry.name)] = (int(fields[11]) + int(fields[12]), int(fields[16]))
            except (OSError, ValueError, IndexError):
                continue
    return ticks


def _label(pid: int) -> str:
    """A process by its program's name and the script or module it runs (names only, never a path)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    words = [Path(argv[0]).name]
    if "-m" in argv[1:-1]:
        words.append(argv[argv.index("-m") + 1])
    words += [Path(a).name for a in argv[1:4] if a.endswith(".py")][:1]
    return " ".join(words)


def beside(ours: set[int], seconds: float = 3.0) -> list[dict[str, Any]]:
    """The processes other than this benchmark's that used over 5% of a core over `seconds`: what each runs, its
    share of a core and its nice value."""
    first = _cpu_ticks()
    time.sleep(seconds)
    second = _cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (ticks, nice) in second.items():
        if pid in ours or pid == os.getpid() or pid not in first:
            continue
        share = (ticks - first[pid][0]) / hz / seconds
        if share > 0.05:
            try:
                busy.append({"process": _label(pid), "cpu_share": round(share, 2), "nice": nice})
            except OSError:
                continue
    return sorted(busy, key=lambda b: -b["cpu_share"])


def rss_mb(pid: int) -> dict[str, float]:
    """A process's resident set now and at its peak (VmRSS, VmHWM), in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["now" if key == "VmRSS" else "peak"] = round(int(value.split()[0]) / 1024, 1)
    return out


def self_peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def write_store(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """Write the random q4k store unless a complete one is there; what it took."""
    from dsd.shard_store.default_models import store_complete
    from dsd.shard_store.random_q4k import write_random_q4k_store

    if store_complete(args.store) and not args.rewrite:
        log(f"store {args.store} already complete: reused")
        return {"written": False}
    log(f"writing the {args.config} random q4k store to {args.store}")
    started = time.perf_counter()

    def progress(_what: str, done: int, total: int) -> None:
        if done % 4 == 0 or done == total:
            log(f"  {done}/{total} files, {time.perf_counter() - started:.0f} s, peak RSS {self_peak_mb():.0f} MB")

    write_random_q4k_store(config, args.store, model_id=f"random-{args.config}-q4k", seed=args.seed,
                           overwrite=True, progress=progress)
    return {"written": True, "write_s": round(time.perf_counter() - started, 1), "writer_peak_rss_mb": self_peak_mb()}


def span_figures(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    """Each peer's span loaded alone: load time, bytes held, RSS growth, the prompt through it, t0(w) per layer."""
    import torch

    from dsd.node.testnet.processes import even_spans
    from dsd.shard_store.quant import held_bytes

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, int(store.manifest.vocab_size), (1, args.prompt_len), generator=gen)
    head = store.load_head()
    with torch.inference_mode():
        hidden = head.embed(ids).clone()
    per_span, per_layer = [], {w: [] for w in WINDOWS}
    for start, end in even_spans(store.num_layers, args.peers):
        before = rss_mb(os.getpid())["now"]
        t = time.perf_counter()
        span = store.load_span(start, end)
        load_s = time.perf_counter() - t
        row: dict[str, Any] = {"span": [start, end], "load_s": round(load_s, 2), "held_mb": round(held_bytes(span) / MB, 1),
                               "rss_growth_mb": round(rss_mb(os.getpid())["now"] - before, 1)}
        cache = span.new_cache()
        with torch.inference_mode():
            t = time.perf_counter()
            hidden = span(hidden, 0, cache)
            row["prompt_s"] = round(time.perf_counter() - t, 3)
            row["finite"] = bool(torch.isfinite(hidden).all())
            row["out_rms"] = round(float(hidden.float().pow(2).mean().sqrt()), 4)
            times: dict[int, list[float]] = {w: [] for w in WINDOWS}
            for rep in range(args.t0_reps + 1):  # the first pass warms the kernels up and is not kept
                for w in WINDOWS:
                    cache.truncate(args.prompt_len)
                    x = torch.randn(1, w, store.manifest.hidden_size, generator=gen, dtype=torch.bfloat16)
                    t = time.perf_counter()
                    span(x, args.prompt_len, cache)
                    if rep:
                        times[w].append((time.perf_counter() - t) / (end - start))
        row["t0_ms_per_layer"] = {str(w): round(statistics.median(times[w]) * 1000, 3) for w in WINDOWS}
        for w in WINDOWS:
            per_layer[w] += times[w]
        log(f"  span {start}:{end} loaded in {load_s:.1f} s, {row['held_mb']:.0f} MB held, "
            f"t0(1) {row['t0_ms_per_layer']['1']:.2f} ms/layer, t0(8) {row['t0_ms_per_layer']['8']:.2f}, "
            f"out rms {row['out_rms']}")
        per_span.append(row)
        del span, cache
        gc.collect()
    return {
        "threads": args.threads, "prompt_len": args.prompt_len, "reps": args.t0_reps, "spans": per_span,
        "head_lm_head": type(head.lm_head).__name__,
        "finite_through_all_layers": all(r["finite"] for r in per_span),
        "t0_ms": {str(w): spread([v * 1000 for v in per_layer[w]]) for w in WINDOWS},
        "bench_peak_rss_mb_after_spans": self_peak_mb(),
    }


def dsd_node(*args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess:
    """`dsd-node ARGS` as a process of its own; a failure stops the benchmark with its stderr."""
    done = subprocess.run([sys.executable, "-m", "dsd.node.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"dsd-node {' '.join(args[:2])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def generate(args: argparse.Namespace, bootstrap: str, prompt: list[int]) -> dict[str, Any]:
    """One `dsd-node generate --mode ar` head process: its report's figures, its peak RSS
    (VmHWM) and its steady RSS (the median VmRSS after the peak last rose: the generation's, past the load; both
    read every 0.25 s until it exits)."""
    cmd = [sys.executable, "-m", "dsd.node.cli", "generate", "--bootstrap", bootstrap, "--store", str(args.store),
           "--mode", "ar", "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(args.max_new_tokens),
           "--wan-latency-ms", str(args.latency_ms), "--weights", args.head_weights, "--json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        rss: dict[str, float] = {}
        steady: list[float] = []  # VmRSS since the peak last rose: the generation's, past the load
        while proc.poll() is None:  # its own VmHWM: wait4's ru_maxrss would count this process's peak (fork, exec)
            try:
                now = rss_mb(proc.pid)
            except (OSError, ValueError):
                now = {}
            if now:
                steady = [] if now["peak"] > rss.get("peak", 0.0) else [*steady, now["now"]]
                rss = now
            time.sleep(0.25)
        wall = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"generate failed ({proc.returncode}):\n{errors[-3000:]}")
    report = json.loads(text.strip().splitlines()[-1])
    return {"new_tokens": report["new_tokens"], "tokens_per_s": report["tokens_per_s"], "elapsed_s": report["elapsed_s"],
            "prefill_s": report["prefill_s"], "process_s": round(wall, 2), "head_peak_rss_mb": rss.get("peak"),
            "head_rss_steady_mb": statistics.median(steady) if steady else rss.get("now"), "tokens": report["tokens"]}


def route_figures(args: argparse.Namespace, state_dir: Path, result: dict[str, Any]) -> None:
    """Bring the testnet up, run the generations, read every peer's RSS, bring it down (always)."""
    import random

    t = time.perf_counter()
    up = dsd_node("testnet", "up", "--store", str(args.store), "--peers", str(args.peers), "--state", str(state_dir),
                  "--threads", str(args.threads), "--wan-latency-ms", str(args.latency_ms),
                  "--timeout", str(args.up_timeout), "--json")
    try:
        state = json.loads(up.stdout)
        result["testnet_up_s"] = round(time.perf_counter() - t, 1)
        peers = [p for p in state["peers"] if p.get("role") == "block"]
        ours = {p["pid"] for p in state["peers"]}
        log(f"testnet up in {result['testnet_up_s']} s: {len(peers)} peers")
        result["peers"] = [{"name": p["name"], "span": [p["start"], p["end"]], "rss_after_up_mb": rss_mb(p["pid"])}
                           for p in peers]
        result["bootstrap_rss_mb"] = rss_mb(state["peers"][0]["pid"])
        result["beside_during"] = beside(ours)
        rng = random.Random(args.seed)
        vocab = int(json.loads((args.store / "manifest.json").read_text())["vocab_size"])
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        runs = []
        for rep in range(args.reps):
            for i, prompt in enumerate(prompts):
                run = {"rep": rep, "prompt": i, **generate(args, state["bootstrap"], prompt)}
                runs.append(run)
                log(f"  rep {rep} prompt {i}: {run['new_tokens']} tokens at {run['tokens_per_s']:.3f} tok/s, "
                    f"head peak RSS {run['head_peak_rss_mb']:.0f} MB")
        for row, p in zip(result["peers"], peers, strict=True):
            row["rss_after_generate_mb"] = rss_mb(p["pid"])
        result["generations"] = [{k: v for k, v in r.items() if k != "tokens"} for r in runs]
        result["same_tokens_across_reps"] = all(
            r["tokens"] == next(q["tokens"] for q in runs if q["prompt"] == r["prompt"]) for r in runs)
    finally:
        dsd_node("testnet", "down", "--state", str(state_dir))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from dsd.shard_store.default_models import default_cache

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=tuple(CONFIGS), default="llama3-8b")
    p.add_argument("--store", type=Path, default=None, help="where the store is written (default: the model cache's "
                   "stores/random-CONFIG-q4k; reused when complete)")
    p.add_argument("--rewrite", action="store_true", help="write the store again even when a complete one is there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=30.0, help="one-way emulated latency of every link (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each peer and of the span measurements")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--t0-reps", type=int, default=7)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="repetitions of every prompt's generation")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--up-timeout", type=float, default=1200.0)
    p.add_argument("--head-weights", default="q4k", help="the head's `generate --weights` (default q4k, the store's "
                   "own: a bf16 head with int8 embeddings and lm_head, as the demo runs it; auto: a float32 head)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--note", action="append", default=[], help="a line for the result's notes (repeatable)")
    args = p.parse_args(argv)
    args.store = args.store or default_cache() / "stores" / f"random-{args.config}-q4k"
    out = args.out or RESULTS_DIR / f"bigmodel-{today()}.json"
    config = llama_config(args.config)
    params = parameter_count(config)
    result: dict[str, Any] = {
        **run_metadata("bigmodel", args), "command": command_line("bigmodel.py", sys.argv[1:] if argv is None else argv),
        "cpu_model": cpu_model(), "uptime_before": uptime(), "beside_before": beside(set()),
        "dirty_files": dirty_files(),
        "config": {"name": args.config, "what": CONFIGS[args.config][0], **CONFIGS[args.config][1]},
        "parameters": params, "fp32_bytes": params * 4, "latency_ms": args.latency_ms,
    }
    result["settings"]["store"] = shown_path(args.store)
    result["store"] = write_store(args, config)
    from dsd.shard_store import Store

    store = Store(args.store)
    result["store_bytes"] = store.manifest.total_bytes
    result["store"].update({"layer_bytes": store.summary()["layer_bytes"], "head_bytes": store.summary()["head_bytes"],
                            "weights": store.manifest.weights, "source": store.manifest.source,
                            "fp32_over_store": round(params * 4 / store.manifest.total_bytes, 2)})
    log(f"store {store.manifest.total_bytes / 1e9:.2f} GB against {params * 4 / 1e9:.1f} GB in fp32; measuring spans")
    result["spans"] = span_figures(args, store)
    result["t0_ms"] = {w: s["median"] for w, s in result["spans"]["t0_ms"].items()}
    del store
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="dsd-bigmodel-") as tmp:
        route_figures(args, Path(tmp) / "net", result)
    gens = result["generations"]
    result["tokens_per_s"] = spread([g["tokens_per_s"] for g in gens], 4)
    result["head_rss_mb"] = {"peak": max(g["head_peak_rss_mb"] for g in gens),
                             "steady": max(g["head_rss_steady_mb"] for g in gens)}
    result["peer_rss_mb"] = {row["name"]: row["rss_after_generate_mb"] for row in result["peers"]}
    result["uptime_after"] = uptime()
    result["beside_after"] = beside(set())
    result["notes"] = [*args.note, *notes(result)]
    write_json(out, result)
    print(json.dumps(result, indent=1))
    return result


def notes(result: dict[str, Any]) -> list[str]:
    """What the figures say beyond themselves, computed from them."""
    spans = result["spans"]["spans"]
    peak_peer = max(r["rss_after_generate_mb"]["peak"] for r in result["peers"])
    now_peer = max(r["rss_after_generate_mb"]["now"] for r in result["peers"])
    return [
        f"{result['config']['what']}: the tokens mean nothing, the costs are those of the shape; "
        f"the store is {result['store_bytes'] / 1e9:.2f} GB against {result['fp32_bytes'] / 1e9:.1f} GB in fp32",
        f"a span of {spans[0]['span'][1] - spans[0]['span'][0]} layers loads in "
        f"{statistics.median(r['load_s'] for r in spans):.1f} s (median) on {result['spans']['threads']} thread(s) and "
        f"holds {spans[0]['held_mb']:.0f} MB; a peer's RSS {now_peer:.0f} MB after the generations, its peak "
        f"{peak_peer:.0f} MB (forked from `testnet up`, whose own RSS at the fork is counted in both)",
        f"the head ({result['spans']['head_lm_head']} lm_head) peaks at {result['head_rss_mb']['peak']:.0f} MB while "
        f"loading and holds {result['head_rss_mb']['steady']:.0f} MB while it generates",
        f"ar crosses {len(result['peers']) + 1} links of {result['latency_ms']:g} ms per token (head, then each peer): "
        f"{result['latency_ms'] * (len(result['peers']) + 1):.0f} ms of each token's time is the links'",
    ]


if __name__ == "__main__":
    main()
