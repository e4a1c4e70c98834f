"""The head engine: one decoding loop for `ar`, `sd`, `dsd` and `dsd-adaptive` over any target backend.

The head keeps the committed tokens; the target's KV (on the peers) holds all of
them but the last. A window is `[last committed token, d1..dγ]`: the target
returns logits for γ+1 positions, the verifier keeps a prefix of the drafts and
adds one correction or bonus token. In `dsd` mode, while a window is in flight,
the head drafts the next window for each likely outcome of this one (full
acceptance with a guessed bonus token, and rejection at the positions where the
draft was least sure, rooted at its best alternative there: `outcomes.py`); all
branches advance in one batched draft step. If the verdict matches a branch, that
branch goes out as the next window at once ("a ready window").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from .adaptive import AdaptiveVerifier
from .modes import MODES
from .outcomes import Branch, bonus_alternatives, pick, plan_branches
from .report import GenerationResult, TimeBreakdown
from .sampling import SamplingParams
from .verify import Decoder, find_stop, verify_window
from .window import WindowController

log = logging.getLogger(__name__)

LOOKAHEAD = 3  # dsd: tokens pre-drafted per branch beyond the current window size



class TargetBackend(Protocol):
    """Where the target model runs: a route of block peers, or federated workers."""

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int) -> None: ...

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        """Target logits for the last `rows` positions of the submitted window, [rows, V].

        A backend with a true `returns_probs` attribute returns probabilities instead, already
        warped by whoever computed them (federated workers): see `HeadEngine`.
        """
        ...


class Drafter(Protocol):
    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor | None]: ...


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how."""

    mode: str = "dsd"
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    gamma: int | None = None  # fixed window size; None adapts
    gamma_max: int = 16
    tau_max: float = 0.3  # dsd-adaptive only; 0 is lossless
    seed: int = 0
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    result_timeout_s: float = 300.0
    branches: int = 8  # dsd: outcome branches pre-drafted besides full acceptance (0 = only that guess)
    alternatives: int = 2  # dsd: alternative tokens bet on per draft position

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.branches < 0 or self.alternatives < 1:
            raise ValueError("branches must be >= 0 and alternatives >= 1")


@dataclass
class _Draft:
    tokens: list[int]
    probs: list[torch.Tensor | None]

    def stacked_probs(self, skip: int = 0) -> torch.Tensor | None:
        rows = self.probs[skip:]
        if not rows or any(p is None for p in rows):
            return None
        return torch.stack([p for p in rows if p is not None])


@dataclass
class _Bets:
    """The branches pre-drafted during one trip and what drafting them cost (seconds per branch)."""

    branches: list[Branch]
    cost: dict[int, float]  # id(branch) -> hidden drafting seconds spent on it
    hidden: bool  # False when the verdict arrived before the first step finished


@dataclass
class _Tally:
    """Counters of one generation."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    per_round: list[int] = field(default_factory=list)
    windows_after_prefill: int = 0
    ready: int = 0
    branches: int = 0
    prefill_s: float = 0.0


class HeadEngine:
    """Runs one generation over a backend; the drafter is None for `ar`."""

    def __init__(
        self, backend: TargetBackend, drafter: Drafter | None, cfg: GenerationConfig, tokenizer: Decoder | None = None
    ) -> None:
        if cfg.mode != "ar" and drafter is None:
            raise ValueError(f"mode {cfg.mode} needs a drafter (a draft model store or 'ngram')")
        if cfg.stop_strings and tokenizer is None:
            raise ValueError("stop strings need the target's tokenizer")
        self.backend = backend
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.overlap = cfg.mode in ("dsd", "dsd-adaptive")
        # In dsd the drafting hides behind the trip (when a branch comes true); in sd it adds to it.
        self.window = WindowController(gamma=cfg.gamma, gamma_max=cfg.gamma_max, overlap=self.overlap)
        # A probability backend already applied the temperature: verify against log(p) at temperature 1,
        # where warp applies the user's top-k and then top-p to the aggregate; greedy = argmax of p.
        self.returns_probs = bool(getattr(backend, "returns_probs", False))
        self.verify_params = cfg.params
        if self.returns_probs and not cfg.params.greedy:
            self.verify_params = SamplingParams(temperature=1.0, top_k=cfg.params.top_k, top_p=cfg.params.top_p)
        self.adaptive = (
            AdaptiveVerifier(tau_max=cfg.tau_max, params=self.verify_params) if cfg.mode == "dsd-adaptive" else None
        )
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.times = TimeBreakdown()
        self._draft_token_s = 0.0
        self.progress: list[int] = []  # new tokens so far (kept when generation fails midway)

    # --- drafting ---------------------------------------------------------

    def _propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor | None]:
        assert self.drafter is not None
        return self.drafter.propose(context, gamma)

    def _step(self, contexts: list[list[int]]) -> list[tuple[int | None, torch.Tensor | None]]:
        """One draft token after each context: batched when the drafter can, else one call each."""
        assert self.drafter is not None
        step_many = getattr(self.drafter, "step_many", None)
        if step_many is not None:
            return list(step_many(contexts))
        out: list[tuple[int | None, torch.Tensor | None]] = []
        for ctx in contexts:
            toks, probs = self.drafter.propose(ctx, 1)
            out.append((toks[0], None if probs is None else probs[0]) if toks else (None, None))
        return out

    async def _draft(self, context: list[int], gamma: int) -> _Draft:
        """Draft `gamma` tokens after `context` on the critical path (after a trip, or in `sd`)."""
        t0 = time.perf_counter()
        toks, probs = await trio.to_thread.run_sync(self._propose, context, gamma)
        dt = time.perf_counter() - t0
        self.times.drafting += dt
        if toks:
            self._draft_token_s = dt / len(toks)
        return _Draft(list(toks), list(probs) if probs is not None else [None] * len(toks))

    async def _predraft(self, committed: list[int], drafts: _Draft, gamma: int, arrived: trio.Event,
                        due: float | None) -> _Bets:
        """While the window flies: advance every outcome branch one batched step at a time until the
        verdict arrives (the step under way is finished) or every branch holds `gamma` tokens.

        A batched step costs more than a single one, so when the steps still needed would run past
        the trip's expected end (`due`, a perf_counter time), the least likely half of the other
        branches is dropped: the main branch must be ready first."""
        branches = plan_branches(committed, drafts.tokens, drafts.probs, max_branches=self.cfg.branches,
                                 alternatives=self.cfg.alternatives)
        bets = _Bets(branches, {id(b): 0.0 for b in branches}, hidden=True)
        dead: set[int] = set()
        first = True
        while True:
            active = [b for b in branches if id(b) not in dead and (b.root is None or len(b.tokens) < gamma)]
            if not active or (arrived.is_set() and not first):
                break
            t0 = time.perf_counter()
            rows = await trio.to_thread.run_sync(self._step, [b.context for b in active])
            dt = time.perf_counter() - t0
            self.times.drafting += dt
            if arrived.is_set():
                bets.hidden = bets.hidden and not first
            if due is not None and len(active) > 1:
                left = max(gamma - len(b.tokens) + (b.root is None) for b in active) - 1
                if time.perf_counter() + left * dt > due:
                    others = sorted((b for b in active if not b.main), key=lambda b: b.value)
                    dead.update(id(b) for b in others[: max(1, len(others) // 2)])
            for b, (tok, q) in zip(active, rows, strict=True):
                bets.cost[id(b)] += dt / len(active)
                if tok is None:
                    dead.add(id(b))
                elif b.root is None:
                    b.root, b.value = tok, b.value * (float(q[tok]) if q is not None else 1.0)
                    if q is not None:
                        extra = bonus_alternatives(b, q, room=self.cfg.branches + 1 - len(branches),
                                                   alternatives=self.cfg.alternatives)
                        branches.extend(extra)
                        bets.cost.update({id(x): 0.0 for x in extra})
                else:
                    b.tokens.append(tok)
                    b.probs.append(q)
            self._draft_token_s = dt  # one batched step extends every branch by one token
            first = False
        return bets

    # --- the loop ---------------------------------------------------------

    async def generate(self, prompt: Sequence[int], on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate until EOS, a stop string or max_new_tokens; greedy output equals the target's alone."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        committed = list(prompt)
        self.progress = new = []
        t_start = time.perf_counter()
        tally = _Tally()
        epoch, start = 0, 0
        window, drafts = list(prompt), _Draft([], [])
        while True:
            await self.backend.submit(window, start=start, commit=start, epoch=epoch)
            logits, bets, round_s = await self._trip(committed, drafts, epoch, len(new))
            if start == 0:
                tally.prefill_s = round_s
            t_v = time.perf_counter()
            verdict_tokens, k = self._verify(logits, drafts)
            self.times.verifying += time.perf_counter() - t_v
            gamma = len(drafts.tokens)
            self._count(tally, gamma, k, round_s)
            emitted, finished = self._clip(verdict_tokens, new)
            new.extend(emitted)
            committed.extend(emitted)
            if on_tokens and emitted:
                on_tokens(emitted)
            if finished:
                break
            start = len(committed) - 1
            if gamma and k < gamma:
                epoch += 1
            drafts = await self._next_window(committed, k, bets, tally, len(new))
            window = [committed[-1], *drafts.tokens]
        return GenerationResult(
            mode=self.cfg.mode, tokens=new, elapsed_s=time.perf_counter() - t_start, rounds=tally.rounds,
            drafted=tally.drafted, accepted=tally.accepted, accepted_per_round=tally.per_round, times=self.times,
            prefill_s=tally.prefill_s, windows_after_prefill=tally.windows_after_prefill, ready_rounds=tally.ready,
            branches_drafted=tally.branches,
        )

    async def _trip(self, committed: list[int], drafts: _Draft, epoch: int, produced: int) -> tuple[torch.Tensor, _Bets | None, float]:
        """Wait for the window's target logits; in dsd, pre-draft the outcome branches meanwhile."""
        t_sent = time.perf_counter()
        rows = len(drafts.tokens) + 1
        gamma_next = self._next_gamma(produced + len(drafts.tokens) + 1)
        bets: _Bets | None = None
        if self.overlap and gamma_next > 0:
            arrived = trio.Event()
            box: list[torch.Tensor | Exception] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._collect_into, box, arrived, epoch, rows)
                expected = self.window.expected_round_s(len(drafts.tokens))
                due = None if expected is None else t_sent + expected
                # Draft a little past the current choice: the controller may pick a longer window once
                # this round is observed, and a branch shorter than that would cut the next window short.
                room = self.cfg.max_new_tokens - (produced + len(drafts.tokens) + 1)
                ahead = max(gamma_next, min(gamma_next + LOOKAHEAD, self.cfg.gamma_max, room))
                bets = await self._predraft(committed, drafts, ahead, arrived, due)
                t_wait = time.perf_counter()
                await arrived.wait()
                self.times.waiting += time.perf_counter() - t_wait
            if isinstance(box[0], Exception):
                raise box[0]
            logits = box[0]
        else:
            t_wait = time.perf_counter()
            logits = await self.backend.collect(epoch=epoch, rows=rows)
            self.times.waiting += time.perf_counter() - t_wait
        return logits, bets, time.perf_counter() - t_sent

    def _count(self, tally: _Tally, gamma: int, k: int, round_s: float) -> None:
        tally.rounds += 1
        if gamma:
            tally.drafted += gamma
            tally.accepted += k
            tally.per_round.append(k)
            self.window.observe(gamma=gamma, accepted=k, draft_s_per_token=self._draft_token_s or 1e-3, round_s=round_s)

    async def _next_window(self, committed: list[int], k: int, bets: _Bets | None, tally: _Tally, produced: int) -> _Draft:
        """The next window's drafts: the branch that bet on this outcome if one did, else drafted now."""
        gamma_next = self._next_gamma(produced + 1)
        tally.windows_after_prefill += 1
        drafts = _Draft([], [])
        chosen = pick(bets.branches, k, committed[-1]) if bets is not None else None
        if bets is not None:
            tally.branches += len(bets.branches)
            spent = sum(bets.cost.values())
            used = bets.cost[id(chosen)] if chosen is not None and bets.hidden else 0.0
            self.times.drafting_hidden_used += used
            self.times.drafting_hidden_wasted += spent - used if bets.hidden else 0.0
        if chosen is not None and gamma_next > 0:
            drafts = _Draft(chosen.tokens[:gamma_next], chosen.probs[:gamma_next])
            tally.ready += 1
        self.window.observe_ready(chosen is not None)
        if not drafts.tokens and gamma_next > 0:
            drafts = await self._draft(committed, gamma_next)
        settle = getattr(self.drafter, "settle", None)
        if settle is not None and bets is not None:
            settle(committed + drafts.tokens)  # drop the other branches from the draft's cache
        return drafts

    async def _collect_into(self, box: list, arrived: trio.Event, epoch: int, rows: int) -> None:
        """Collect the window's logits in a side task; a failure is handed back, not raised in the nursery."""
        try:
            box.append(await self.backend.collect(epoch=epoch, rows=rows))
        except Exception as exc:
            box.append(exc)
        finally:
            arrived.set()

    def _next_gamma(self, produced_after_window: int) -> int:
        """Window size for the next round, never drafting past max_new_tokens."""
        if self.cfg.mode == "ar":
            return 0
        room = self.cfg.max_new_tokens - produced_after_window
        return max(0, min(self.window.next_gamma(), room))

    def _verify(self, logits: torch.Tensor, drafts: _Draft) -> tuple[list[int], int]:
        if self.returns_probs:
            logits = torch.log(logits)
        tau = None
        q = drafts.stacked_probs()
        if self.adaptive is not None and drafts.tokens:
            tau = self.adaptive.taus(logits[: len(drafts.tokens)], q, drafts.tokens)
        verdict = verify_window(logits, drafts.tokens, q, self.verify_params, self.gen, tau)
        if self.adaptive is not None and drafts.tokens:
            self.adaptive.observe(logits, q, drafts.tokens, accepted=verdict.accepted)
        return list(verdict.tokens), verdict.accepted

    def _clip(self, tokens: list[int], new: list[int]) -> tuple[list[int], bool]:
        """Cut at the first EOS or stop string (kept, as the target alone would) and at max_new_tokens."""
        room = self.cfg.max_new_tokens - len(new)
        stop = find_stop(
            new + tokens, self.cfg.eos_ids, stop_strings=self.cfg.stop_strings, tokenizer=self.tokenizer, start=len(new)
        )
        keep = min(len(tokens), room) if stop is None else min(room, stop.length - len(new))
        return tokens[:keep], stop is not None or keep >= room
