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

Token trees: a window drafted on the critical path (in `sd`, and in `dsd` when no
branch matched) may be a tree of drafts grown EAGLE-2 style (`draft_tree.expand_tree`, the
frontier of each layer in one batched draft forward) and verified in one trip
(`tree_verify.verify_tree`, lossless at any temperature). On the wire the window is
`[last committed token, nodes...]` with the root as node 0 (parent −1) and tree node i
as node i + 1; the next window names the accepted path with `keep` (root first) after
`commit` = the tree's start, and every peer keeps just those KV rows. The controller
picks the node budget (`window.py`); `GenerationConfig.tree_nodes` overrides it. Trees
need a drafter with `dists_many` and a backend with a true `supports_trees` (a route of block
peers, federated workers, the local model); otherwise (n-gram drafting) windows are chains,
exactly as before. While a
tree is in flight, `dsd` pre-drafts chain branches for its likely outcomes (a leaf
fully accepted, or a rejection below a node, at the draft's best tokens outside its
children); a matched branch goes out as a chain window.

Sampling in `ar`, `sd` and `dsd` draws the token at every absolute position by Gumbel-max with noise keyed
by (seed, position), shared by drafter and verifier (`sampling.GumbelNoise`, docs/sampling.md): the text
depends on the prompt, the seed and the sampling settings only, not on drafts, windows or timing.
`dsd-adaptive` keeps the rejection-sampling rule its relaxation is defined on (its drafts use the noise).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import trio

from .adaptive import AdaptiveVerifier
from .backend import TargetBackend
from .config import (
    LOOKAHEAD,
    TREE_CAP,
    TREE_DEPTH_CAP,
    Drafter,
    GenerationConfig,
)
from .draft_tree import DraftTree
from .drafting import Arrival, Bets, Draft, Drafting
from .fallback import AheadLedger
from .logprobs import emitted_rows, token_logprobs
from .outcomes import (
    Branch,
    pick,
    pick_after_tree,
    plan_branches,
    tree_branches,
)
from .report import GenerationResult, TimeBreakdown
from .sampling import GumbelNoise, SamplingParams
from .tree_verify import verify_tree
from .verify import Decoder, find_stop, verify_window
from .window import WindowController

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Outcome:
    """A verified window: the tokens to commit, drafts accepted, the accepted node path (a chain's is
    0..k−1) and whether the walk ended at a leaf (a bonus token: nothing was rejected)."""

    tokens: list[int]
    accepted: int
    path: list[int]
    full: bool


@dataclass
class _Flight:
    """A window on the wire: its drafts, the tokens they follow (its root is `context[-1]`), its epoch,
    when it left, and the outcome branches pre-drafted for it (`bets_done`: not cut short)."""

    drafts: Draft
    context: list[int]
    epoch: int
    sent_at: float
    alone: bool = False  # sent with no other window in flight (its trip is what an sd window's would be)
    bets: Bets | None = None
    bets_done: bool = False


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
        caps = backend.capabilities
        # A probability backend already applied the temperature: verify against log(p) at temperature 1,
        # where warp applies the user's top-k and then top-p to the aggregate; greedy = argmax of p.
        self.returns_probs = caps.probs
        self.verify_params = cfg.params
        if self.returns_probs and not cfg.params.greedy:
            self.verify_params = SamplingParams(temperature=1.0, top_k=cfg.params.top_k, top_p=cfg.params.top_p)
        self.adaptive = (
            AdaptiveVerifier(tau_max=cfg.tau_max, params=self.verify_params) if cfg.mode == "dsd-adaptive" else None
        )
        self.gen = torch.Generator().manual_seed(cfg.seed)  # dsd-adaptive's rejection sampling
        self.noise = None if cfg.params.greedy else GumbelNoise(cfg.seed)
        self.coupled = None if self.adaptive is not None else self.noise  # the lossless modes' Gumbel-max rule
        use_noise = getattr(drafter, "use_noise", None)
        if self.noise is not None and use_noise is not None:
            use_noise(self.noise)  # drafts coupled with the target's draws, noise computed once for both
        self.times = TimeBreakdown()
        self.drafting = Drafting(drafter, cfg, self.times, self.coupled)
        self.result = GenerationResult(cfg.mode, times=self.times)  # kept up to date: a failure keeps what was made
        can_tree = hasattr(drafter, "dists_many") and hasattr(drafter, "settle") and caps.trees
        if cfg.mode != "ar" and cfg.tree_nodes and not can_tree:
            raise ValueError(
                "tree windows need a draft model (not n-gram lookup) and a backend that runs trees "
                "(a route of block peers, federated workers or the local model)"
            )
        self.trees = cfg.mode != "ar" and cfg.tree_nodes != 0 and can_tree
        # dsd: windows in flight at once; a backend that can hold more than one says so.
        self.pipeline = cfg.pipeline if self.overlap and caps.pipeline else 1
        self.ledger = AheadLedger() if self.overlap and cfg.fallback else None  # dsd's fallback to sd

    # --- drafting ---------------------------------------------------------

    def _tree_plan(self, gamma: int, produced: int, *, ready: bool = False) -> tuple[int, int]:
        """(nodes, depth) of the next window drafted after a trip as a tree, (0, 0) for a chain of γ (`ready`: a
        pre-drafted chain is at hand, so the tree must beat it without its drafting)."""
        if not self.trees or gamma < 1:
            return 0, 0
        if self.cfg.tree_nodes:
            return (0, 0) if ready else (self.cfg.tree_nodes, gamma)
        room = self.cfg.max_new_tokens - produced
        return self.window.plan_tree(gamma, cap=TREE_CAP, depth_cap=min(self.cfg.gamma_max, room, TREE_DEPTH_CAP),
                                     ready=ready)

    def _branches(self, committed: list[int], drafts: Draft) -> list[Branch]:
        """The outcome branches to pre-draft while this window flies."""
        if drafts.tree is None:
            return plan_branches(committed, drafts.tokens, drafts.probs, max_branches=self.cfg.branches,
                                 alternatives=self.cfg.alternatives)
        return tree_branches(committed, drafts.tree, max_branches=self.cfg.branches, alternatives=self.cfg.alternatives)

    # --- the loop ---------------------------------------------------------

    async def run(self, prompt: Sequence[int], on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate until EOS, a stop string or max_new_tokens; greedy output equals the target's alone.
        `self.result` holds the tokens and counters so far, also when the backend fails midway."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        committed = list(prompt)
        tally = self.result = GenerationResult(self.cfg.mode, times=self.times)
        new = tally.tokens
        t_start = time.perf_counter()
        try:
            await self._loop(committed, new, tally, on_tokens)
        finally:
            tally.elapsed_s = time.perf_counter() - t_start
        return tally

    async def _loop(self, committed: list[int], new: list[int], tally: GenerationResult,
                    on_tokens: Callable[[list[int]], None] | None) -> None:
        epoch = 0
        flights: deque[_Flight] = deque()
        await self._launch(flights, committed, Draft([], []), epoch, start=0, commit=0)
        last_verdict = 0.0
        while True:
            flight = flights.popleft()
            replays = self.backend.replays
            logits, round_s = await self._trip(flight, flights, len(new))
            if not tally.rounds:
                tally.prefill_s = round_s
            t_v = time.perf_counter()
            outcome = self._verify(logits, flight.drafts, start=len(flight.context))
            verdict = time.perf_counter()
            self.times.verifying += verdict - t_v
            if tally.rounds:
                self._weigh_ahead(tally, flight, round_s, verdict - last_verdict, verdict - t_v)
            last_verdict = verdict
            self._count(tally, flight.drafts, outcome, round_s)
            log.debug("verdict: epoch %d, %d of %d drafts accepted, round %.3f s, %d window(s) still out",
                      flight.epoch, outcome.accepted, len(flight.drafts.tokens), round_s, len(flights))
            emitted, finished = self._clip(outcome.tokens, new)
            if self.cfg.logprobs is not None:
                rows = emitted_rows(outcome.path, len(emitted))
                tally.logprobs += token_logprobs(logits, rows, emitted, self.cfg.logprobs, probs=self.returns_probs)
            new.extend(emitted)
            committed.extend(emitted)
            self._told_emitted(len(emitted))
            if on_tokens and emitted:
                on_tokens(emitted)
            if finished:
                tally.pipelined_wasted += len(flights)  # sent ahead past the end: never collected
                self._waste([flight, *flights])
                break
            if flights and committed == flights[0].context and self.backend.replays == replays:
                self._went_on(tally, flight)  # the window sent on this outcome is already on its way
                continue
            stale = len(flights)
            if stale:  # windows sent on an outcome that did not happen: their results will be skipped
                tally.pipelined_wasted += stale
                for _ in range(stale):
                    self.window.observe_ahead(False)
                self._waste(flights)
                flights.clear()
            if stale or (flight.drafts.tokens and not outcome.full):
                epoch += 1
            if flight.drafts.wire_parents is not None:  # keep the accepted path of the tree (root first)
                start = len(flight.context) - 1
                commit, keep = start, [0, *(i + 1 for i in outcome.path)]
            else:
                commit, keep = len(committed) - 1, None
            drafts = await self._next_window(committed, flight.drafts, outcome, flight.bets, tally, len(new))
            await self._launch(flights, committed, drafts, epoch, start=len(committed) - 1, commit=commit, keep=keep)

    async def _launch(self, flights: deque[_Flight], context: list[int], drafts: Draft, epoch: int, *, start: int,
                      commit: int, keep: list[int] | None = None) -> None:
        """Send the window `context[start:] + drafts` (its root is context[-1]) and queue it as in flight.

        A chain after a chain goes exactly as before trees existed (no tree arguments)."""
        tree: dict[str, list[int]] = {}
        if drafts.wire_parents is not None:
            tree["parents"] = drafts.wire_parents
        if keep is not None:
            tree["keep"] = keep
        await self.backend.submit(list(context[start:]) + drafts.tokens, start=start, commit=commit, epoch=epoch, **tree)
        flights.append(_Flight(drafts, list(context), epoch, time.perf_counter(), alone=not flights))
        log.debug("sent: epoch %d, %d tokens (%d drafts) at position %d, %d window(s) out",
                  epoch, len(context) - start + len(drafts.tokens), len(drafts.tokens), start, len(flights))

    async def _trip(self, flight: _Flight, later: deque[_Flight], produced: int) -> tuple[torch.Tensor, float]:
        """Wait for the window's target logits (the round's seconds since it was sent); in dsd, pre-draft
        the outcome branches meanwhile and send the next window ahead when the pipeline has room."""
        rows = len(flight.drafts.tokens) + 1
        if self.overlap and self._ahead:
            arrived = Arrival()
            box: list[torch.Tensor | Exception] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._collect_into, box, arrived, flight.epoch, rows)
                await self._fly(flight, later, produced, arrived)
                t_wait = time.perf_counter()
                await arrived.wait()
                self.times.waiting += time.perf_counter() - t_wait
            if isinstance(box[0], Exception):
                raise box[0]
            logits = box[0]
        else:
            t_wait = time.perf_counter()
            logits = await self.backend.collect(epoch=flight.epoch, rows=rows)
            self.times.waiting += time.perf_counter() - t_wait
        return logits, time.perf_counter() - flight.sent_at

    async def _fly(self, flight: _Flight, later: deque[_Flight], produced: int, arrived: Arrival) -> None:
        """Draft while `flight` is out, until its verdict. With room in the pipeline, the newest window's
        full-acceptance bet is drafted alone and sent as the next window first (the other branches would
        delay it by a batched step each; `ahead_alone` off: it goes once they are drafted); then the
        outcome branches of every window in flight, the earliest verdict's first."""
        while not arrived.is_set():
            tail = later[-1] if later else flight
            gamma_next = self._next_gamma(self._after(flight, tail, produced))
            if gamma_next <= 0:
                return
            tail_bets = self._bets_of(tail)
            main = tail_bets.main
            if 1 + len(later) < self._depth and tail.drafts.tree is None and main is not None \
                    and (self.cfg.ahead_alone or tail.bets_done) and self._worth_sending(tail, main, gamma_next):
                if self.cfg.ahead_alone and len(main.tokens) < gamma_next and not tail_bets.is_dead(main):
                    await self.drafting.predraft(tail_bets, gamma_next, arrived, None, main_only=True)
                    continue
                if main.tokens:
                    assert main.root is not None
                    context = main.prefix + [main.root]
                    drafts = Draft(main.tokens[:gamma_next], main.probs[:gamma_next])
                    self.result.ahead_gaps.append(time.perf_counter() - tail.sent_at)
                    await self._launch(later, context, drafts, tail.epoch, start=len(context) - 1,
                                       commit=len(context) - 1)
                    continue
            pending = next((f for f in (flight, *later) if not f.bets_done), None)
            if pending is None:
                return
            after = self._after(flight, pending, produced)
            gamma_pending = self._next_gamma(after)
            if gamma_pending <= 0:
                pending.bets_done = True
                continue
            bets = self._bets_of(pending)
            expected = self.window.expected_round_s(len(pending.drafts.tokens))
            due = None if expected is None else pending.sent_at + expected
            # Draft a little past the current choice: the controller may pick a longer window once
            # this round is observed, and a branch shorter than that would cut the next window short.
            room = self.cfg.max_new_tokens - after
            ahead = max(gamma_pending, min(gamma_pending + LOOKAHEAD, self.cfg.gamma_max, room))
            worth = self._branch_worth(gamma_pending) if self.cfg.budget else None
            await self.drafting.predraft(bets, ahead, arrived, due, worth=worth)
            pending.bets_done = not arrived.is_set()

    def _bets_of(self, window: _Flight) -> Bets:
        """The outcome bets of a window in flight, planned on first use."""
        if window.bets is None:
            window.bets = self.drafting.bets(self._branches(window.context, window.drafts))
        return window.bets

    @staticmethod
    def _after(flight: _Flight, window: _Flight, produced: int) -> int:
        """Tokens produced once `window`'s outcome is in, if every window before it is wholly accepted."""
        return produced + len(window.context) - len(flight.context) + window.drafts.depth + 1

    def _worth_sending(self, tail: _Flight, main: Branch, gamma: int) -> bool:
        """A window goes ahead only if its bet is likely (as the draft rates it, or as the measured acceptance does)
        and, on a loaded route, pays for the rows it takes from the others (`WindowController.worth_ahead`). With
        `budget`, the chance is the measured share of bets won once some were settled, and the bet must pay for
        the route's time a lost one wastes (`WindowController.ahead_pays`)."""
        p_win = max(main.value, self.window.alpha ** (len(tail.drafts.tokens) + 1))
        if not (p_win >= self.cfg.ahead_min and self.window.worth_ahead(p_win, gamma)):
            return False
        if not self.cfg.budget:
            return True
        won = self.window.ahead_won
        expected = self.window.expected_round_s(len(tail.drafts.tokens))
        if expected is None:
            return True
        saved = tail.sent_at + expected - time.perf_counter()
        return self.window.ahead_pays(p_win if won is None else won, gamma, saved)

    def _branch_worth(self, gamma: int) -> Callable[[Branch, int], bool]:
        """With `budget`: whether an outcome branch still needing `left` tokens is worth its batched rows. Used, it
        spares drafting γ tokens after the verdict (γ·d, d = a single step's seconds per token); each row it
        adds costs the head's batched steps `m` seconds (their fitted marginal row cost)."""
        saved = gamma * self.drafting.single_token_s
        fit = self.drafting.step_cost()

        def worth(branch: Branch, left: int) -> bool:
            return fit is None or branch.value * saved >= fit[1] * left

        return worth

    @property
    def _ahead(self) -> bool:
        """Whether this round works ahead of its verdict (dsd), not after it as sd does (the fallback rule)."""
        return self.ledger is None or self.ledger.ahead

    @property
    def _depth(self) -> int:
        """Windows in flight at once now: the pipeline, but beyond two only while bets win often (`deep_min`)."""
        if self.pipeline <= 2 or self.cfg.deep_min <= 0:
            return self.pipeline
        won = self.window.ahead_won
        return self.pipeline if won is not None and won >= self.cfg.deep_min else 2

    def _weigh_ahead(self, tally: GenerationResult, flight: _Flight, round_s: float, actual_s: float,
                     verify_s: float) -> None:
        """The fallback rule's round (`fallback.py`): this verdict took `actual_s` since the last; sd would have
        spent a clean trip, the window's drafting after the verdict and the same verifying."""
        ledger = self.ledger
        if ledger is None:
            return
        if flight.alone:
            ledger.observe_trip(round_s)
        drafts = flight.drafts
        if drafts.tree is not None and self.drafting.tree_layer_s > 0:
            draft_s = drafts.depth * self.drafting.tree_layer_s
        else:
            draft_s = len(drafts.tokens) * self.drafting.single_token_s
        was_ahead = ledger.ahead
        ledger.observe(actual_s=actual_s, draft_s=draft_s, verify_s=verify_s)
        if not ledger.ahead:
            tally.fallback_rounds += 1
        if ledger.ahead != was_ahead:
            log.info("dsd %s: %s", "falls back to sd" if was_ahead else "probes again",
                     "work ahead of the verdicts cost more than it saved" if was_ahead else "after its hold")
        self.window.overlap = ledger.ahead

    def _went_on(self, tally: GenerationResult, flight: _Flight) -> None:
        """The outcome matched the window sent ahead of it: count a ready round and the drafting it used."""
        tally.windows_after_prefill += 1
        tally.ready_rounds += 1
        tally.pipelined_rounds += 1
        self.window.observe_ahead(True)
        bets = flight.bets
        if bets is not None:
            tally.branches_drafted += len(bets.branches)
            self._account(bets, bets.main)
        self.window.observe_ready(True)

    def _account(self, bets: Bets, chosen: Branch | None) -> None:
        """Hidden drafting of one trip: the chosen branch's share was used, the rest wasted."""
        used = bets.hidden(chosen) if chosen is not None else 0.0
        self.times.drafting_hidden_used += used
        self.times.drafting_hidden_wasted += bets.hidden() - used

    def _waste(self, flights: Sequence[_Flight]) -> None:
        """Windows whose outcomes will never be used (a lost bet, the end): their hidden drafting was wasted."""
        for f in flights:
            if f.bets is not None:
                self._account(f.bets, None)

    def _count(self, tally: GenerationResult, drafts: Draft, outcome: _Outcome, round_s: float) -> None:
        tally.rounds += 1
        head = float(getattr(self.drafter, "load", 0.0) or 0.0)  # a serving head's own load (head batching)
        self.window.observe_load(self.backend.load + head)  # a drafted row costs the route's peers and the head
        tally.route_loads.append(self.backend.load)
        tally.head_loads.append(head)
        n, k = len(drafts.tokens), outcome.accepted
        if not n:
            return
        tally.drafted += n
        tally.accepted += k
        tally.accepted_per_round.append(k)
        tally.drafted_depth += drafts.depth
        ranks = drafts.ranks(outcome.tokens, outcome.path, outcome.full) if self.trees else []
        if drafts.tree is None:
            self.window.observe(gamma=n, accepted=k, draft_s_per_token=self.drafting.draft_token_s or 1e-3, round_s=round_s,
                                ranks=ranks)
        else:
            tally.tree_windows += int(drafts.wire_parents is not None)
            self.window.observe_tree(nodes=n, ranks=ranks, layer_s=self.drafting.tree_layer_s, round_s=round_s)

    def _told_emitted(self, tokens: int) -> None:
        """Tell a shared draft tree this generation's emitted tokens (the rate its head load weighs rows against)."""
        told = getattr(self.drafter, "emitted", None)
        if told is not None and tokens:
            told(tokens)

    async def _next_window(self, committed: list[int], sent: Draft, outcome: _Outcome, bets: Bets | None,
                           tally: GenerationResult, produced: int) -> Draft:
        """The next window's drafts: the branch that bet on this outcome if one did, else drafted now."""
        gamma_next = self._next_gamma(produced + 1)
        tally.windows_after_prefill += 1
        drafts = Draft([], [])
        chosen = None
        if bets is not None:
            k = outcome.accepted
            chosen = pick(bets.branches, k, committed[-1]) if sent.tree is None else pick_after_tree(bets.branches, k, committed)
            tally.branches_drafted += len(bets.branches)
        if chosen is not None and self.cfg.ready_trees and self._tree_plan(gamma_next, produced + 1, ready=True)[0]:
            chosen = None  # a tree drafted now pays more than the ready chain (low acceptance)
            tally.ready_given_up += 1
        if bets is not None:
            self._account(bets, chosen)
        if chosen is not None and gamma_next > 0:
            drafts = Draft(chosen.tokens[:gamma_next], chosen.probs[:gamma_next])
            tally.ready_rounds += 1
        self.window.observe_ready(chosen is not None)
        if not drafts.tokens and gamma_next > 0:
            nodes, depth = self._tree_plan(gamma_next, produced + 1)
            if nodes:
                drafts = await self.drafting.draft_tree(committed, nodes, depth)
            else:
                drafts = await self.drafting.draft(committed, gamma_next)
        settle = getattr(self.drafter, "settle", None)
        if settle is not None and bets is not None and drafts.tree is None:
            settle(committed + drafts.tokens)  # drop the other branches from the draft's cache
        return drafts

    async def _collect_into(self, box: list, arrived: Arrival, epoch: int, rows: int) -> None:
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

    def _verify(self, logits: torch.Tensor, drafts: Draft, start: int) -> _Outcome:
        """The verdict on a window whose row 0 predicts absolute position `start` (the root's length)."""
        if self.returns_probs:
            logits = torch.log(logits)
        if drafts.tree is not None:
            return self._verify_tree(logits, drafts.tree, start)
        tau = None
        q = drafts.stacked_probs()
        if self.adaptive is not None and drafts.tokens:
            tau = self.adaptive.taus(logits[: len(drafts.tokens)], q, drafts.tokens)
        verdict = verify_window(logits, drafts.tokens, q, self.verify_params, self.gen, tau, noise=self.coupled,
                                start=start)
        if self.adaptive is not None and drafts.tokens:
            self.adaptive.observe(logits, q, drafts.tokens, accepted=verdict.accepted)
        k = verdict.accepted
        return _Outcome(list(verdict.tokens), k, list(range(k)), k == len(drafts.tokens))

    def _verify_tree(self, logits: torch.Tensor, tree: DraftTree, start: int) -> _Outcome:
        """Follow the target's token (greedy: argmax; sampling: Gumbel-max); in dsd-adaptive rule (c) on the
        tree's top-k children with τ per node, from the row that predicts the node."""
        tau = None
        if self.adaptive is not None:
            tau = self.adaptive.taus(logits[tree.predicting_rows()], tree.q, tree.tokens)
        verdict = verify_tree(logits, tree, self.verify_params, self.gen, tau, noise=self.coupled, start=start)
        path = verdict.path
        kids = tree.children_of(path[-1] if path else -1)
        if self.adaptive is not None and tree.q is not None:
            # The walk as a chain: the accepted nodes, then the draft's first choice where it stopped.
            line = path + list(kids[:1])
            rows = logits[[tree.parents[i] + 1 for i in line]]
            self.adaptive.observe(rows, tree.q[line], [tree.tokens[i] for i in line], accepted=len(path))
        return _Outcome(list(verdict.tokens), verdict.accepted, list(path), not kids)

    def _clip(self, tokens: list[int], new: list[int]) -> tuple[list[int], bool]:
        """Cut at the first EOS or stop string (kept, as the target alone would) and at max_new_tokens."""
        room = self.cfg.max_new_tokens - len(new)
        stop = find_stop(
            new + tokens, self.cfg.eos_ids, stop_strings=self.cfg.stop_strings, tokenizer=self.tokenizer, start=len(new)
        )
        keep = min(len(tokens), room) if stop is None else min(room, stop.length - len(new))
        return tokens[:keep], stop is not None or keep >= room

