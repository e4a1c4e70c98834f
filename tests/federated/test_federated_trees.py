"""Token-tree windows with federated workers: the federated backend sends a tree window whole (parents) to
every worker, which answers top-K per node, and commits the accepted path with `keep`; the engine verifies
the aggregate's rows as a tree.

Over real worker daemons (two tiny Qwen2 models sharing a vocabulary, from conftest's `federated_net`): greedy
generation with a fixed node budget equals greedy decoding of the weighted average of the workers' full
distributions (K = V) in `sd` and `dsd`, and `dsd-node generate --federated --tree-nodes N` over the target
alone equals HF generate. In-process, sampling at T = 1 with tree windows over a probability backend (the
rows already warped, as federated workers send them) keeps the target's distribution (chi-square), and
reading those probabilities as logits fails the same test."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import trio
from support.federated import average_greedy, run_federated
from support.heads import ProbsBackend
from support.models import TINY_VOCAB, hf_greedy
from support.processes import cli
from support.sampling import (
    SAMPLING_ALPHA,
    SAMPLING_BROKEN_RUNS,
    SAMPLING_PROMPT,
    SAMPLING_RUNS,
    SAMPLING_TREE_NODES,
    T1,
    sampling_p_values,
)

from dsd.node.head.backend import Capabilities
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine

N_NEW = 16
PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 8, 9]]


@pytest.mark.network
@pytest.mark.parametrize("mode", ["sd", "dsd"])
def test_greedy_tree_windows_over_workers_equal_greedy_decoding_of_the_average(federated_net, federated_models, mode: str) -> None:
    weights = (0.7, 0.3)
    for prompt in PROMPTS:
        report = run_federated(federated_net, prompt, GenerationConfig(mode=mode, max_new_tokens=N_NEW, tree_nodes=10), top_k=TINY_VOCAB, weights=weights)
        assert report["tokens"] == average_greedy(federated_models, prompt, N_NEW, weights), (mode, prompt)
        assert report["tree_windows"] > 0 and report["mean_tree_nodes"] > report["mean_window_depth"]
        assert report["missed"] == 0 and report["dropped"] == 0
        for w in report["workers"]:
            assert w["state"] == "active" and w["windows_answered"] == report["windows"] == report["rounds"]


@pytest.mark.network
def test_cli_generate_federated_with_tree_nodes_equals_the_targets_greedy(federated_net, tiny_qwen2_dir: Path,
                                                                         tiny_qwen2_draft_store: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[0]
    out = cli("generate", "--federated", "--bootstrap", federated_net["bootstrap"], "--store", str(tiny_qwen2_draft_store),
              "--workers", federated_net["a"]["peer_id"], "--prompt-ids", ",".join(map(str, prompt)), "--mode", "dsd",
              "--max-new-tokens", str(N_NEW), "--tree-nodes", "8", "--json", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    target = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    assert report["tokens"] == hf_greedy(target, prompt, N_NEW)
    assert report["tree_windows"] > 0 and report["workers"][0]["k"] == 64  # the default K: argmax is exact


class ProbsAsLogits(ProbsBackend):
    """A broken probability backend: it does not say its rows are probabilities, so they are read as logits."""

    capabilities = Capabilities(trees=True, pipeline=True)  # probs left out


def first_pairs(models, backend_type: type[ProbsBackend], runs: int) -> list[tuple[int, int]]:
    """The first two tokens of `runs` tree `sd` generations at T = 1 over a probability backend."""
    head, span, draft, _ = models

    async def main() -> list[tuple[int, int]]:
        pairs = []
        for seed in range(runs):
            backend = backend_type(head, [span], 1.0)
            drafter = ModelDrafter(draft, T1)  # the engine hands it the generation's noise
            cfg = GenerationConfig(mode="sd", max_new_tokens=3, params=T1, gamma=1, seed=seed, tree_nodes=SAMPLING_TREE_NODES)
            result = await HeadEngine(backend, drafter, cfg).run(SAMPLING_PROMPT)
            assert result.tree_windows == 1  # the second window was a tree of the draft's top SAMPLING_TREE_NODES
            pairs.append((result.tokens[0], result.tokens[1]))
        return pairs

    return trio.run(main)


def test_tree_sampling_over_probabilities_follows_the_target(sampling_models) -> None:
    pairs = first_pairs(sampling_models, ProbsBackend, SAMPLING_RUNS)
    p_first, p_joint = sampling_p_values(sampling_models, pairs)
    print(f"\nprobability rows, tree sd: p(first) = {p_first:.3g}, p(first two) = {p_joint:.3g}; "
          f"{len(Counter(pairs))} distinct pairs")
    assert p_first > SAMPLING_ALPHA and p_joint > SAMPLING_ALPHA
    broken = first_pairs(sampling_models, ProbsAsLogits, SAMPLING_BROKEN_RUNS)
    p_first, p_joint = sampling_p_values(sampling_models, broken)
    print(f"probabilities read as logits: p(first) = {p_first:.3g}, p(first two) = {p_joint:.3g}")
    assert p_first < SAMPLING_ALPHA and p_joint < SAMPLING_ALPHA
