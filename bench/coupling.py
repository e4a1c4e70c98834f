"""What seeded sampling costs in acceptance: the standard speculative-sampling rule against Gumbel-max coupling.

For every HumanEval prompt of a fixed set, the target (whole model, in-process) samples a continuation at the
temperature (`--tokens`, seeded); the target and the draft then score it in one forward each. At every position
of it, with p and q the target's and the draft's warped distributions there:
- the standard rule accepts the draft's token with probability Σ min(p, q) (exact);
- Gumbel coupling (docs/sampling.md) accepts when argmax(log p + G) = argmax(log q + G), estimated over
  `--draws` noise vectors G per position (the same generator the head uses, `sampling.gumbel`).
Reported per temperature: each prompt's mean acceptance under both rules and their ratio, with the median and
spread over prompts.

    python bench/coupling.py            # the default pair in float32 (needs `dsd-node models prepare --weights fp32`)
    python bench/coupling.py --tiny     # a tiny random target drafting for a noisy copy: checks the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, build_tiny_store, run_metadata, today, write_json

PROBLEMS = ",".join(str(i) for i in range(0, 160, 16))  # 0,16,...,144: the drafting benches' prompts


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict[str, float]:
    """Median and spread (10th/90th percentile, min, max)."""
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return {"median": round(statistics.median(values), 4), "p10": round(deciles[0], 4),
            "p90": round(deciles[-1], 4), "min": round(min(values), 4), "max": round(max(values), 4), "n": len(values)}


def positions(target: Any, draft: Any, ids: list[int], tokens: int, temperature: float, seed: int) -> tuple:
    """The target's sampled continuation of `ids` and both models' logits rows predicting its tokens."""
    import torch

    torch.manual_seed(seed)
    out = target.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=True, temperature=temperature,
                          top_k=0, top_p=1.0, pad_token_id=0)
    seq = out[0].tolist()
    n = len(seq) - len(ids)
    rows = slice(len(ids) - 1, len(seq) - 1)
    return target(out).logits[0, rows].float(), draft(out).logits[0, rows].float(), n


def acceptance(p_rows: Any, q_rows: Any, temperature: float, draws: int, seed: int) -> tuple[float, float]:
    """Mean acceptance over the rows: the standard rule's exact Σ min(p, q), and Gumbel coupling's estimate."""
    import torch

    from dsd.node.head.sampling import SamplingParams, gumbel, warp

    params = SamplingParams(temperature=temperature)
    standard, coupled = [], []
    for i in range(p_rows.shape[0]):
        p, q = warp(p_rows[i], params), warp(q_rows[i], params)
        standard.append(float(torch.minimum(p, q).sum()))
        logp, logq = torch.log(p), torch.log(q)
        hits = 0
        for d in range(draws):
            g = torch.as_tensor(gumbel(seed * 1_000_003 + d, i, p.shape[-1]))
            hits += int(torch.argmax(logp + g)) == int(torch.argmax(logq + g))
        coupled.append(hits / draws)
    return statistics.fmean(standard), statistics.fmean(coupled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random target and a noisy copy (checks the script)")
    ap.add_argument("--problems", default=PROBLEMS, help=f"HumanEval problem indices (default {PROBLEMS})")
    ap.add_argument("--tokens", type=int, default=32, help="sampled positions per prompt (default 32)")
    ap.add_argument("--temperatures", default="1.0,0.8", help="comma-separated (default 1.0,0.8)")
    ap.add_argument("--draws", type=int, default=200, help="noise vectors per position (default 200)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(".dsd/bench"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from dsd.node.testnet.workload import humaneval_problems
    from dsd.shard_store import Store
    from dsd.shard_store.default_models import default_store_paths, prepared

    torch.set_num_threads(args.threads)
    if args.tiny:
        target_path = draft_path = build_tiny_store(args.work / "coupling-tiny", layers=4, hidden=64)
    elif prepared(weights="fp32"):
        paths = default_store_paths(weights="fp32")
        target_path, draft_path = paths["target"], paths["draft"]
    else:
        raise SystemExit("the default pair is not prepared: run `dsd-node models prepare --weights fp32`, or pass --tiny")
    tstore = Store(target_path)
    target, draft = tstore.load_full().eval(), Store(draft_path).load_full().eval()
    if args.tiny:
        with torch.no_grad():
            for name, w in draft.named_parameters():
                if ".layers." in name:
                    w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * 0.1 * w.std())
    tokenizer = tstore.load_tokenizer()
    texts = [humaneval_problems()[int(i)]["prompt"] for i in args.problems.split(",")]
    prompts = [list(tokenizer(t)["input_ids"]) if tokenizer is not None else list(t.encode())[:64] for t in texts]
    result: dict[str, Any] = {**run_metadata("coupling", args), "load_before": os.getloadavg(), "temperatures": {}}
    with torch.inference_mode():
        for temperature in (float(t) for t in args.temperatures.split(",")):
            per_prompt = []
            for k, ids in enumerate(prompts):
                p_rows, q_rows, n = positions(target, draft, ids, args.tokens, temperature, seed=k)
                std, cpl = acceptance(p_rows, q_rows, temperature, args.draws, seed=k)
                per_prompt.append({"problem": int(args.problems.split(",")[k]), "positions": n,
                                   "standard": round(std, 4), "coupled": round(cpl, 4), "ratio": round(cpl / std, 4)})
                log(f"T={temperature} prompt {k + 1}/{len(prompts)}: standard {std:.3f}, coupled {cpl:.3f}")
            result["temperatures"][str(temperature)] = {
                "per_prompt": per_prompt,
                "standard": spread([r["standard"] for r in per_prompt]),
                "coupled": spread([r["coupled"] for r in per_prompt]),
                "ratio": spread([r["ratio"] for r in per_prompt]),
            }
    result["load_after"] = os.getloadavg()
    out = args.out or RESULTS_DIR / f"coupling-{'tiny' if args.tiny else 'real'}-{today()}.json"
    write_json(out, result)
    log(f"written {out}")


if __name__ == "__main__":
    main()
