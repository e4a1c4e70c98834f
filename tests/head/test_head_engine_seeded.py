"""A seed fixes the sampled text: with temperature > 0 the engine's tokens equal, token for token, the target alone
drawing argmax(log warp(logits) + G_pos) at every position (transformers' whole model, G keyed by (seed, pos)),
in `ar`, `sd` and `dsd`, with chains and token trees, windows sent ahead over a slow backend or not, whatever
the drafter (the target itself, a noisy copy of it, an unrelated random model, n-gram lookup). Another seed,
other text."""

from __future__ import annotations

from collections import deque

import pytest
import torch
import trio
from support.models import make_tiny_model

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter, NgramDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.report import GenerationResult
from dsd.node.head.sampling import SamplingParams, gumbel, warp
from dsd.shard_store import Store

PROMPT = [1, 17, 42, 99, 5, 17, 42]
N = 20
SEED = 1234
TRIP_S = 0.02


class SlowLocal(LocalBackend):
    """The local model whose results land `trip_s` after their window was sent: windows overlap (dsd sends
    the next one on its full-acceptance bet) and branches are pre-drafted during the trip."""

    def __init__(self, *args, trip_s: float) -> None:
        super().__init__(*args)
        self.trip_s = trip_s
        self._due: deque[tuple[int, float]] = deque()

    async def submit(self, tokens, *, start, commit, epoch, parents=None, keep=None) -> None:
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)
        self._due.append((epoch, trio.current_time() + self.trip_s))

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        while self._due and self._due[0][0] < epoch:
            self._due.popleft()
        await trio.sleep_until(self._due.popleft()[1])
        return await super().collect(epoch=epoch, rows=rows)


def reference(model: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams, seed: int) -> list[int]:
    """The target alone, one token at a time: the Gumbel-max draw from warp(logits) with the noise of each position."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            seq.append(int(torch.argmax(torch.log(warp(logits, params)) + gumbel(seed, len(seq), logits.numel()))))
    return seq[len(prompt):]


def run(store: Store, drafter, mode: str, params: SamplingParams, seed: int, *, tree_nodes: int | None,
        trip_s: float = 0.0) -> GenerationResult:
    spans = [store.load_span(0, 2), store.load_span(2, 5)]
    backend = SlowLocal(store.load_head(), spans, trip_s=trip_s) if trip_s else LocalBackend(store.load_head(), spans)
    cfg = GenerationConfig(mode=mode, max_new_tokens=N, params=params, seed=seed, tree_nodes=tree_nodes)
    return trio.run(HeadEngine(backend, drafter, cfg).run, PROMPT)


PARAMS = {"t0.8": SamplingParams(temperature=0.8), "top-p": SamplingParams(temperature=0.8, top_p=0.9)}


@pytest.mark.parametrize("drafter_kind", ["self", "noisy", "random", "ngram"])
@pytest.mark.parametrize("params_id", list(PARAMS))
def test_a_seed_gives_the_targets_own_draws_in_every_mode_with_any_drafter(
    tiny_qwen2_root, tiny_qwen2_hf, noisy_draft, drafter_kind: str, params_id: str
) -> None:
    params = PARAMS[params_id]
    store = Store(tiny_qwen2_root / "store")
    expected = reference(tiny_qwen2_hf, PROMPT, N, params, SEED)

    def drafter():
        if drafter_kind == "ngram":
            return NgramDrafter()
        models = {"self": tiny_qwen2_hf, "noisy": noisy_draft}
        return ModelDrafter(models.get(drafter_kind) or make_tiny_model("qwen2", seed=1234, layers=2), params)

    trees = drafter_kind != "ngram"  # n-gram lookup drafts chains only
    runs = {"ar": run(store, None, "ar", params, SEED, tree_nodes=0)}
    for mode in ("sd", "dsd"):
        runs[f"{mode} chains"] = run(store, drafter(), mode, params, SEED, tree_nodes=0)
        if trees:
            runs[f"{mode} trees"] = run(store, drafter(), mode, params, SEED, tree_nodes=12, trip_s=TRIP_S)
            runs[f"{mode} auto"] = run(store, drafter(), mode, params, SEED, tree_nodes=None)
    slow = 0.25 if drafter_kind == "self" else TRIP_S  # long enough for windows to go out ahead every time
    runs["dsd chains, slow trips"] = run(store, drafter(), "dsd", params, SEED, tree_nodes=0, trip_s=slow)
    for name, result in runs.items():
        assert result.tokens == expected, (name, drafter_kind, params_id)
    drafted = {name: (r.drafted, r.accepted, r.rounds, r.tree_windows, r.ready_rounds, r.pipelined_rounds)
               for name, r in runs.items()}
    print(f"\n{drafter_kind} {params_id} (drafted, accepted, rounds, trees, ready, pipelined): {drafted}")
    if drafter_kind in ("self", "noisy"):
        assert all(r.accepted > 0 for name, r in runs.items() if name != "ar")
    if trees:  # (a draft that is never wrong leaves dsd nothing to draft after a trip: its branches come true)
        assert runs["sd trees"].tree_windows > 0 and (runs["dsd trees"].tree_windows > 0 or drafter_kind == "self")
    if drafter_kind == "self":  # its drafts are the target's own draws: every one is kept, windows go out ahead
        assert all(r.acceptance_rate == 1.0 for name, r in runs.items() if "chains" in name)
        assert runs["dsd chains, slow trips"].pipelined_rounds > 0
    other = run(store, drafter(), "dsd", params, SEED + 1, tree_nodes=0)
    assert other.tokens == reference(tiny_qwen2_hf, PROMPT, N, params, SEED + 1) != expected
