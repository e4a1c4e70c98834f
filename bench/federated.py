"""Federated mode (SpecFed) benchmark: top-K transmission error, acceptance and uplink bytes vs K.

Two workers (the prepared 1.5B and 0.5B, else two tiny random Qwen2 models sharing a vocabulary)
and a draft (the 0.5B, else a tiny one). For each HumanEval prompt the draft's greedy continuation
is run once through every model; at each continuation position the workers' full warped
distributions p_i and the draft's q are computed once per temperature, and every K and both
reconstructions are evaluated from them offline — the same math the server runs on the wire:
top-K of p_i (probabilities rounded to fp16 as sent), rebuilt, averaged with equal weights.

Reported per (temperature, K, method): mean eps (weighted over workers), aggregation bias
||p_hat - p||_1 against the 2 * eps_bar bound (exact top-K probabilities; the fp16 wire value too),
expected acceptance sum_x min(p_hat, q) against K = V, and TopKResult bytes per position vs the
fp32 full distribution (4 V bytes). A short live run over real worker processes measures the
bytes on the wire for one K. Prints JSON; writes bench/results/federated-<date>.json and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness import RESULTS_DIR, swarm, today, write_json

from dsd.protocol import TopKResult, aggregate, encode, reconstruct, topk_from_probs
from dsd.shard_store import Store

TEMPERATURES = (0.8, 1.0, 1.2)
METHODS = ("renormalize", "residual")


def ks_for(vocab: int) -> list[int]:
    """K in {8, 64, 320, 1 % of V, V}, clipped to V and deduplicated."""
    return sorted({min(vocab, k) for k in (8, 64, 320, max(1, vocab // 100), vocab)})


def tiny_stores(root: Path) -> dict[str, Path]:
    """Two tiny worker models and a tiny draft, one vocabulary, as stores (no tokenizer: prompts are ids)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dsd.shard_store import convert

    out = {}
    for name, seed, layers in (("worker_a", 0, 5), ("worker_b", 1, 3), ("draft", 2, 2)):
        torch.manual_seed(seed)
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=2000, max_position_embeddings=1024, initializer_range=0.2,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        model.save_pretrained(root / name / "hf")
        convert(root / name / "hf", root / name / "store", model_id=f"tiny-{name}")
        out[name] = root / name / "store"
    return out


def real_stores() -> dict[str, Path]:
    from dsd.shard_store.default_models import default_store_paths

    paths = default_store_paths(weights="fp32")
    return {"worker_a": paths["target"], "worker_b": paths["draft"], "draft": paths["draft"]}


def prompts_for(store: Store, count: int, quick_tiny: bool) -> list[tuple[str, list[int]]]:
    """HumanEval prompts as token ids (tiny models: random ids, since they have no tokenizer)."""
    if quick_tiny:
        rng = np.random.default_rng(0)
        return [(f"random/{i}", [1, *rng.integers(3, store.manifest.vocab_size, 40).tolist()]) for i in range(count)]
    from dsd.node.testnet.workload import humaneval_prompt

    tok = store.load_tokenizer()
    return [(tid, list(tok(text)["input_ids"])) for tid, text in (humaneval_prompt(i) for i in range(count))]


def logits_rows(store: Store, seq: list[int], first: int) -> torch.Tensor:
    """Float32 logits predicting seq[first+1:], i.e. rows first..len-2 of one whole-model forward pass."""
    head, span = store.load_head(), store.load_span(0, store.num_layers)
    with torch.inference_mode():
        hidden = span(head.embed(torch.tensor([seq])), 0, span.new_cache())
        return head.logits(hidden[:, first : len(seq) - 1])[0].to(torch.float32)


def greedy_continuation(store: Store, prompt: list[int], n: int) -> list[int]:
    """The draft's greedy continuation (KV cached)."""
    head, span = store.load_head(), store.load_span(0, store.num_layers)
    cache = span.new_cache()
    seq, window = list(prompt), list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            h = span(head.embed(torch.tensor([window])), len(seq) - len(window), cache)
            nxt = int(torch.argmax(head.logits(h[:, -1:])[0, -1]))
            seq.append(nxt)
            window = [nxt]
    return seq[len(prompt):]


def softmax_t(logits: torch.Tensor, t: float) -> np.ndarray:
    p = torch.softmax(logits.double() / t, dim=-1).numpy()
    return p / p.sum(axis=1, keepdims=True)


def evaluate(worker_logits: list[torch.Tensor], draft_logits: torch.Tensor, vocab: int) -> list[dict]:
    """Every (temperature, K, method) cell from the full logits of all positions."""
    rows = []
    weights = [1.0 / len(worker_logits)] * len(worker_logits)
    for t in TEMPERATURES:
        ps = [softmax_t(lg, t) for lg in worker_logits]
        q = softmax_t(draft_logits, t)
        exact = aggregate(ps, weights)
        alpha_full = float(np.minimum(exact, q).sum(axis=1).mean())
        for k in ks_for(vocab):
            tops = [topk_from_probs(p.astype(np.float32), k) for p in ps]
            eps_bar = sum(w * (1.0 - np.take_along_axis(p, ids, 1).sum(axis=1)) for w, p, (ids, _) in zip(weights, ps, tops, strict=True))
            wire = [(ids, top.astype(np.float16).astype(np.float32)) for ids, top in tops]
            msg = TopKResult.build("bench", 0, 0, tops[0][0], wire[0][1], prob_codec="fp16")
            bytes_per_row = len(encode(msg)) / tops[0][0].shape[0]
            for method in METHODS:
                exact_top = [reconstruct(ids, np.take_along_axis(p, ids, 1), vocab, method) for p, (ids, _) in zip(ps, tops, strict=True)]
                bias = np.abs(aggregate(exact_top, weights) - exact).sum(axis=1)
                p_hat = aggregate([reconstruct(ids, top, vocab, method) for ids, top in wire], weights)
                bias_wire = np.abs(p_hat - exact).sum(axis=1)
                alpha = float(np.minimum(p_hat, q).sum(axis=1).mean())
                rows.append({
                    "temperature": t, "k": k, "method": method, "positions": int(bias.size),
                    "mean_eps": float(eps_bar.mean()), "bias": float(bias.mean()), "bound_2eps": float(2 * eps_bar.mean()),
                    "bound_held": bool(np.all(bias <= 2 * eps_bar + 1e-9)), "bias_wire_fp16": float(bias_wire.mean()),
                    "acceptance": alpha, "acceptance_k_eq_v": alpha_full, "acceptance_change": alpha - alpha_full,
                    "bytes_per_row": round(bytes_per_row, 1), "full_bytes_per_row": 4 * vocab,
                })
    return rows


def merge(cells: list[list[dict]]) -> list[dict]:
    """Position-weighted mean of each cell over prompts."""
    out = []
    for group in zip(*cells, strict=True):
        n = sum(c["positions"] for c in group)
        row = dict(group[0])
        for key in ("mean_eps", "bias", "bound_2eps", "bias_wire_fp16", "acceptance", "acceptance_k_eq_v",
                    "acceptance_change", "bytes_per_row"):
            row[key] = round(sum(c[key] * c["positions"] for c in group) / n, 6)
        row["positions"] = n
        row["bound_held"] = all(c["bound_held"] for c in group)
        out.append(row)
    return out


def live_run(stores: dict[str, Path], prompt: list[int], k: int, new_tokens: int, timeout_s: float) -> dict:
    """Two worker processes and a bootstrap on loopback; one federated generation; bytes on the wire."""
    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import ModelDrafter
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import HeadSetup
    from dsd.node.peer.generation import FederatedTarget, generate_over_swarm
    from dsd.node.peer.host import head_node
    from dsd.node.testnet.swarm import SwarmSpec

    spec = SwarmSpec(state=Path(tempfile.mkdtemp(prefix="fedbench-")), federated=True, threads=1, timeout_s=timeout_s,
                     worker_stores=[stores["worker_a"], stores["worker_b"]])
    with contextlib.ExitStack() as stack:
        try:
            state = stack.enter_context(swarm(spec))
        except Exception as exc:  # the offline numbers stand without the live run
            return {"error": f"testnet did not come up: {type(exc).__name__}: {exc}"}
        dstore = Store(stores["draft"])
        params = SamplingParams(temperature=1.0)
        drafter = ModelDrafter(dstore.load_full(), params)
        vocab = int(dstore.manifest.vocab_size)

        async def main() -> dict:
            async with head_node([state.bootstrap]) as (node, legs):
                cfg = GenerationConfig(mode="dsd", max_new_tokens=new_tokens, params=params, gamma=4, seed=0)
                setup = HeadSetup(None, "", 0, drafter, vocab)
                target = FederatedTarget(top_k=k, window_timeout_s=timeout_s)
                return (await generate_over_swarm(node, legs, None, setup, prompt, cfg, target=target)).as_dict()

        report = trio.run(main)
        return {key: report[key] for key in ("new_tokens", "elapsed_s", "acceptance_rate", "rounds", "bytes_received",
                                             "uplink_bytes_per_row", "uplink_bytes_per_token",
                                             "full_distribution_bytes_per_row", "workers", "top_k", "reconstruct")}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = dict(zip(TEMPERATURES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for t in TEMPERATURES:
        for method, style in (("renormalize", "--"), ("residual", "-")):
            sel = [r for r in rows if r["temperature"] == t and r["method"] == method]
            ks = [r["k"] for r in sel]
            axes[0].plot(ks, [max(r["bias"], 1e-9) for r in sel], style, marker="o", color=colors[t], label=f"T={t} {method}")
            axes[1].plot(ks, [r["acceptance_change"] for r in sel], style, marker="o", color=colors[t], label=f"T={t} {method}")
        sel = [r for r in rows if r["temperature"] == t and r["method"] == "residual"]
        axes[0].plot([r["k"] for r in sel], [max(r["bound_2eps"], 1e-9) for r in sel], ":", color=colors[t], label=f"T={t} 2 eps_bar")
    sel = [r for r in rows if r["temperature"] == TEMPERATURES[0] and r["method"] == "residual"]
    axes[2].plot([r["k"] for r in sel], [r["bytes_per_row"] for r in sel], marker="o", label="top-K (fp16 probs + varint ids)")
    axes[2].axhline(sel[0]["full_bytes_per_row"], color="red", ls="--", label="full fp32 distribution")
    axes[0].set(xscale="log", yscale="log", xlabel="K", ylabel="aggregation bias ||p_hat - p||_1", title="bias vs 2 eps_bar bound")
    axes[1].set(xscale="log", xlabel="K", ylabel="acceptance(K) - acceptance(V)", title="expected acceptance change")
    axes[2].set(xscale="log", yscale="log", xlabel="K", ylabel="uplink bytes per position", title="uplink per token per worker")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models and one prompt (a few minutes)")
    ap.add_argument("--tiny", action="store_true", help="tiny models even when the real pair is prepared")
    ap.add_argument("--prompts", type=int, default=3, help="HumanEval prompts (default 3)")
    ap.add_argument("--new-tokens", type=int, default=48, help="continuation positions per prompt (default 48)")
    ap.add_argument("--live-tokens", type=int, default=24, help="tokens of the live run (0 = skip it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dsd.shard_store.default_models import prepared

    tiny = args.quick or args.tiny or not prepared(weights="fp32")
    tmp = Path(tempfile.mkdtemp(prefix="fedbench-models-"))
    stores = tiny_stores(tmp) if tiny else real_stores()
    n_prompts = 1 if args.quick else args.prompts
    new_tokens = min(args.new_tokens, 24) if args.quick else args.new_tokens
    draft = Store(stores["draft"])
    vocab = int(draft.manifest.vocab_size)
    t0 = time.perf_counter()
    prompts = prompts_for(draft, n_prompts, tiny)
    cells = []
    for tid, prompt in prompts:
        cont = greedy_continuation(draft, prompt, new_tokens)
        seq = prompt + cont
        first = len(prompt) - 1
        worker_logits = [logits_rows(Store(stores[w]), seq, first) for w in ("worker_a", "worker_b")]
        cells.append(evaluate(worker_logits, logits_rows(draft, seq, first), vocab))
        print(f"{tid}: {len(prompt)} prompt tokens, {len(cont)} positions ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    rows = merge(cells)
    k_live = max(1, vocab // 100)
    live = live_run(stores, prompts[0][1], k_live, args.live_tokens, 600.0) if args.live_tokens > 0 else None
    result = {
        "benchmark": "federated",
        "date": today(),
        "models": {name: Store(p).manifest.model_id for name, p in stores.items()},
        "tiny": tiny,
        "vocab_size": vocab,
        "prompts": [tid for tid, _ in prompts],
        "positions_per_prompt": new_tokens,
        "weights": [0.5, 0.5],
        "temperatures": list(TEMPERATURES),
        "ks": ks_for(vocab),
        "offline_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "live": live,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"federated-{result['date']}{'-tiny' if tiny else ''}"
    write_json(args.out / f"{stem}.json", result)
    plot(rows, args.out / f"{stem}.png", f"SpecFed top-K: {' + '.join(result['models'][w] for w in ('worker_a', 'worker_b'))}, "
         f"draft {result['models']['draft']}, V={vocab}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
