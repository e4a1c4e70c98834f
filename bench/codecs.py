"""Wire cost of the protocol codecs: bytes per token and encode+decode speed of hidden states,
and bytes per position of top-K distributions versus the full fp32 distribution. Prints JSON.

Hidden states come from the real default models when their stores are prepared (the output of
the first half of the layers, i.e. what one peer hands the next), else from a synthetic
stand-in: standard normal with a few outlier channels (x40..x120), like real LLM activations.
Width 4096 is always synthetic. Top-K uses V = 151,936 with synthetic peaked distributions
(softmax of normal logits plus one boosted "obvious" token) and, when available, the real
next-token distributions of the 0.5B model. Top-K ids go as varint gaps, or not at all
when K = V ("auto" picks the dense codec), probabilities as fp16 (optionally zstd) or fp32.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from dsd.protocol import (
    Forward,
    TopKResult,
    decode_tensor,
    encode,
    encode_tensor,
    reconstruct,
    topk_from_probs,
)

VOCAB = 151_936
KS = (8, 64, 320, 1519, VOCAB)
CODECS = (("raw", {}), ("fp16", {}), ("bf16", {}), ("int8", {"block": 64}))
PROMPT = '''def fizzbuzz(n: int) -> list[str]:
    """Return the FizzBuzz sequence from 1 to n."""
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out


def is_palindrome(s: str) -> bool:
    """Check whether s reads the same both ways, ignoring case."""
    s = s.lower()
    return s == s[::-1]
'''


def synthetic_hidden(tokens: int, width: int, seed: int = 0) -> np.ndarray:
    """Normal activations with a handful of large outlier channels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    channels = rng.choice(width, size=max(2, width // 512), replace=False)
    x[:, channels] *= rng.uniform(40, 120, size=channels.size).astype(np.float32)
    return x


def real_hidden(tokens: int) -> tuple[dict[int, np.ndarray], np.ndarray | None, str]:
    """Mid-model hidden states of the default pair and the draft's next-token probabilities, if prepared."""
    try:
        import torch

        from dsd.shard_store import Store
        from dsd.shard_store.default_models import default_store_paths, store_complete
    except Exception as exc:  # the bench must still run without the model layer
        return {}, None, f"shard_store unavailable: {exc}"
    torch.set_num_threads(2)
    out: dict[int, np.ndarray] = {}
    probs = None
    notes = []
    for role, path in sorted(default_store_paths(weights="fp32").items()):
        if not store_complete(path):
            notes.append(f"{role} store not prepared in float32 (dsd-node models prepare --weights fp32)")
            continue
        store = Store(path)
        tok = store.load_tokenizer()
        ids = tok(PROMPT, return_tensors="pt")["input_ids"][:, :tokens]
        head = store.load_head()
        half = store.num_layers // 2
        first = store.load_span(0, half)
        hidden = first(head.embed(ids), 0, first.new_cache())
        out[head.hidden_size] = hidden[0].float().numpy()
        notes.append(f"{role}: {path.name} layers [0, {half}) output, {ids.shape[1]} tokens")
        if role == "draft":
            second = store.load_span(half, store.num_layers)
            final = second(hidden, 0, second.new_cache())
            probs = torch.softmax(head.logits(final)[0].double(), dim=-1).numpy()
        del first, head
    return out, probs, "; ".join(notes)


def timed(fn: Any, min_time: float = 0.3) -> float:
    """Seconds per call, repeating until `min_time` has passed."""
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / reps


def bench_hidden(x: np.ndarray, source: str) -> dict[str, Any]:
    """Bytes per token, speed and error of each codec on one [tokens, width] array."""
    tokens = x.shape[0]
    rows: dict[str, Any] = {"source": source, "tokens": tokens, "fp32_bytes_per_token": x.shape[1] * 4}
    for codec, kw in CODECS:
        for zstd in (False, True):
            t = encode_tensor(x, codec, zstd, **kw)
            y = decode_tensor(t)
            per_call = timed(lambda codec=codec, zstd=zstd, kw=kw: decode_tensor(encode_tensor(x, codec, zstd, **kw)))
            err = np.abs(y.astype(np.float64) - x)
            frame = encode(Forward("0123456789abcdef", 1, 0, None, t))
            rows[codec + ("+zstd" if zstd else "")] = {
                "payload_bytes_per_token": round(len(t.data) / tokens, 1),
                "frame_bytes_per_token": round(len(frame) / tokens, 1),
                "ratio_vs_fp32": round(len(t.data) / x.nbytes, 4),
                "encode_decode_MBps": round(x.nbytes / per_call / 1e6, 1),
                "max_abs_err": float(err.max()),
                "rel_rms_err": float(np.sqrt((err**2).mean() / (x.astype(np.float64) ** 2).mean())),
            }
    return rows


def synthetic_probs(n: int, seed: int = 1) -> np.ndarray:
    """Peaked next-token distributions over VOCAB: normal logits (sd 2) plus one boosted token."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, VOCAB)) * 2.0
    logits[np.arange(n), rng.integers(0, VOCAB, n)] += rng.uniform(14, 24, n)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def bench_topk(p: np.ndarray, source: str) -> dict[str, Any]:
    """Bytes per position of TopKResult frames for each K and encoding, with the missing mass and l1 error."""
    n = p.shape[0]
    rows: dict[str, Any] = {
        "source": source,
        "positions": n,
        "mean_top1_prob": round(float(p.max(axis=1).mean()), 4),
        "full_fp32_bytes_per_position": VOCAB * 4,
    }
    for k in KS:
        ids, top = topk_from_probs(p, k)
        exact = np.take_along_axis(p, ids, axis=1)
        eps = 1.0 - exact.sum(axis=1)
        entry: dict[str, Any] = {
            "mean_eps": max(0.0, float(eps.mean())),
            "l1_residual": float(np.abs(reconstruct(ids, exact, VOCAB, "residual") - p).sum(axis=1).mean()),
        }
        for label, id_codec, prob_codec, zstd in (
            ("auto+fp16", "auto", "fp16", False),
            ("auto+fp16+zstd", "auto", "fp16", True),
            ("uint32+fp32", "uint32", "fp32", False),
        ):
            msg = TopKResult.build("0123456789abcdef", 1, 0, ids, top, id_codec=id_codec, prob_codec=prob_codec, zstd=zstd)
            per_pos = len(encode(msg)) / n
            entry[label] = {
                "id_codec": msg.id_codec,
                "bytes_per_position": round(per_pos, 1),
                "vs_full_fp32": round(per_pos / (VOCAB * 4), 5),
            }
        rows[f"K={k}"] = entry
    return rows


def main() -> None:
    """Run both benchmarks and print one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="window length for hidden states")
    ap.add_argument("--positions", type=int, default=16, help="positions per top-K message")
    ap.add_argument("--synthetic-only", action="store_true", help="skip the real models")
    args = ap.parse_args()
    reals, real_probs, note = ({}, None, "skipped") if args.synthetic_only else real_hidden(args.tokens)
    hidden = {}
    for width in (896, 1536, 4096):
        if width in reals:
            hidden[str(width)] = bench_hidden(reals[width], "real")
        else:
            hidden[str(width)] = bench_hidden(synthetic_hidden(args.tokens, width), "synthetic")
    topk = {"synthetic": bench_topk(synthetic_probs(args.positions), "synthetic")}
    if real_probs is not None:
        topk["real_draft_model"] = bench_topk(real_probs[: args.positions * 4 : 4], "real (Qwen2.5-Coder-0.5B, code prompt)")
    print(json.dumps({"real_models": note, "hidden": hidden, "topk": topk, "vocab": VOCAB}, indent=1))


if __name__ == "__main__":
    main()
