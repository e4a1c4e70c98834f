"""Outcome pre-drafting: while a window flies the head bets on its likely outcomes. When the target
rejects a draft at j and its correction is the draft's predicted alternative there, the pre-drafted
branch is the next window (no draft call after the trip); when the correction was not predicted, the
next window is drafted fresh. A scripted target and drafter make the outcome exact."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
import trio

from dsd.node.head.backend import TargetBackend
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafting import Arrival, Drafting
from dsd.node.head.engine import HeadEngine
from dsd.node.head.outcomes import Branch, bonus_alternatives, pick, plan_branches
from dsd.node.head.report import TimeBreakdown

V = 32
PROMPT = [1, 2, 3]
TRUTH = list(range(10, 30))  # the target's greedy next token after a context of length L is TRUTH[L]


def truth(length: int) -> int:
    return TRUTH[length - len(PROMPT)]


def q_row(top: int, second: int | None = None) -> torch.Tensor:
    row = torch.full((V,), 0.001)
    row[top] = 0.7
    if second is not None:
        row[second] = 0.25
    return row / row.sum()


class ScriptedTarget(TargetBackend):
    """Returns logits whose argmax after a context of length L is TRUTH[L]; the result lands after 50 ms."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.window: tuple[int, list[int]] = (0, [])

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int, **_: object) -> None:
        self.window = (start, list(tokens))

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        await trio.sleep(0.05)
        start, tokens = self.window
        out = torch.zeros(rows, V)
        for i in range(rows):
            length = start + len(tokens) - rows + i + 1  # context length the row predicts after
            out[i, truth(length)] = 10.0
        return out


class ScriptedDrafter:
    """Drafts the truth except after a context of length `wrong_at`, where it says 0 (top choice) with
    `second` as its runner-up; counts the calls made on the critical path (propose) and in trips."""

    def __init__(self, wrong_at: int, second: int | None) -> None:
        self.wrong_at, self.second = wrong_at, second
        self.propose_calls = 0
        self.step_calls = 0

    def _next(self, context: Sequence[int]) -> tuple[int, torch.Tensor]:
        n = len(context)
        if n == self.wrong_at:
            return 0, q_row(0, self.second)
        return truth(n), q_row(truth(n))

    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor]:
        self.propose_calls += 1
        ctx, toks, rows = list(context), [], []
        for _ in range(gamma):
            tok, q = self._next(ctx)
            toks.append(tok)
            rows.append(q)
            ctx.append(tok)
        return toks, torch.stack(rows)

    def step_many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[int, torch.Tensor]]:
        self.step_calls += 1
        return [self._next(c) for c in contexts]


def run(wrong_at: int, second: int | None) -> tuple[list[int], ScriptedDrafter, dict]:
    drafter = ScriptedDrafter(wrong_at, second)
    cfg = GenerationConfig(mode="dsd", max_new_tokens=12, gamma=4, tree_nodes=0)
    result = trio.run(HeadEngine(ScriptedTarget(), drafter, cfg).run, PROMPT)
    return result.tokens, drafter, result.as_dict()


def test_a_rejection_whose_correction_was_predicted_reuses_the_branch() -> None:
    # The window after the prompt drafts lengths 4..7; the draft is wrong after length 6 (j = 3 of 4)
    # and its runner-up there is the target's token: the alternative branch bet on exactly that.
    tokens, drafter, report = run(wrong_at=len(PROMPT) + 3, second=truth(len(PROMPT) + 3))
    assert tokens == TRUTH[:12]
    assert drafter.propose_calls == 0  # every window after a trip was ready: nothing drafted on the critical path
    assert report["ready_rounds"] == report["windows_after_prefill"] > 0
    assert report["accepted"] < report["drafted"]  # there was a rejection


def test_an_unpredicted_correction_is_drafted_after_the_trip() -> None:
    tokens, drafter, report = run(wrong_at=len(PROMPT) + 3, second=None)  # no runner-up: nothing bet on the truth
    assert tokens == TRUTH[:12]
    assert drafter.propose_calls >= 1
    assert report["ready_rounds"] < report["windows_after_prefill"]


class SlowSteps(ScriptedDrafter):
    """The scripted drafter with every batched step taking STEP_S of wall time (in the drafting thread)."""

    STEP_S = 0.08

    def step_many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[int, torch.Tensor]]:
        time.sleep(self.STEP_S)
        return super().step_many(contexts)


def test_bets_continued_past_a_verdict_count_as_hidden_but_for_the_overrun() -> None:
    """A window sent ahead has its bets drafted over two trips: during the trip before it, then on
    through its own. When a verdict lands during a step of the second call, the drafting done before
    it was still hidden behind the trips; only the part of that step after the verdict is not."""
    step = SlowSteps.STEP_S
    times = TimeBreakdown()
    drafting = Drafting(SlowSteps(wrong_at=-1, second=None), GenerationConfig(mode="dsd", gamma=4, tree_nodes=0), times)
    main = Branch(prefix=list(PROMPT), k=0, root=None, value=1.0, main=True)

    async def two_trips():
        bets = await drafting.predraft(drafting.bets([main]), 2, Arrival(), None)  # root + 2 tokens: 3 steps
        verdict = Arrival()

        async def arrive() -> None:
            await trio.sleep(step / 2)
            verdict.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(arrive)
            bets = await drafting.predraft(bets, 6, verdict, None)  # one step, overtaken
        return bets

    bets = trio.run(two_trips)
    assert main.tokens == [truth(len(PROMPT) + 1), truth(len(PROMPT) + 2), truth(len(PROMPT) + 3)]
    assert bets.spent == pytest.approx(times.drafting) and bets.spent >= 4 * step
    assert bets.late == pytest.approx(step / 2, abs=step / 4)  # the overtaken step's second half
    assert bets.hidden() == pytest.approx(bets.spent - bets.late)
    assert bets.hidden(main) == pytest.approx(bets.hidden() * bets.cost[id(main)] / bets.spent)


def test_plan_branches_orders_bets_by_probability_and_skips_the_drafted_token() -> None:
    committed, drafts = [1, 2], [5, 6]
    probs = [q_row(5, 7), q_row(6, 8)]
    main, *bets = plan_branches(committed, drafts, probs, max_branches=2, alternatives=1)
    assert main.main and main.prefix == committed + drafts and main.root is None
    assert [(b.k, b.root) for b in bets] == [(0, 7), (1, 8)]  # rejection at 1 is likelier than at 2
    assert bets[0].prefix == committed and bets[1].prefix == committed + [5]
    assert bets[0].value > bets[1].value
    assert all(b.root not in (5, 6) or b.k != i for i, b in enumerate(bets))
    main.root = 9
    extra = bonus_alternatives(main, q_row(9, 3), room=1, alternatives=2)
    assert [(b.k, b.root) for b in extra] == [(2, 3)]
    extra[0].tokens.append(4)
    assert pick([main, *bets, *extra], 2, 3) is extra[0]
    assert pick([main, *bets, *extra], 0, 7) is None  # a bet that holds no drafted token is not a window
