"""A failover in the middle of a joint batch: four concurrent greedy completions on one `dsd-node serve` head (head
batching on: their drafts and lm_head rows joined) run over the peer the planner prefers; it is SIGKILLed while all
four are open. Each request fails over to the other replica on its own and its text still equals HF greedy's for
its prompt; the joint calls keep serving the survivors (real daemons on loopback, tiny random Qwen2)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from support.models import hf_greedy
from support.processes import DaemonSwarm, cli_serve
from transformers import AutoModelForCausalLM

from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
N_NEW = 40
PROMPTS = [[1, 17, 42, 99, 5, 17, 42, 99], [1, 8, 9, 10, 11], [1, 30, 31, 17, 42, 99, 5, 32, 33, 34, 17, 42],
           [1, 77, 78, 79, 77, 78]]  # mixed lengths


def _expected(root: Path) -> list[str]:
    """HF greedy after each prompt, cut at its end of sequence as the service stops there."""
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    tokenizer = Store(root / "store").load_tokenizer()
    out = []
    for prompt in PROMPTS:
        tokens = hf_greedy(model, prompt, N_NEW)
        if 2 in tokens:  # the tiny models' eos id
            tokens = tokens[: tokens.index(2) + 1]
        out.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return out


def _active(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("dsd_serve_active_sessions "))


def test_a_peer_killed_under_a_joint_batch_fails_each_request_over_and_every_text_stays_exact(
    tiny_qwen2_root: Path, noisy_draft_store: Path, tmp_path: Path
) -> None:
    expected = _expected(tiny_qwen2_root)
    store = tiny_qwen2_root / "store"
    wan = ("--wan-latency-ms", "40")
    with DaemonSwarm(tmp_path / "net") as net:
        fast = net.peer("fast", store, "0:5", "--throughput", "2000", *wan)
        slow = net.peer("slow", store, "0:5", "--throughput", "20", *wan)
        net.wait_route(MODEL, 5)
        (tmp_path / "serve").mkdir()
        with cli_serve(tmp_path / "serve", net.bootstrap, store, "--head-batching", "on", "--draft", str(noisy_draft_store),
                       "--hole-wait-s", "10", *wan) as server:
            url = server["url"]

            def complete(prompt: list[int]) -> dict:
                r = httpx.post(url + "/v1/completions", timeout=180,
                               json={"model": MODEL, "prompt": prompt, "max_tokens": N_NEW, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(complete, p) for p in PROMPTS]
                deadline = time.monotonic() + 60
                while _active(url) < len(PROMPTS):
                    assert time.monotonic() < deadline and not any(f.done() for f in futures), "not all four open"
                    time.sleep(0.05)
                os.kill(fast["pid"], signal.SIGKILL)
                bodies = [f.result() for f in futures]
    texts = [b["choices"][0]["text"] for b in bodies]
    assert texts == expected
    stats = [b["dsd"] for b in bodies]
    assert all(s["failovers"] >= 1 for s in stats), stats  # each request was on the killed peer and moved
    assert all(s["route"] == [slow["peer_id"]] for s in stats), stats
    assert all(s["mean_accepted"] > 0 for s in stats), stats  # drafts (the draft model's, in joint forwards) were used
