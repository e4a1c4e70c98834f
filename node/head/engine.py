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
branch matched) may be a tree of drafts grown EAGLE-2 style (`tree.expand_tree`, the
frontier of each layer in one batched draft forward) and verified in one trip
(`tree_verify.verify_tree`, lossless at any temperature). On the wire the window is
`[last committed token, nodes...]` with the root as node 0 (parent −1) and tree node i
as node i + 1; the next window names the accepted path with `keep` (root first) after
`commit` = the tree's start, and every peer keeps just those KV rows. The controller
picks the node budget (`window.py`); `GenerationConfig.tree_nodes` overrides it. Trees
need a drafter with `dists_many` and a backend with a true `supports_trees`; otherwise
(n-gram drafting, federated workers) windows are chains, exactly as before. While a
tree is in flight, `dsd` pre-drafts chain branches for its likely outcomes (a leaf
fully accepted, or a rejection below a node, at the draft's best tokens outside its
children); a matched branch goes out as a chain window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import trio

from .adaptive import AdaptiveVerifier
from .modes import MODES
from .outcomes import Branch, bonus_alternatives, pick, plan_branches
from .report import GenerationResult, TimeBreakdown
from .sampling import SamplingParams
from .tree import MAX_POOL_NODES, MAX_TREE_NODES, DraftTree, expand_tree
from .tree_verify import verify_tree
from .verify import Decoder, find_stop, verify_window
from .window import WindowController

log = logging.getLogger(__name__)

LOOKAHEAD = 3  # dsd: tokens pre-drafted per branch beyond the current window size
TREE_CAP = MAX_TREE_NODES - 1  # drafted nodes a tree window may carry: the wire's limit minus the root
TREE_TOP_K = 4  # children per expanded node, and nodes expanded per layer (EAGLE-2's small-target setting)
TREE_DEPTH_CAP = (MAX_POOL_NODES - TREE_TOP_K) // (TREE_TOP_K * TREE_TOP_K) + 1  # deepest pool that fits


class TargetBackend(Protocol):
    """Where the target model runs: a route of block peers, or federated workers."""

    async def submit(
        self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        """Send a window at positions start.. after committing the last one: truncate to `commit`, or with
        `keep` (commit = that window's start) keep its accepted path. `parents` makes the window a tree.
        The engine passes `parents` and `keep` only to a backend with a true `supports_trees`."""
        ...

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        """Target logits for the last `rows` positions of the submitted window, [rows, V].

        A backend with a true `returns_probs` attribute returns probabilities instead, already
        warped by whoever computed them (federated workers): see `HeadEngine`.
        """
        ...


class Drafter(Protocol):
    def propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor | None]: ...


class TreeDrafter(Drafter, Protocol):
    """A drafter that can grow token trees: next-token distributions of many contexts in one forward."""

    def settle(self, context: Sequence[int]) -> None: ...

    def dists_many(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor: ...


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
    tree_nodes: int | None = None  # drafted nodes of a tree window: None = the controller decides, 0 = chains

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.branches < 0 or self.alternatives < 1:
            raise ValueError("branches must be >= 0 and alternatives >= 1")
        if self.tree_nodes is not None and (
            isinstance(self.tree_nodes, bool) or not isinstance(self.tree_nodes, int)
            or not 0 <= self.tree_nodes <= TREE_CAP
        ):
            raise ValueError(f"tree_nodes must be None (auto) or an integer in [0, {TREE_CAP}], got {self.tree_nodes!r}")

    @property
    def max_window_nodes(self) -> int:
        """The most drafted tokens one window may carry (a chain's γ_max or a tree's nodes): sizes a session."""
        return max(self.gamma_max, TREE_CAP if self.tree_nodes is None else self.tree_nodes)


@dataclass
class _Draft:
    """A window's drafts: a chain (`tree` None) or a token tree (tokens = tree.tokens, probs = its q rows)."""

    tokens: list[int]
    probs: list[torch.Tensor | None]
    tree: DraftTree | None = None

    def stacked_probs(self, skip: int = 0) -> torch.Tensor | None:
        rows = self.probs[skip:]
        if not rows or any(p is None for p in rows):
            return None
        return torch.stack([p for p in rows if p is not None])

    @property
    def depth(self) -> int:
        """Positions the window reaches past its root (a chain's γ, a tree's depth)."""
        return len(self.tokens) if self.tree is None else max(self.tree.depths(), default=0)

    @property
    def wire_parents(self) -> list[int] | None:
        """The window's parents on the wire (root = node 0, tree node i = node i + 1); None for a chain,
        and for a tree shaped like one (sent, and committed after, exactly as a chain)."""
        if self.tree is None or all(p == i - 1 for i, p in enumerate(self.tree.parents)):
            return None
        return [-1, *(p + 1 for p in self.tree.parents)]


@dataclass(frozen=True)
class _Outcome:
    """A verified window: the tokens to commit, drafts accepted, the accepted node path (a chain's is
    0..k−1) and whether the walk ended at a leaf (a bonus token: nothing was rejected)."""

    tokens: list[int]
    accepted: int
    path: list[int]
    full: bool


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
    depth: int = 0  # positions drafted per window, summed (a chain's γ, a tree's depth)
    tree_windows: int = 0  # windows sent as trees


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
        self._tree_layer_s = 0.0
        self.progress: list[int] = []  # new tokens so far (kept when generation fails midway)
        can_tree = hasattr(drafter, "dists_many") and hasattr(drafter, "settle") and bool(
            getattr(backend, "supports_trees", False)
        )
        if cfg.mode != "ar" and cfg.tree_nodes and not can_tree:
            raise ValueError(
                "tree windows need a draft model (not n-gram lookup) and a backend that runs trees "
                "(a route of block peers or the local model; federated workers take chains only)"
            )
        self.trees = cfg.mode != "ar" and cfg.tree_nodes != 0 and can_tree

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

    def _expand(self, context: list[int], nodes: int, depth: int) -> tuple[DraftTree, int]:
        """Grow a tree of at most `nodes` drafts after `context` (worker thread); returns it and the number
        of batched draft forwards it took."""
        drafter = cast(TreeDrafter, self.drafter)
        drafter.settle(context[:-1])  # as propose does: keep the cached prefix, feed the last token again
        root = drafter.dists_many([context])[0]
        layers = 1

        def step(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
            nonlocal layers
            layers += 1
            return drafter.dists_many([context + [tree.tokens[j] for j in tree.path(f)] for f in frontier])

        tree = expand_tree(root, step, budget=nodes, depth=min(depth, TREE_DEPTH_CAP), top_k=TREE_TOP_K, keep_q=True)
        return tree, layers

    async def _draft_tree(self, context: list[int], nodes: int, depth: int) -> _Draft:
        """Draft a token tree after `context` on the critical path."""
        t0 = time.perf_counter()
        tree, layers = await trio.to_thread.run_sync(self._expand, context, nodes, depth)
        dt = time.perf_counter() - t0
        self.times.drafting += dt
        self._tree_layer_s = dt / layers
        q = tree.q
        return _Draft(list(tree.tokens), [None if q is None else q[i] for i in range(len(tree))], tree)

    def _tree_plan(self, gamma: int, produced: int) -> tuple[int, int]:
        """(nodes, depth) of the next window drafted after a trip as a tree, (0, 0) for a chain of γ."""
        if not self.trees or gamma < 1:
            return 0, 0
        if self.cfg.tree_nodes:
            return self.cfg.tree_nodes, gamma
        room = self.cfg.max_new_tokens - produced
        return self.window.plan_tree(gamma, cap=TREE_CAP, depth_cap=min(self.cfg.gamma_max, room, TREE_DEPTH_CAP))

    def _branches(self, committed: list[int], drafts: _Draft) -> list[Branch]:
        """The outcome branches to pre-draft while this window flies."""
        if drafts.tree is None:
            return plan_branches(committed, drafts.tokens, drafts.probs, max_branches=self.cfg.branches,
                                 alternatives=self.cfg.alternatives)
        return tree_branches(committed, drafts.tree, max_branches=self.cfg.branches, alternatives=self.cfg.alternatives)

    async def _predraft(self, branches: list[Branch], gamma: int, arrived: trio.Event, due: float | None) -> _Bets:
        """While the window flies: advance every outcome branch one batched step at a time until the
        verdict arrives (the step under way is finished) or every branch holds `gamma` tokens.

        A batched step costs more than a single one, so when the steps still needed would run past
        the trip's expected end (`due`, a perf_counter time), the least likely half of the other
        branches is dropped: the main branch must be ready first."""
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
        epoch, start, commit = 0, 0, 0
        keep: list[int] | None = None
        window, drafts = list(prompt), _Draft([], [])
        while True:
            await self._submit(window, start, commit, epoch, drafts.wire_parents, keep)
            logits, bets, round_s = await self._trip(committed, drafts, epoch, len(new))
            if start == 0:
                tally.prefill_s = round_s
            t_v = time.perf_counter()
            outcome = self._verify(logits, drafts)
            self.times.verifying += time.perf_counter() - t_v
            self._count(tally, drafts, outcome, round_s)
            emitted, finished = self._clip(outcome.tokens, new)
            new.extend(emitted)
            committed.extend(emitted)
            if on_tokens and emitted:
                on_tokens(emitted)
            if finished:
                break
            if drafts.wire_parents is not None:  # keep the accepted path of the tree (root first)
                commit, keep = start, [0, *(i + 1 for i in outcome.path)]
            else:
                commit, keep = len(committed) - 1, None
            start = len(committed) - 1
            if drafts.tokens and not outcome.full:
                epoch += 1
            drafts = await self._next_window(committed, drafts, outcome, bets, tally, len(new))
            window = [committed[-1], *drafts.tokens]
        return GenerationResult(
            mode=self.cfg.mode, tokens=new, elapsed_s=time.perf_counter() - t_start, rounds=tally.rounds,
            drafted=tally.drafted, accepted=tally.accepted, accepted_per_round=tally.per_round, times=self.times,
            prefill_s=tally.prefill_s, windows_after_prefill=tally.windows_after_prefill, ready_rounds=tally.ready,
            branches_drafted=tally.branches, drafted_depth=tally.depth, tree_windows=tally.tree_windows,
        )

    async def _submit(self, window: list[int], start: int, commit: int, epoch: int, parents: list[int] | None,
                      keep: list[int] | None) -> None:
        """Send the window; a chain after a chain goes exactly as before trees existed (no tree arguments)."""
        tree: dict[str, list[int]] = {}
        if parents is not None:
            tree["parents"] = parents
        if keep is not None:
            tree["keep"] = keep
        await self.backend.submit(window, start=start, commit=commit, epoch=epoch, **tree)

    async def _trip(self, committed: list[int], drafts: _Draft, epoch: int, produced: int) -> tuple[torch.Tensor, _Bets | None, float]:
        """Wait for the window's target logits; in dsd, pre-draft the outcome branches meanwhile."""
        t_sent = time.perf_counter()
        rows = len(drafts.tokens) + 1
        gamma_next = self._next_gamma(produced + drafts.depth + 1)
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
                room = self.cfg.max_new_tokens - (produced + drafts.depth + 1)
                ahead = max(gamma_next, min(gamma_next + LOOKAHEAD, self.cfg.gamma_max, room))
                bets = await self._predraft(self._branches(committed, drafts), ahead, arrived, due)
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

    def _count(self, tally: _Tally, drafts: _Draft, outcome: _Outcome, round_s: float) -> None:
        tally.rounds += 1
        n, k = len(drafts.tokens), outcome.accepted
        if not n:
            return
        tally.drafted += n
        tally.accepted += k
        tally.per_round.append(k)
        tally.depth += drafts.depth
        ranks = _ranks(drafts, outcome) if self.trees else []
        if drafts.tree is None:
            self.window.observe(gamma=n, accepted=k, draft_s_per_token=self._draft_token_s or 1e-3, round_s=round_s,
                                ranks=ranks)
        else:
            tally.tree_windows += int(drafts.wire_parents is not None)
            self.window.observe_tree(nodes=n, ranks=ranks, layer_s=self._tree_layer_s, round_s=round_s)

    async def _next_window(self, committed: list[int], sent: _Draft, outcome: _Outcome, bets: _Bets | None,
                           tally: _Tally, produced: int) -> _Draft:
        """The next window's drafts: the branch that bet on this outcome if one did, else drafted now."""
        gamma_next = self._next_gamma(produced + 1)
        tally.windows_after_prefill += 1
        drafts = _Draft([], [])
        chosen = None
        if bets is not None:
            k = outcome.accepted
            chosen = pick(bets.branches, k, committed[-1]) if sent.tree is None else _pick_after_tree(bets.branches, k, committed)
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
            nodes, depth = self._tree_plan(gamma_next, produced + 1)
            if nodes:
                drafts = await self._draft_tree(committed, nodes, depth)
            else:
                drafts = await self._draft(committed, gamma_next)
        settle = getattr(self.drafter, "settle", None)
        if settle is not None and bets is not None and drafts.tree is None:
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

    def _verify(self, logits: torch.Tensor, drafts: _Draft) -> _Outcome:
        if self.returns_probs:
            logits = torch.log(logits)
        if drafts.tree is not None:
            return self._verify_tree(logits, drafts.tree)
        tau = None
        q = drafts.stacked_probs()
        if self.adaptive is not None and drafts.tokens:
            tau = self.adaptive.taus(logits[: len(drafts.tokens)], q, drafts.tokens)
        verdict = verify_window(logits, drafts.tokens, q, self.verify_params, self.gen, tau)
        if self.adaptive is not None and drafts.tokens:
            self.adaptive.observe(logits, q, drafts.tokens, accepted=verdict.accepted)
        k = verdict.accepted
        return _Outcome(list(verdict.tokens), k, list(range(k)), k == len(drafts.tokens))

    def _verify_tree(self, logits: torch.Tensor, tree: DraftTree) -> _Outcome:
        """Rule (c) on the tree's top-k children (greedy: follow the target's argmax); τ per node in
        dsd-adaptive, from the row that predicts the node."""
        tau = None
        if self.adaptive is not None:
            tau = self.adaptive.taus(logits[tree.predicting_rows()], tree.q, tree.tokens)
        verdict = verify_tree(logits, tree, self.verify_params, self.gen, tau)
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


def _rank(q: torch.Tensor | None, token: int) -> int | None:
    """1 + how many tokens the draft found likelier than `token` (None: no q, or q(token) = 0)."""
    if q is None:
        return None
    p = float(q[token])
    return 1 + int((q > p).sum()) if p > 0.0 else None


def _ranks(drafts: _Draft, outcome: _Outcome) -> list[int | None]:
    """Ranks of the tokens the target emitted in the draft distributions they were checked against: every
    accepted draft, and the correction (the bonus after a leaf had no draft distribution)."""
    if drafts.tree is None:
        tested = outcome.accepted + (0 if outcome.full else 1)
        return [_rank(drafts.probs[i], outcome.tokens[i]) for i in range(tested) if drafts.probs[i] is not None]
    tree = drafts.tree
    if tree.q is None:
        return []
    out = [_rank(tree.q[i], tree.tokens[i]) for i in outcome.path]
    if not outcome.full:
        kids = tree.children_of(outcome.path[-1] if outcome.path else -1)
        out.append(_rank(tree.q[kids[0]], outcome.tokens[-1]))
    return out


def _pick_after_tree(branches: Sequence[Branch], k: int, committed: list[int]) -> Branch | None:
    """The branch that bet on a tree's outcome: the same k accepted nodes (as tokens) and the same next token."""
    path = committed[len(committed) - 1 - k : -1]
    for b in branches:
        if b.tokens and b.k == k and b.root == committed[-1] and b.prefix[len(b.prefix) - k :] == path:
            return b
    return None


def tree_branches(committed: Sequence[int], tree: DraftTree, *, max_branches: int, alternatives: int = 2) -> list[Branch]:
    """Outcome branches of a tree window in flight, the likeliest first (at most max_branches + 1).

    A node's value is the product of the draft's probabilities along its path (≈ the chance it is
    accepted, EAGLE-2 §3.2). A leaf fully accepted is worth its value, with the bonus token guessed by
    the branch's first draft step (as the main branch of a chain); a rejection below a node with
    children is worth value · q(a) for the draft's best tokens a outside its children (children
    themselves are outcomes deeper in the tree). The likeliest outcome is the `main` branch.
    """
    committed = list(committed)
    q = tree.q
    if q is None:
        return []
    value: list[float] = []
    for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True)):
        value.append((1.0 if p < 0 else value[p]) * float(q[i][t]))
    bets: list[Branch] = []
    for node in range(-1, len(tree)):
        path = tree.path(node)
        prefix = committed + [tree.tokens[j] for j in path]
        v = 1.0 if node < 0 else value[node]
        kids = tree.children_of(node)
        if not kids:
            bets.append(Branch(prefix, len(path), None, v))
            continue
        taken = {tree.tokens[c] for c in kids}
        row = q[kids[0]]
        top = torch.topk(row, min(alternatives + len(kids), row.numel()))
        alts = [(p, t) for p, t in zip(top.values.tolist(), top.indices.tolist(), strict=True) if t not in taken and p > 0]
        bets.extend(Branch(list(prefix), len(path), int(t), v * p) for p, t in alts[:alternatives])
    bets.sort(key=lambda b: -b.value)
    bets = bets[: max(0, max_branches) + 1]
    if bets:
        bets[0].main = True
    return bets
