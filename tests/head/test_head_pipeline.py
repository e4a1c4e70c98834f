"""dsd's pipeline: while a window flies, the head sends the next one on its full-acceptance bet.

The backend here is the whole tiny model in-process with a fixed trip time (results are held
until `trip_s` after their window was sent), so windows really overlap. Greedy output must
equal HF greedy whatever the drafter proposes, and the target's KV must end holding exactly the
committed tokens: windows sent on an outcome that did not happen are dropped by epoch and
truncated away by the next window's commit (exactness would break otherwise).
"""

from __future__ import annotations

import time

import pytest
import torch
import trio
from support.models import hf_greedy, make_tiny_model, noisy_copy
from support.slow_local import TRIP_S, SlowLocal
from transformers import AutoModelForCausalLM

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams
from dsd.shard_store import Store

PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 3, 3, 8, 9, 10, 11, 12]]


def _reference(hf_dir, prompt: list[int], n: int) -> list[int]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval(), prompt, n)


def _run(store: Store, drafter, prompt: list[int], n: int, trip_s: float = TRIP_S, **cfg_kw):
    backend = SlowLocal(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)], trip_s=trip_s)
    cfg = GenerationConfig(mode="dsd", max_new_tokens=n, tree_nodes=0, **cfg_kw)
    result = trio.run(HeadEngine(backend, drafter, cfg).run, prompt)
    return result, backend


def test_self_draft_rides_the_pipeline(tiny_qwen2_root) -> None:
    """A draft equal to the target is always right: after the first verdicts every window goes out before
    the verdict it bets on, two are in flight, and the output is the target's."""
    store = Store(tiny_qwen2_root / "store")
    n = 40
    drafter = ModelDrafter(store.load_full(), SamplingParams())
    for prompt in PROMPTS:
        result, backend = _run(store, drafter, prompt, n, gamma=4)
        assert result.tokens == _reference(tiny_qwen2_root / "hf", prompt, n)
        assert backend.most_in_flight == 2
        assert result.pipelined_rounds >= result.windows_after_prefill - 2, result.as_dict()
        assert result.pipelined_wasted <= 1  # at most the window sent past the end


def test_pipeline_off_sends_one_window_at_a_time(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    drafter = ModelDrafter(store.load_full(), SamplingParams())
    result, backend = _run(store, drafter, PROMPTS[0], 24, gamma=4, pipeline=1)
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], 24)
    assert backend.most_in_flight == 1
    assert result.pipelined_rounds == result.pipelined_wasted == 0


@pytest.mark.parametrize("drafter_kind", ["noisy", "random"])
def test_wrong_bets_are_dropped_and_output_stays_exact(tiny_qwen2_root, drafter_kind: str) -> None:
    """Drafts that are often rejected: windows sent ahead are dropped (epoch) and truncated (commit);
    the output and the target's KV are exactly those of a one-machine greedy decode."""
    store = Store(tiny_qwen2_root / "store")
    n = 32
    model = noisy_copy(store.load_full(), 0.1) if drafter_kind == "noisy" else make_tiny_model("qwen2", seed=1234, layers=2)
    drafter = ModelDrafter(model, SamplingParams())
    for prompt in PROMPTS:
        result, backend = _run(store, drafter, prompt, n, gamma=4, pipeline=3, ahead_min=0.0)
        assert result.tokens == _reference(tiny_qwen2_root / "hf", prompt, n), (drafter_kind, prompt)
        assert result.pipelined_wasted > 0, result.as_dict()
        # Every window sent was either verified or counted as dropped.
        assert backend.sent == result.rounds + result.pipelined_wasted


def test_unlikely_bets_are_not_sent_ahead(tiny_qwen2_root) -> None:
    """A random draft is unsure of everything and soon measured as mostly wrong (its bet on full acceptance is
    rated far below `ahead_min` both ways), so no window goes ahead of a verdict after the first rounds:
    peers are not loaded with hopeless windows."""
    store = Store(tiny_qwen2_root / "store")
    drafter = ModelDrafter(make_tiny_model("qwen2", seed=1234, layers=2), SamplingParams())
    result, backend = _run(store, drafter, PROMPTS[0], 24, gamma=4, ahead_min=0.05)
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], 24)
    # Before the verdicts pull α down from its prior, a window or two may still go ahead.
    assert result.pipelined_wasted <= 3 and result.rounds >= 16, result.as_dict()


def test_pipeline_bounds() -> None:
    with pytest.raises(ValueError, match="pipeline"):
        GenerationConfig(pipeline=0)
    with pytest.raises(ValueError, match="pipeline"):
        GenerationConfig(pipeline=5)
    with pytest.raises(ValueError, match="ahead_min"):
        GenerationConfig(ahead_min=1.5)


class SlowDraft(ModelDrafter):
    """A drafter whose every step takes `STEP_S` more: a draft that is slow next to the trip, so the
    pre-drafting of a window runs until close to its verdict and the next window goes out just before it.
    Its steps and the trip are long next to the tiny model's compute, so a busy CPU does not change
    which windows go ahead."""

    STEP_S = 0.06
    TRIP_S = 1.0

    def propose(self, context, gamma):
        time.sleep(self.STEP_S * gamma)
        return super().propose(context, gamma)

    def step_many(self, contexts):
        time.sleep(self.STEP_S)
        return super().step_many(contexts)


def test_drafting_behind_trips_is_reported_hidden_in_the_pipeline(tiny_qwen2_root) -> None:
    """A draft equal to the target: every window after the first is ready and most go out ahead, so almost
    no drafting is on the critical path (at most the part of a step that a verdict overtakes). The bets of
    a window sent ahead are drafted over two trips; they must not be reported as exposed when a verdict
    lands during the first step of their second part."""
    store = Store(tiny_qwen2_root / "store")
    drafter = SlowDraft(store.load_full(), SamplingParams())
    for prompt in PROMPTS:
        result, _ = _run(store, drafter, prompt, 48, trip_s=SlowDraft.TRIP_S, gamma=6)
        t = result.times
        assert result.tokens == _reference(tiny_qwen2_root / "hf", prompt, 48)
        assert result.pipelined_rounds >= result.windows_after_prefill // 2, result.as_dict()
        assert t.drafting_exposed <= 0.2 * t.drafting, t.as_dict()
        assert t.drafting_hidden_used + t.drafting_hidden_wasted + t.drafting_exposed == pytest.approx(t.drafting)


class BatchCostDraft(ModelDrafter):
    """A drafter whose batched step costs `ROW_S` per context, as a CPU's does (pre-drafting nine outcome
    branches costs about nine single steps per token); counts the rows it drafts."""

    ROW_S = 0.01
    rows = 0

    def step_many(self, contexts):
        time.sleep(self.ROW_S * len(contexts))
        self.rows += len(contexts)
        return super().step_many(contexts)


class RowsAtSend(SlowLocal):
    """Records, for each window sent while another is in flight, the draft rows stepped since the pipeline last
    had room (the last send or verdict)."""

    def __init__(self, *args, drafter: BatchCostDraft, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafter = drafter
        self.ahead_rows: list[int] = []
        self._mark = 0

    async def submit(self, tokens, **kw) -> None:
        if self._due:
            self.ahead_rows.append(self.drafter.rows - self._mark)
        self._mark = self.drafter.rows
        await super().submit(tokens, **kw)

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        out = await super().collect(epoch=epoch, rows=rows)
        self._mark = self.drafter.rows
        return out


@pytest.mark.parametrize("alone", [True, False])
def test_the_full_acceptance_bet_goes_ahead_before_the_other_branches(tiny_qwen2_root, alone: bool) -> None:
    """With room in the pipeline the next window's bet is drafted alone and sent at once. During the prompt's
    trip the bets are full acceptance (its bonus guess, then γ tokens) and two other guesses of the bonus:
    alone, the window goes after the bet's γ + 1 single rows; `ahead_alone=False` waits for all three branches
    (1 + 3γ rows). The other branches are drafted after, while both windows fly."""
    store = Store(tiny_qwen2_root / "store")
    drafter = BatchCostDraft(store.load_full(), SamplingParams())
    gamma, n = 4, 24
    backend = RowsAtSend(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)], trip_s=1.5, drafter=drafter)
    cfg = GenerationConfig(mode="dsd", max_new_tokens=n, tree_nodes=0, gamma=gamma, gamma_max=gamma, branches=8,
                           ahead_alone=alone)
    result = trio.run(HeadEngine(backend, drafter, cfg).run, PROMPTS[0])
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], n)
    assert result.pipelined_rounds >= 2 and backend.ahead_rows, result.as_dict()
    assert backend.ahead_rows[0] == (gamma + 1 if alone else 1 + 3 * gamma), backend.ahead_rows
    assert len(result.ahead_gaps) == len(backend.ahead_rows) and min(result.ahead_gaps) > 0
    assert result.times.drafting_hidden_wasted > 0  # the other branches were still drafted (and lost here)


class LoadedLocal(SlowLocal):
    """SlowLocal whose results report a route load: 0 for the first `free` rounds, then `load`; counts the drafts
    sent in each phase."""

    def __init__(self, *args, free: int, load: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.free, self.busy_load = free, load
        self.collected = 0
        self.sent_while_loaded: list[int] = []  # window sizes sent once the load was reported

    async def submit(self, tokens, *, start, commit, epoch, parents=None, keep=None) -> None:
        if self.load > 0:
            self.sent_while_loaded.append(len(tokens))
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        out = await super().collect(epoch=epoch, rows=rows)
        self.collected += 1
        self.load = self.busy_load if self.collected >= self.free else 0.0
        return out


def test_a_loaded_route_gets_windows_without_drafts_and_no_bets_and_the_output_stays_exact(tiny_qwen2_root) -> None:
    """dsd over a route whose peers report a load above the drafts' worth (L = 1): after the report, windows carry
    no drafts and none goes ahead (the swarm gets `ar`'s rows); before it, drafts and bets as usual; greedy output
    equals the target's alone throughout."""
    store = Store(tiny_qwen2_root / "store")
    n = 32
    drafter = ModelDrafter(noisy_copy(store.load_full(), 0.05), SamplingParams())
    backend = LoadedLocal(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)], trip_s=0.1, free=6,
                          load=1.0)
    cfg = GenerationConfig(mode="dsd", max_new_tokens=n, tree_nodes=0)
    result = trio.run(HeadEngine(backend, drafter, cfg).run, PROMPTS[0])
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], n)
    assert result.drafted > 0 and result.pipelined_rounds + result.pipelined_wasted > 0, result.as_dict()
    loaded = backend.sent_while_loaded
    assert len(loaded) >= 10 and set(loaded[2:]) == {1}, loaded  # a window or two already drafted may still go
    assert result.as_dict()["route_load"] > 0.5


class SizesSent(SlowLocal):
    """SlowLocal keeping the size of every window sent."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sizes: list[int] = []

    async def submit(self, tokens, *, start, commit, epoch, parents=None, keep=None) -> None:
        self.sizes.append(len(tokens))
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)


class LoadedHead(ModelDrafter):
    """A drafter on a serving head whose own load is `load` (the head's CPU busy with others' tokens); keeps the
    tokens the engine tells it were emitted."""

    def __init__(self, *args, load: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_load = load
        self.told: list[int] = []

    @property
    def load(self) -> float:
        return self.head_load

    def emitted(self, tokens: int) -> None:
        self.told.append(tokens)


def test_the_heads_own_load_narrows_the_windows_as_a_routes_does_and_the_output_stays_exact(tiny_qwen2_root) -> None:
    """dsd on a head whose own draft forwards cost the others more than a drafted row is worth (head load 1): the
    windows carry no drafts once it is seen, on a route without load; every emitted token is told to the drafter
    (the rate the others' load is weighed by); greedy output equals the target's alone."""
    store = Store(tiny_qwen2_root / "store")
    n = 24
    drafter = LoadedHead(noisy_copy(store.load_full(), 0.05), SamplingParams(), load=1.0)
    backend = SizesSent(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)], trip_s=0.05)
    result = trio.run(HeadEngine(backend, drafter, GenerationConfig(mode="dsd", max_new_tokens=n, tree_nodes=0)).run,
                      PROMPTS[0])
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], n)
    assert sum(drafter.told) == n and all(t > 0 for t in drafter.told)
    report = result.as_dict()
    assert report["head_load"] == 1.0 and report["route_load"] == 0.0
    sizes = backend.sizes
    assert sizes[0] > 1 and len(sizes) >= n - 2 and set(sizes[2:]) == {1}, sizes  # then `ar`'s windows
