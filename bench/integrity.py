"""Audit tolerances (issue 37): how far honest replicas' hidden states sit from float32 and from each other, and
how far lies sit.

The head audits a window by re-running it on another replica and comparing the final hidden states (the
output of the span's last layer, before any final norm) row by row with a relative L2, ||a - b|| / ||b||,
b the float32 reference. The tolerance must sit above what honest replicas differ by and below lies.

`gaps` measures both on the target: every variant runs each fixed HumanEval prompt as one window, then a
continuation window (the float32 model's own greedy tokens), through the full span [0, L) and, as what a first
peer sends, the half span [0, L/2). Variants:

- honest: `bfloat16` and `float16` weights and compute; `float32-steps`, float32 again with the prompt
  window re-run (same shapes, a determinism check) and the continuation decoded one token at a time;
- lies: `int8` (weights fake-quantised per row, absmax, 8 bit, float32 compute), `int4` (groups of 32 along
  the input, absmax, symmetric), `skip-last-layer` (the span's last layer left out).

Per variant, span and window kind: max, p99 and median over positions, per prompt and overall, with and
without position 0 (whose hidden state has a huge norm), and how often a prompt's max sits at position 0.

    python bench/integrity.py gaps --out bench/results/integrity-gaps-DATE.json    # minutes on 2 threads
    python bench/integrity.py summarize bench/results/integrity-gaps-DATE.json     # recompute, print a table

`calibrate` measures what the head's per-pair tolerances come from: the distance between two honest routes. A
route is two hops, [0, L/2) and [L/2, L), its peers computing in one precision class (fp32, fp16, bf16); rows cross
the wire into hop 1, between the hops and back, exactly or through the lossy int8 codec (at every crossing, the
peers' only, or the head's only: one head feeds both routes the same rows). Per pair of classes
(`bf16/fp32`, ...; `+int8` when int8 carries the rows) it compares, position by position past the attention sink
(`row_gaps`), one class's rows computed as a route sends a generation (the prompt in chunks of 128, the 16-token
float32 greedy continuation in windows of 4) with the other's as a replica replays an audit (everything but the
last 4 tokens in chunks of 128 from position 0, then those 4 as one window), both ways; the tolerance per pair is
max(FLOOR, MARGIN * the worst honest row), for the real target and the tiny one. Each model's section is written
when it is done; a rerun with the same settings keeps the finished ones.

    python bench/integrity.py calibrate --out bench/results/audit-calibration-DATE.json   # ~10-25 min, 2 threads

`detect` (windows a liar survives, per mode and audit rate) and `overhead` (tok/s with and without audits) run on
a live local swarm: see `integrity_swarm.py`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from harness import (
    RESULTS_DIR,
    build_tiny_store,
    byte_ids,
    comma_list,
    command_line,
    model_kinds,
    percentile,
    run_metadata,
    today,
    write_json,
)
from integrity_swarm import detect_main, log, overhead_main

if TYPE_CHECKING:
    import torch

    from dsd.shard_store import HeadModule, SpanModule, Store

PROBLEMS = (0, 16, 32, 49, 65, 82, 98, 114, 131, 147)  # the fixed 10 of soak.py and dsd_sweep.py
HONEST = ("float32-steps", "bfloat16", "float16")
LIES = ("int8", "int4", "skip-last-layer")
SPANS = ("half", "full")
KINDS = ("prompt", "continuation")
CANDIDATES = (0.03, 0.05, 0.06, 0.08, 0.1)  # tolerances whose share of rows above them the summary reports


# --- comparing hidden states ------------------------------------------------------------------------------------

def rel_l2(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """||a - b|| / ||b|| per row of [t, h] hidden states (b the reference), computed in float64, to 4 digits."""
    a64, b64 = a.double(), b.double()
    return [float(f"{v:.4g}") for v in ((a64 - b64).norm(dim=-1) / b64.norm(dim=-1)).tolist()]


def stats(values: Sequence[float]) -> dict[str, Any]:
    """Max, p99, median (`harness.percentile`, linear interpolation) and min of per-position gaps; None when empty."""
    if not values:
        return {"n": 0, "max": None, "p99": None, "median": None, "min": None}
    return {"n": len(values), "max": max(values), "p99": percentile(values, 0.99), "median": percentile(values, 0.5),
            "min": min(values)}


# --- weight lies ------------------------------------------------------------------------------------------------

def fake_int8_rows(w: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] rounded to 8 bits per output row: scale absmax/127, symmetric, back in w's dtype."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return (w / scale).round().clamp(-127, 127) * scale


# --- running windows ----------------------------------------------------------------------------------------------

def span_pieces(store: Store, variant: str) -> list[SpanModule]:
    """The variant's model as two chained spans whose outputs are the half and the full span's: [0, L/2) and
    [L/2, L), or for `skip-last-layer` [0, L/2 - 1) and [L/2 - 1, L - 1) (each span without its last layer)."""
    import torch

    from dsd.node.server.faults import int4_weight, replace_linear_weights

    layers = store.num_layers
    half = layers // 2
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(variant, torch.float32)
    span = store.load_span(0, layers, dtype=dtype)
    if variant == "int8":
        replace_linear_weights(span, fake_int8_rows)
    elif variant == "int4":
        replace_linear_weights(span, int4_weight)  # the faulty peers' own int4 (node/server/faults.py)
    cuts = [(0, half - 1), (half - 1, layers - 1)] if variant == "skip-last-layer" else [(0, half), (half, layers)]
    return [span.sub(a, b) for a, b in cuts]


def run_windows(pieces: Sequence[SpanModule], windows: Sequence[torch.Tensor],
                cross: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """Run the windows ([1, t, h] inputs) one after another through the chained pieces, each keeping its cache;
    per window the half and full span's outputs as float32 [t, h]. `cross` (None: exact) is what the wire does to
    rows where they leave a piece."""
    caches = [p.new_cache() for p in pieces]
    outs, pos = [], 0
    for x in windows:
        h, got = x, []
        for piece, cache in zip(pieces, caches, strict=True):
            h = piece.step(h, pos, cache)
            if cross is not None:
                h = cross(h)
            got.append(h[0].float())
        outs.append(dict(zip(SPANS, got, strict=True)))
        pos += x.shape[1]
    return outs


def greedy_steps(pieces: Sequence[SpanModule], head: HeadModule, prompt: Sequence[int],
                 n: int) -> tuple[list[int], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Greedy decoding of `n` tokens one at a time: (tokens, the prompt window's outputs, the outputs of the n
    single-token steps fed those tokens, i.e. the continuation window computed position by position)."""
    import torch

    caches = [p.new_cache() for p in pieces]
    pos, tokens = 0, []
    outputs: list[dict[str, torch.Tensor]] = []
    window = list(prompt)
    for _ in range(n + 1):
        h, got = head.embed(torch.tensor([window])), []
        for piece, cache in zip(pieces, caches, strict=True):
            h = piece.step(h, pos, cache)
            got.append(h[0].float())
        outputs.append(dict(zip(SPANS, got, strict=True)))
        pos += len(window)
        if len(tokens) == n:
            break
        window = [int(head.logits(h[:, -1:]).argmax(dim=-1))]
        tokens.append(window[0])
    steps = {s: torch.cat([o[s] for o in outputs[1:]]) for s in SPANS}
    return tokens, outputs[0], steps


# --- the gaps -----------------------------------------------------------------------------------------------------

def prompt_ids(store: Store, problems: Sequence[int], chat: bool) -> dict[int, list[int]]:
    """The problems' prompts as the benches send them (`soak.load_models`: the raw HumanEval prompt tokenized);
    with `chat`, wrapped in the chat template as a user turn."""
    from dsd.node.head.setup import encode_prompt
    from dsd.node.testnet.workload import humaneval_problems

    texts = humaneval_problems()
    tok = store.load_tokenizer()
    return {i: encode_prompt(tok, text=texts[i]["prompt"], chat=chat) for i in problems}


def reference(store: Store, prompts: dict[int, list[int]], n: int, result: dict[str, Any]) -> dict[int, Any]:
    """The float32 reference per problem: its greedy continuation and both windows' half/full outputs (run as
    windows); records the `float32-steps` gaps, the continuations and the reference's row norms in `result`."""
    import torch

    head = store.load_head(dtype=torch.float32)
    pieces = span_pieces(store, "float32")
    refs: dict[int, Any] = {}
    tok = store.load_tokenizer()
    for problem, ids in prompts.items():
        started = time.monotonic()
        cont, prompt_out, steps = greedy_steps(pieces, head, ids, n)
        outs = run_windows(pieces, [head.embed(torch.tensor([ids])), head.embed(torch.tensor([cont]))])
        refs[problem] = {"continuation": cont, "outs": outs}
        for span in SPANS:
            raw = result["raw"].setdefault("float32-steps", {}).setdefault(span, {"prompt": [], "continuation": []})
            raw["prompt"].append(rel_l2(prompt_out[span], outs[0][span]))
            raw["continuation"].append(rel_l2(steps[span], outs[1][span]))
            norms = outs[0][span].double().norm(dim=-1).tolist()
            result["reference_norms"][span].append(
                {"problem": problem, "pos0": norms[0], "median_other": percentile(norms[1:], 0.5),
                 "max_other": max(norms[1:])})
        result["prompts"].append({"problem": problem, "prompt_tokens": len(ids), "continuation": cont,
                                  "continuation_text": tok.decode(cont) if tok is not None else None})
        log(f"float32 problem {problem}: {len(ids)} + {n} tokens in {time.monotonic() - started:.1f} s")
    del head, pieces
    gc.collect()
    return refs


def variant_gaps(store: Store, variant: str, prompts: dict[int, list[int]], refs: dict[int, Any],
                 result: dict[str, Any]) -> None:
    """Run `variant` on every problem's two windows and record its per-position gaps to the reference."""
    import torch

    head = store.load_head(dtype=torch.float32)  # the head embeds in float32 whatever the replica computes in
    pieces = span_pieces(store, variant)
    raw = result["raw"].setdefault(variant, {s: {k: [] for k in KINDS} for s in SPANS})
    for problem, ids in prompts.items():
        started = time.monotonic()
        ref = refs[problem]
        outs = run_windows(pieces, [head.embed(torch.tensor([ids])), head.embed(torch.tensor([ref["continuation"]]))])
        for span in SPANS:
            for kind, got, want in zip(KINDS, outs, ref["outs"], strict=True):
                raw[span][kind].append(rel_l2(got[span], want[span]))
        log(f"{variant} problem {problem}: {time.monotonic() - started:.1f} s")
    del head, pieces
    gc.collect()


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per variant, span and window kind, from the raw per-position gaps: overall stats with and without
    position 0, per-prompt stats, how many prompts have a nonzero max at position 0, the smallest per-window
    max (for a lie: how clearly its least visible window stands out) and the share of rows past each of
    `CANDIDATES` (position 0 left out)."""
    problems = [p["problem"] for p in result["prompts"]]
    out: dict[str, Any] = {}
    for variant, spans in result["raw"].items():
        for span, kinds in spans.items():
            for kind, rows in kinds.items():
                first = 1 if kind == "prompt" else 0  # a continuation window never holds position 0
                per = [{"problem": p, **stats(r), "argmax": max(range(len(r)), key=r.__getitem__) + (
                    0 if kind == "prompt" else result["prompts"][i]["prompt_tokens"])}
                    for i, (p, r) in enumerate(zip(problems, rows, strict=False))]
                rest = [v for r in rows for v in r[first:]]
                out.setdefault(variant, {}).setdefault(span, {})[kind] = {
                    "overall": stats([v for r in rows for v in r]),
                    "overall_without_pos0": stats(rest),
                    "share_above_without_pos0": {str(t): round(sum(v > t for v in rest) / len(rest), 4)
                                                 for t in CANDIDATES},
                    "max_at_pos0": sum(1 for x in per if x["argmax"] == 0 and x["max"] > 0),
                    "min_window_max": min(max(r) for r in rows),
                    "min_window_max_without_pos0": min(max(r[first:]) for r in rows),
                    "per_prompt": per,
                }
    return out


def table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table, one row per variant, span and window kind."""
    head = (f"{'variant':<16}{'span':<6}{'window':<14}{'max':>10}{'max-p0':>10}{'p99-p0':>10}{'med-p0':>10}"
            f"{'min-p0':>10}{'minWinMax':>11}{'>0.06':>7}{'@p0':>5}")
    lines = [head, "-" * len(head)]
    for variant, spans in summary.items():
        for span, kinds in spans.items():
            for kind, s in kinds.items():
                o, w = s["overall"], s["overall_without_pos0"]
                lines.append(f"{variant:<16}{span:<6}{kind:<14}{o['max']:>10.2e}{w['max']:>10.2e}{w['p99']:>10.2e}"
                             f"{w['median']:>10.2e}{w['min']:>10.2e}{s['min_window_max_without_pos0']:>11.2e}"
                             f"{s['share_above_without_pos0']['0.06']:>7.1%}{s['max_at_pos0']:>5}")
    lines.append("-p0: position 0 left out; minWinMax: the smallest window max (-p0); >0.06: share of rows (-p0) "
                 "past 0.06; @p0: prompts whose max is at position 0")
    return "\n".join(lines)


def gaps_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="integrity.py gaps", description="honest and lying hidden-state gaps to float32")
    p.add_argument("--store", type=Path, default=None, help="the target's store (default: the default pair's)")
    p.add_argument("--problems", default=",".join(map(str, PROBLEMS)), help="HumanEval problem indices")
    p.add_argument("--continuation", type=int, default=16, help="tokens in the continuation window")
    p.add_argument("--variants", default=",".join(HONEST[1:] + LIES), help="variants besides float32-steps")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template (the benches do not)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    problems = comma_list(p, "--problems", args.problems, int)
    variants = comma_list(p, "--variants", args.variants, str)
    if any(v not in HONEST[1:] + LIES for v in variants):
        p.error(f"--variants takes {', '.join(HONEST[1:] + LIES)}")
    import torch

    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, store_complete

    torch.set_num_threads(args.threads)
    if args.store is None:
        args.store = default_store_paths(weights="fp32")["target"]
        if not store_complete(args.store):
            p.error("the default target is not prepared: run `dsd-node models prepare --weights fp32` first")
    out = args.out or RESULTS_DIR / f"integrity-gaps-{today()}.json"
    store = Store(args.store)
    result: dict[str, Any] = {
        **run_metadata("integrity-gaps", args), "command": command_line("integrity.py", ["gaps", *argv]),
        "model_id": store.manifest.model_id, "store_dtype": store.manifest.dtype, "num_layers": store.num_layers,
        "spans": {"half": [0, store.num_layers // 2], "full": [0, store.num_layers]},
        "metric": "||a - b|| / ||b|| per position, b the float32 reference (the span's last layer output, no norm)",
        "variants": {"honest": list(HONEST), "lies": [v for v in variants if v in LIES]},
        "load_before": os.getloadavg(), "prompts": [], "reference_norms": {s: [] for s in SPANS}, "raw": {},
        "seconds": {},
    }
    prompts = prompt_ids(store, problems, args.chat)
    started = time.monotonic()
    refs = reference(store, prompts, args.continuation, result)
    result["seconds"]["float32"] = round(time.monotonic() - started, 1)
    for variant in variants:
        started = time.monotonic()
        variant_gaps(store, variant, prompts, refs, result)
        result["seconds"][variant] = round(time.monotonic() - started, 1)
        result["load_after"] = os.getloadavg()
        result["summary"] = summarize(result)
        write_json(out, result)
    result["load_after"] = os.getloadavg()
    result["summary"] = summarize(result)
    write_json(out, result)
    print(json.dumps(result, indent=1))
    log(table(result["summary"]))
    return 0


def summarize_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="integrity.py summarize", description="recompute a gaps file's summary, print it")
    p.add_argument("file", type=Path)
    args = p.parse_args(argv)
    result = json.loads(args.file.read_text())
    summary = summarize(result)
    if summary != result.get("summary"):
        result["summary"] = summary
        write_json(args.file, result)
    print(table(summary))
    return 0


# --- calibrate: the honest distance between two audit routes, per precision pair ---------------------------------

# A route's precision class (its peers' compute dtype) and the dtype its spans load at, in pair-key order.
CLASSES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Where rows cross the wire in the lossy int8 codec: nowhere (every class's own codec carries its values exactly),
# everywhere (the head's rows into the first hop and each hop's rows out), the peers' rows only, the head's only.
WIRES = ("exact", "int8", "int8-peers", "int8-head")
CHUNK, WINDOW, CONTINUATION = 128, 4, 16  # prompt chunk, continuation window, continuation tokens
SHAPES = {
    "route": f"the prompt in chunks of {CHUNK} tokens, then the {CONTINUATION}-token continuation in windows of "
             f"{WINDOW}, each a step on the same KV cache",
    "replica": f"all but the last {WINDOW} continuation tokens replayed in chunks of {CHUNK} from position 0, then "
               f"the last {WINDOW} as one window",
}
MARGIN = 1.75
MARGIN_WHY = "the same 1.75x the old single tolerance (0.06) had over the worst honest row (0.034)"
FLOOR = 0.01
FLOOR_WHY = ("fp32 kernels differ across CPUs and GPUs (TF32) beyond what one machine shows, and 0.01 still sits "
             "4x below a 0.04-noise liar")


def pair_keys() -> list[str]:
    """bf16/bf16 .. fp32/fp32 (classes sorted bf16 < fp16 < fp32), then the same six with `+int8`."""
    import itertools

    exact = [f"{a}/{b}" for a, b in itertools.combinations_with_replacement(CLASSES, 2)]
    return exact + [f"{k}+int8" for k in exact]


def sig(v: float) -> float:
    """`v` to 6 significant digits."""
    return float(f"{v:.6g}")


def int8_wire(h: torch.Tensor) -> torch.Tensor:
    """Rows after crossing the wire in the int8 codec: encoded, decoded, float32."""
    import torch

    from dsd.protocol import WireFormat, decode_tensor

    return torch.from_numpy(decode_tensor(WireFormat("int8").encode(h.float().numpy())))


def shape_cuts(n: int, shape: str) -> list[tuple[int, int]]:
    """The position ranges in which `shape` (see SHAPES) sends a sequence of n = prompt + CONTINUATION tokens."""
    def chunks(a: int, b: int, size: int) -> list[tuple[int, int]]:
        return [(i, min(i + size, b)) for i in range(a, b, size)]

    if shape == "route":
        return chunks(0, n - CONTINUATION, CHUNK) + chunks(n - CONTINUATION, n, WINDOW)
    return chunks(0, n - WINDOW, CHUNK) + [(n - WINDOW, n)]


def final_rows(pieces: Sequence[SpanModule], embedded: torch.Tensor, shape: str, wire: str) -> np.ndarray:
    """The rows [n, h] the head gets back from the two hops for the embedded sequence [1, n, h], sent as `shape`
    over `wire`."""
    import torch

    if wire in ("int8", "int8-head"):
        embedded = int8_wire(embedded[0]).unsqueeze(0)
    windows = [embedded[:, a:b] for a, b in shape_cuts(embedded.shape[1], shape)]
    outs = run_windows(pieces, windows, int8_wire if wire in ("int8", "int8-peers") else None)
    return torch.cat([o["full"] for o in outs]).numpy()


def pair_assignments(a: str, b: str, wire: str) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """What goes into pair (a, b)'s distribution: ((route class, route wire), (replica class, replica wire)) — the
    route class a against replica class b and, when a != b, the reverse; with int8: the route's peers on int8
    against a replica's exact ones and both routes' peers on int8 (one head: both get the same input), the same with
    the head on int8 too, and — no head does it, kept as a bound — the route alone on int8 everywhere."""
    wires = [("exact", "exact")] if wire == "exact" else [
        ("int8-peers", "exact"), ("int8-peers", "int8-peers"), ("int8", "int8-head"), ("int8", "int8"),
        ("int8", "exact")]
    ordered = [(a, b)] if a == b else [(a, b), (b, a)]
    return [((x, rw), (y, pw)) for rw, pw in wires for x, y in ordered]


def pair_stats(gaps: Sequence[np.ndarray]) -> dict[str, Any]:
    """n, median, p90, p99, p999, max, tolerance (max(FLOOR, MARGIN * max)) over every prompt's gaps, and each
    prompt's max."""
    values = [float(v) for g in gaps for v in g]
    top = max(values)
    out: dict[str, Any] = {"n": len(values)}
    for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
        out[name] = sig(percentile(values, q))
    out |= {"max": sig(top), "tolerance": sig(max(FLOOR, MARGIN * top)),
            "per_prompt_max": [sig(float(g.max())) for g in gaps]}
    return out


def calibrate_model(store: Store, prompts: dict[int, list[int]]) -> dict[str, Any]:
    """Every class's final rows per prompt in both shapes over both wires (the continuation: the float32 model's
    greedy tokens), then per pair the distances between route and replica rows at positions >= SINK."""
    import torch

    from dsd.node.route.audit_rules import SINK, row_gaps

    head = store.load_head(dtype=torch.float32)  # the head embeds in float32 whatever the route computes in
    rows: dict[tuple[str, str, str], list[np.ndarray]] = {}
    embedded: dict[int, torch.Tensor] = {}
    continuations: dict[int, list[int]] = {}
    for cls in ("fp32", "bf16", "fp16"):  # float32 first: it picks the continuations
        started = time.monotonic()
        pieces = span_pieces(store, CLASSES[cls])
        for problem, ids in prompts.items():
            if problem not in embedded:
                continuations[problem] = greedy_steps(pieces, head, ids, CONTINUATION)[0]
                embedded[problem] = head.embed(torch.tensor([ids + continuations[problem]]))
            for wire in WIRES:
                for shape in SHAPES:
                    rows.setdefault((cls, wire, shape), []).append(final_rows(pieces, embedded[problem], shape, wire))
        log(f"{cls}: {len(prompts)} prompts, both shapes and wires, in {time.monotonic() - started:.1f} s")
        del pieces
        gc.collect()
    pairs: dict[str, Any] = {}
    for key in pair_keys():
        a, b = key.removesuffix("+int8").split("/")
        wire = "int8" if key.endswith("+int8") else "exact"
        per_prompt = []
        for i in range(len(prompts)):
            gaps = [row_gaps(rows[(x, xw, "route")][i][SINK:], rows[(y, yw, "replica")][i][SINK:])
                    for (x, xw), (y, yw) in pair_assignments(a, b, wire)]
            per_prompt.append(np.concatenate(gaps))
        pairs[key] = pair_stats(per_prompt)
    return {"model_id": store.manifest.model_id, "num_layers": store.num_layers,
            "hidden_size": int(store.manifest.config["hidden_size"]),
            "prompts": [{"problem": p, "prompt_tokens": len(ids), "continuation": continuations[p]}
                        for p, ids in prompts.items()],
            "pairs": pairs}


def calibration_table(models: dict[str, Any]) -> str:
    """Per pair and model: the worst honest row, p99 and the tolerance."""
    names = list(models)
    head = f"{'pair':<16}" + "".join(f"{m + ' max':>14}{m + ' p99':>14}{m + ' tol':>14}" for m in names)
    lines = [head, "-" * len(head)]
    for key in pair_keys():
        lines.append(f"{key:<16}" + "".join(
            f"{models[m]['pairs'][key]['max']:>14.4g}{models[m]['pairs'][key]['p99']:>14.4g}"
            f"{models[m]['pairs'][key]['tolerance']:>14.4g}" for m in names))
    return "\n".join(lines)


def calibrate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="integrity.py calibrate",
                                description="honest distances between two audit routes, per precision pair")
    p.add_argument("--models", default="real,tiny", help="real (the default target) and/or tiny")
    p.add_argument("--problems", default=",".join(map(str, PROBLEMS)), help="HumanEval problem indices")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/dsd-integrity"), help="where the tiny store is built")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    models = model_kinds(p, args.models)
    problems = comma_list(p, "--problems", args.problems, int)
    import torch

    from dsd.node.route.audit_rules import SINK
    from dsd.node.testnet.workload import humaneval_problems
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    if "real" in models and not prepared(weights="fp32"):
        p.error("the default target is not prepared: run `dsd-node models prepare --weights fp32` first")
    torch.set_num_threads(args.threads)
    out = args.out or RESULTS_DIR / f"audit-calibration-{today()}.json"
    result: dict[str, Any] = {
        **run_metadata("audit-calibration", args), "command": command_line("integrity.py", ["calibrate", *argv]),
        "metric": "row_gaps (node/route/audit_rules.py): ||a - b|| / max(||a||, ||b||) per position of the final "
                  "hidden rows, positions >= sink",
        "margin": MARGIN, "floor": FLOOR, "why": {"margin": MARGIN_WHY, "floor": FLOOR_WHY}, "sink": SINK,
        "shapes": SHAPES,
        "distribution": "pair a/b: route a against replica b, and for a != b also route b against replica a; "
                        "+int8 (each both ways for a != b): the route's peers on int8 against the replica's exact, "
                        "both routes' peers on int8, the head on int8 with the route's peers against the head on "
                        "int8 alone, everything on int8 on both, and everything on int8 against all exact; "
                        "nothing skipped",
        "wires": {"exact": "no lossy crossing", "int8": "the head's rows into hop 1 and each hop's rows out on int8",
                  "int8-peers": "each hop's rows out on int8, the head's exact", "int8-head": "the head's rows "
                  "into hop 1 on int8, the hops' exact"},
        "load_before": os.getloadavg(), "seconds": {}, "models": {},
    }
    if out.exists():  # resume: keep the models an earlier run of the same settings finished
        old = json.loads(out.read_text())
        if (old.get("settings", {}).get("problems"), old.get("margin"), old.get("floor"), old.get("sink"),
                old.get("shapes"), old.get("distribution")) == (args.problems, MARGIN, FLOOR, SINK, SHAPES,
                                                                 result["distribution"]):
            for m in models:
                if m in old.get("models", {}):
                    result["models"][m], result["seconds"][m] = old["models"][m], old["seconds"][m]
                    log(f"{m}: kept from the earlier run in {out.name}")
    texts = humaneval_problems()
    for m in models:
        if m in result["models"]:
            continue
        started = time.monotonic()
        if m == "real":
            store = Store(default_store_paths(weights="fp32")["target"])
            prompts = prompt_ids(store, problems, chat=False)
        else:  # the bench's tiny target and its prompts, as soak.load_models makes them
            store = Store(build_tiny_store(args.work / "target", layers=8))
            prompts = {i: byte_ids(texts[i]["prompt"])[-96:] for i in problems}
        log(f"{m}: {store.manifest.model_id}, {store.num_layers} layers, {len(prompts)} prompts")
        result["models"][m] = calibrate_model(store, prompts)
        result["seconds"][m] = round(time.monotonic() - started, 1)
        result["load_after"] = os.getloadavg()
        if "real" in result["models"]:  # what the head uses
            result["pairs"] = {k: {"max": v["max"], "tolerance": v["tolerance"]}
                               for k, v in result["models"]["real"]["pairs"].items()}
        write_json(out, result)
        log(f"{m}: done in {result['seconds'][m]} s, written to {out.name}")
    print(f"margin {MARGIN} ({MARGIN_WHY}); floor {FLOOR} ({FLOOR_WHY}); sink {SINK}")
    print(calibration_table(result["models"]))
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"gaps": gaps_main, "summarize": summarize_main,
                                                       "calibrate": calibrate_main, "detect": detect_main,
                                                       "overhead": overhead_main}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv[:1])
    return COMMANDS[args.command](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
