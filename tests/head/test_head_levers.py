"""Issue 57's levers on dsd's ahead-of-verdict work: a budget per trip, ready chains that give way to trees, a third
window only while bets win, and the fallback to sd while working ahead does not pay. Each changes when drafts are
made and sent, never which tokens are kept: greedy output equals the target's alone with every lever on."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
import trio
from support.models import hf_greedy, make_tiny_model, noisy_copy
from support.slow_local import SlowLocal
from transformers import AutoModelForCausalLM

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.drafting import Arrival, Drafting
from dsd.node.head.engine import HeadEngine
from dsd.node.head.fallback import AheadLedger
from dsd.node.head.outcomes import plan_branches
from dsd.node.head.report import TimeBreakdown
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.window import WindowController
from dsd.shard_store import Store

PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 3, 3, 8, 9, 10, 11, 12]]
LEVERS = {"budget": True, "ready_trees": True, "fallback": True, "pipeline": 3, "deep_min": 0.6}


def _reference(hf_dir, prompt: list[int], n: int) -> list[int]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval(), prompt, n)


def _run(store: Store, drafter, prompt: list[int], n: int, **cfg_kw):
    backend = SlowLocal(store.load_head(), [store.load_span(0, 2), store.load_span(2, 5)])
    cfg = GenerationConfig(mode="dsd", max_new_tokens=n, **cfg_kw)
    result = trio.run(HeadEngine(backend, drafter, cfg).run, prompt)
    return result, backend


class SlowBatches(ModelDrafter):
    """A drafter whose batched steps (several branches at once) are slow: a head for which drafting outcome
    branches costs more than a trip, so the step under way when a verdict lands delays it."""

    def step_many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[int | None, torch.Tensor | None]]:
        if len(contexts) > 1:
            time.sleep(0.4)
        return list(super().step_many(contexts))


# --- the fallback ledger ----------------------------------------------------------------------------------------


def test_the_ledger_falls_back_when_ahead_work_costs_more_than_sd_would_and_probes_again() -> None:
    ledger = AheadLedger(min_rounds=2, hold=3)
    ledger.observe(actual_s=5.0, draft_s=0.0, verify_s=0.0)
    assert ledger.ahead and ledger.clean_trip() is None  # no clean trip yet: nothing to weigh against
    for trip in (1.0, 1.2, 3.0, 1.1):
        ledger.observe_trip(trip)
    assert ledger.clean_trip() == 1.0  # the lower quartile: trips behind a stale window do not inflate sd's
    ledger.observe(actual_s=1.5, draft_s=0.2, verify_s=0.1)
    assert ledger.ahead  # one round is not enough
    ledger.observe(actual_s=1.5, draft_s=0.2, verify_s=0.1)  # 3.0 s against sd's 2.6 s
    assert not ledger.ahead and ledger.fallbacks == 1
    for _ in range(3):
        assert not ledger.ahead
        ledger.observe(actual_s=1.3, draft_s=0.2, verify_s=0.1)
    assert ledger.ahead  # the hold is over: dsd is probed again
    for _ in range(2):
        ledger.observe(actual_s=2.0, draft_s=0.2, verify_s=0.1)
    assert not ledger.ahead and ledger.fallbacks == 2
    held = 0
    while not ledger.ahead:
        ledger.observe(actual_s=1.3, draft_s=0.2, verify_s=0.1)
        held += 1
    assert held == 6  # a second fallback in a row holds twice as long


def test_the_ledger_stays_ahead_while_ahead_work_pays() -> None:
    ledger = AheadLedger(min_rounds=2, hold=3)
    ledger.observe_trip(1.0)
    for _ in range(10):
        ledger.observe(actual_s=0.6, draft_s=0.2, verify_s=0.1)  # a ready or pipelined round: faster than sd's 1.3
        assert ledger.ahead
    assert ledger.fallbacks == 0


def test_the_ledger_refuses_bad_numbers() -> None:
    ledger = AheadLedger()
    with pytest.raises(ValueError, match="trip"):
        ledger.observe_trip(float("nan"))
    with pytest.raises(ValueError, match="actual_s"):
        ledger.observe(actual_s=-1.0, draft_s=0.0, verify_s=0.0)
    with pytest.raises(ValueError):
        AheadLedger(hold=0)


# --- the controller's rules -----------------------------------------------------------------------------------


def _controller_with_rounds(points: list[tuple[int, float]]) -> WindowController:
    w = WindowController()
    for tokens, seconds in points:
        w.observe(gamma=tokens - 1, accepted=0, draft_s_per_token=0.01, round_s=seconds)
    return w


def test_a_bet_goes_ahead_only_where_its_chance_pays_for_the_route_time_a_loss_wastes() -> None:
    flat = _controller_with_rounds([(2, 1.0), (6, 1.0), (10, 1.0)])  # b = 0: a lost window costs the route nothing
    assert flat.ahead_pays(0.01, 8, saved_s=0.1)
    steep = _controller_with_rounds([(2, 1.2), (6, 1.6), (10, 2.0)])  # b = 0.1 s per token
    assert steep.ahead_pays(0.5, 8, saved_s=1.0)  # 0.5 · 1.0 ≥ 0.5 · 0.9
    assert not steep.ahead_pays(0.3, 8, saved_s=1.0)  # 0.3 · 1.0 < 0.7 · 0.9
    assert not steep.ahead_pays(0.9, 8, saved_s=-0.5)  # the verdict is due already: nothing to save
    assert steep.ahead_won is None
    for won in (True, False, False, False):
        steep.observe_ahead(won)
    assert steep.ahead_won == pytest.approx(0.8**3)  # an EWMA with the controller's decay


def test_a_ready_chain_gives_way_only_to_a_tree_that_beats_it_without_its_drafting() -> None:
    """The target often takes the draft's second choice: a tree beats a chain drafted after the trip, and beats
    even a chain already drafted when drafting is cheap against the trip; with slow drafting it does not."""
    def split(draft_s: float) -> WindowController:
        w = WindowController()
        for _ in range(12):
            w.observe(gamma=4, accepted=1, draft_s_per_token=draft_s, round_s=1.0, ranks=[1, 2])
        return w

    cheap, dear = split(0.001), split(0.5)
    assert cheap.plan_tree(4, cap=32, depth_cap=8, ready=True)[0] > 0
    assert dear.plan_tree(4, cap=32, depth_cap=8)[0] > 0
    assert dear.plan_tree(4, cap=32, depth_cap=8, ready=True) == (0, 0)


# --- drafting within a budget -----------------------------------------------------------------------------------


def test_predrafting_drops_the_branches_not_worth_their_rows_and_all_but_the_bet_past_the_verdict(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    drafter = ModelDrafter(noisy_copy(store.load_full(), 0.5), SamplingParams())
    prompt = PROMPTS[0]
    toks, probs = drafter.propose(prompt, 4)
    drafting = Drafting(drafter, GenerationConfig(), TimeBreakdown())

    async def predraft(worth, due):
        bets = drafting.bets(plan_branches(prompt, toks, list(probs), max_branches=4))
        await drafting.predraft(bets, 3, Arrival(), due, worth=worth)
        return bets

    bets = trio.run(predraft, lambda b, left: b.value > 0.2, None)
    drafted = {id(b) for b in bets.branches if b.tokens}
    assert any(b.main for b in bets.branches if id(b) in drafted)
    for b in bets.branches:
        if not b.main and b.value <= 0.2:
            assert id(b) not in drafted and bets.is_dead(b)
    drafting._steps.extend([(1, 0.01), (5, 0.05), (9, 0.09)])  # a batched step costs 10 ms a row
    bets = trio.run(predraft, lambda b, left: True, time.perf_counter() - 1.0)  # the verdict is due already
    assert [b.main for b in bets.branches if b.tokens] == [True]


# --- the engine, every lever ------------------------------------------------------------------------------------


def test_a_third_window_goes_out_only_while_bets_win(tiny_qwen2_root) -> None:
    store = Store(tiny_qwen2_root / "store")
    right = ModelDrafter(store.load_full(), SamplingParams())  # a self-draft: every bet wins
    result, backend = _run(store, right, PROMPTS[0], 40, gamma=4, tree_nodes=0, pipeline=3, deep_min=0.6)
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], 40)
    assert backend.most_in_flight == 3
    wrong = ModelDrafter(make_tiny_model("qwen2", seed=1234, layers=2), SamplingParams())
    result, backend = _run(store, wrong, PROMPTS[0], 24, gamma=4, tree_nodes=0, pipeline=3, deep_min=0.6,
                           ahead_min=0.0)
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[0], 24)
    assert result.pipelined_wasted > 0 and backend.most_in_flight == 2, result.as_dict()


def test_dsd_falls_back_to_sd_where_working_ahead_delays_the_verdicts(tiny_qwen2_root) -> None:
    """Batched branch steps longer than the trip hold every verdict back: the fallback rule sees dsd's rounds take
    longer than sd's would and decodes as sd; a draft whose bets win never falls back."""
    store = Store(tiny_qwen2_root / "store")
    slow = SlowBatches(make_tiny_model("qwen2", seed=1234, layers=2), SamplingParams())
    n = 28
    result, _ = _run(store, slow, PROMPTS[1], n, gamma=3, tree_nodes=0, fallback=True)
    assert result.tokens == _reference(tiny_qwen2_root / "hf", PROMPTS[1], n)
    assert result.fallback_rounds >= 4, result.as_dict()
    right = ModelDrafter(store.load_full(), SamplingParams())
    result, _ = _run(store, right, PROMPTS[1], 40, gamma=4, tree_nodes=0, fallback=True)
    assert result.fallback_rounds == 0 and result.pipelined_rounds > 0, result.as_dict()


@pytest.mark.parametrize("drafter_kind", ["self", "noisy", "random"])
def test_every_lever_on_keeps_greedy_output_exact(tiny_qwen2_root, drafter_kind: str) -> None:
    """Budget, ready trees (the controller's trees), fallback and a third window together, with drafts always,
    often or mostly wrong: the output is one-machine greedy's and every window sent was verified or dropped."""
    store = Store(tiny_qwen2_root / "store")
    full = store.load_full()
    model = {"self": full, "noisy": noisy_copy(full, 0.1),
             "random": make_tiny_model("qwen2", seed=1234, layers=2)}[drafter_kind]
    drafter = ModelDrafter(model, SamplingParams())
    n = 20 if drafter_kind == "random" else 32  # a random draft yields about a token a trip
    for prompt in PROMPTS:
        result, backend = _run(store, drafter, prompt, n, ahead_min=0.0, **LEVERS)
        assert result.tokens == _reference(tiny_qwen2_root / "hf", prompt, n), (drafter_kind, prompt)
        assert backend.sent == result.rounds + result.pipelined_wasted


def test_levers_are_named_on_the_command_line_and_unknown_ones_refused() -> None:
    from dsd.node.head.levers import lever_options

    assert lever_options(["none"]) == {}
    assert lever_options(["budget", "fallback"]) == {"budget": True, "fallback": True}
    assert lever_options(["all"]) == {"budget": True, "ready_trees": True, "pipeline": 3, "deep_min": 0.6,
                                      "fallback": True}
    assert lever_options(["deep"], pipeline=4)["pipeline"] == 4  # a deeper pipeline asked for is kept
    with pytest.raises(ValueError, match="unknown lever"):
        lever_options(["budget", "turbo"])
    GenerationConfig(**lever_options(["all"]))  # every lever's options are the engine's
