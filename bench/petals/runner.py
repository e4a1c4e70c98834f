"""A Petals swarm and client kept up for a benchmark, driven over stdin/stdout (JSON lines), in a namespace that has
only loopback. Run with the Petals venv's python by bench/petals_compare.py:

    PETALS_PY bench/petals/runner.py --model LLAMA_DIR --servers 4 --delay-ms 700 [--push-fix]

Once every block is online it prints {"ready": true, ...}; then each request line gets one answer line:
    {"op": "generate", "ids": [...], "max_new_tokens": N, "stops": ["\\ndef", ...], "eos": [ids]}
        -> {"tokens": [...], "elapsed_s": s, "prefill_s": s}   greedy; stops at an eos or once the new text holds
                                                              a stop string
    {"op": "steps", "n": 20}  -> {"step_s": [...]}    one-token steps in one session (the per-token path's cost)
    {"op": "quit"}
A failed request answers {"error": "..."} and the runner goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from swarm import PetalsSwarm, bring_up_loopback, isolated_argv, run_isolated, split_blocks


def answer(obj: dict[str, Any]) -> None:
    """One JSON line on stdout (the benchmark reads them in order)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class StopOnText:
    """A transformers StoppingCriteria: stop once the decoded new tokens contain any stop string."""

    def __init__(self, tokenizer: Any, prompt_len: int, stops: list[str]) -> None:
        self.tokenizer, self.prompt_len, self.stops = tokenizer, prompt_len, stops

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> bool:
        text = self.tokenizer.decode(input_ids[0, self.prompt_len:], skip_special_tokens=False)
        return any(s in text for s in self.stops)


class FirstToken:
    """A transformers streamer noting when the first new token arrives (the prompt's trip is over)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # the first call carries the prompt
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def generate(model: Any, tokenizer: Any, req: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation of up to max_new_tokens after `ids`, stopping at a stop string or the tokenizer's eos."""
    import torch
    from transformers import StoppingCriteriaList

    ids = torch.tensor([req["ids"]])
    stops = list(req.get("stops") or [])
    criteria = StoppingCriteriaList([StopOnText(tokenizer, ids.shape[1], stops)]) if stops else None
    streamer = FirstToken()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=int(req["max_new_tokens"]), do_sample=False,
                             stopping_criteria=criteria, streamer=streamer, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=req.get("eos") or tokenizer.eos_token_id)
    end = time.perf_counter()
    first = streamer.first_at or end
    return {"tokens": out[0, ids.shape[1]:].tolist(), "elapsed_s": end - start, "prefill_s": first - start}


def steps(model: Any, n: int) -> dict[str, Any]:
    """Seconds of `n` one-token steps in one inference session after a one-token prefill."""
    import torch

    times = []
    with torch.no_grad(), model.inference_session(max_length=n + 4) as session:
        model.generate(torch.tensor([[1]]), max_new_tokens=1, session=session, do_sample=False)
        for _ in range(n):
            t0 = time.perf_counter()
            model.generate(None, max_new_tokens=1, session=session, do_sample=False)
            times.append(time.perf_counter() - t0)
    return {"step_s": times}


def serve(args: argparse.Namespace, work: Path) -> None:
    """Bring the swarm up, then answer requests until quit or end of input."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(args.threads)
    layers = AutoConfig.from_pretrained(str(args.model)).num_hidden_layers
    spans = split_blocks(layers, args.servers)
    started = time.monotonic()
    with PetalsSwarm(args.model, spans, work / "logs", threads=args.threads, delay_ms=args.delay_ms,
                     push_fix=args.push_fix) as swarm:
        model = swarm.client()
        tokenizer = AutoTokenizer.from_pretrained(str(args.model))
        import petals
        answer({"ready": True, "spans": spans, "up_s": round(time.monotonic() - started, 1), "delay_ms": args.delay_ms,
                "push_fix": args.push_fix, "petals": petals.__version__, "threads": args.threads})
        for line in sys.stdin:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            try:
                answer(generate(model, tokenizer, req) if req["op"] == "generate" else steps(model, int(req["n"])))
            except Exception as exc:  # a server that died mid-request: report it, keep serving
                answer({"error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str] | None = None) -> int:
    """Re-run inside an isolated namespace, or (inside) serve."""
    inside, argv = isolated_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a Llama folder Petals serves")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way latency on every link (a proxy per server)")
    p.add_argument("--push-fix", action="store_true", help="servers push to the next server (push_fix.py)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args(argv)
    args.model = args.model.expanduser().absolute()
    if not inside:
        return run_isolated(__file__, argv)
    bring_up_loopback()
    with tempfile.TemporaryDirectory(prefix="dsd-petals-run-") as tmp:
        try:
            serve(args, Path(tmp))
        except Exception as exc:  # the swarm never came up: one line saying why
            answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
