"""Window-size control: pick γ so drafting fills the round trip without exceeding it.

Model (per round, i.i.d. acceptance α per draft token, estimated online):

    E(γ)  = (1 − α^{γ+1}) / (1 − α)          expected tokens emitted per round
    T(γ)  = P·max(R(γ), (γ+1)·d) + (1 − P)·(R(γ) + γ·d)   (overlap=True: DSD drafts the next
                               window — γ tokens after a guessed root — for the likely outcomes while
                               this one flies; it is usable when the verdict matches a branch. P is
                               the measured share of ready windows (EWMA) once rounds have been
                               seen; before that, α^{γ+1}: only the full-acceptance guess counts)
          = R(γ) + γ·d         (overlap=False: draft-then-wait speculative decoding)
    R(γ)  = a + b·(γ+1)        round time of a window of γ+1 tokens: a = links, b = the peers'
                               per-token verification compute (large on CPUs, ~0 on GPUs)
    γ*    = argmax_{γ_min ≤ γ ≤ min(γ_max, γ_use)} E(γ) / T(γ)     (smallest γ on ties)
    γ_use = smallest γ with α^γ < θ            (deeper tokens are almost never reached)

Load (a route of block peers shared with other heads). Every result carries the route's load L: what one more
row of this generation costs the other sessions on its peers, in their tokens (each peer's share measured from its
own steps, `dsd.protocol.load`, summed over the hops), plus, on a serving head whose requests draft in joint
forwards, the head's own load (what one more drafted row costs its other requests, same rule). A drafted row is
worth its chance of acceptance minus that cost, so under load the controller maximizes

    net(γ) = (E(γ) − L·γ) / T(γ)          over γ_min ≤ γ, and over 0 ≤ γ once L ≥ α (then no drafted
                                           row is worth its cost: a window of no drafts is an `ar` step)

and a window is sent ahead on a bet won with probability p only if p·E(γ) ≥ (1 − p)·(γ + 1)·L (a lost bet's
rows were taken from the others for nothing). With L = 0 (no one else on the route's peers) both rules are the
ones above; as L grows towards α the windows narrow, bets stop, and at L ≥ α no drafts are sent: the swarm's
useful throughput in `dsd` stays at or above `ar`'s. Trees are planned with the same net gain.

a and b are a least-squares fit over the last rounds' (tokens, round time)
pairs (b clamped to [0, mean R / mean tokens]; b = 0 until the window sizes
seen vary), d = measured drafting time per token (EWMA); α = EWMA(accepted) / EWMA(trials), where a round with k accepted
out of γ counts k successes in k trials plus one failed trial if k < γ (the
truncated-geometric MLE); θ = `useful_threshold` (0.05). R should be the time
from sending a window to having its target logits (network + peers' compute).
Before any observation γ = `initial` (clamped into the bounds); a fixed
`gamma` overrides everything.

Token trees (`plan_tree`, used when the head drafts a window on the critical path:
in `sd`, and in `dsd` when no pre-drafted branch matched). A window may carry a
tree of n drafted nodes instead of a chain (EAGLE-2 expansion, `tree.py`). The head
measures r_k, the share of verified positions where the token the target emitted was
the draft's k-th most likely token (k ≤ K = `tree_ranks`; positions with a draft
distribution only: the accepted drafts and the correction; an EWMA per round with the
same decay). Under an i.i.d. model a node reached from the root by the draft's
choices of rank k1..kd is accepted with probability v = Π r_kj (Sequoia's positional
acceptance), so the best tree of n nodes holds the n largest such values (best-first,
depth ≤ depth_cap, only values ≥ θ), and

    E_tree(n) = 1 + Σ_{i ≤ n} v_i         expected tokens per round (the chain's E(γ) when
                                           only rank-1 nodes are used and r_1 = α)
    T_tree(n) = R(n) + D(n)·ℓ              R as above for a window of n + 1 tokens; D(n) = the
                                           depth of those nodes (batched draft layers); ℓ =
                                           measured seconds per draft layer (d until measured)
    n*        = argmax_{n ≤ cap} E_tree(n) / T_tree(n)

A tree of n* nodes and depth D(n*) is sent when its rate beats the chain's,
E(γ) / (R(γ) + γ·d) (both drafted after the trip), and its best shape is not a
chain (it holds a node of rank ≥ 2). The prior of r puts all its weight on rank 1
(α's prior) and on "beyond K", so trees appear only once the target has been seen
choosing one of the draft's alternatives; before any round, and with a fixed
`gamma`, windows are chains. A tree round updates α with its ranks (a success per
rank-1 position) and the round-time fit with its n + 1 tokens. With `ready_trees`
(dsd), a pre-drafted chain that matched the verdict is weighed the same way against a
tree drafted now, at E(γ) / R(γ): it costs no drafting, so a tree must gain more
tokens than its layers cost (where acceptance is low, it does).

Ahead-of-verdict levers (issue 57; `GenerationConfig.budget`, `deep_min`): a window sent
ahead on a bet won with probability p (the measured share of ahead windows used, once
seen) saves the seconds until the bet's verdict; lost, its γ + 1 rows cost the route
b·(γ + 1) seconds that the next window waits behind. It goes only if p·saved ≥
(1 − p)·b·(γ + 1) (`ahead_pays`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from dsd.protocol.deadlines import cost_line

__all__ = ["WindowController"]


class WindowController:
    """Adapts γ to measured acceptance and round time, bounded to [gamma_min, gamma_max]."""

    def __init__(
        self,
        gamma: int | None = None,
        gamma_min: int = 1,
        gamma_max: int = 16,
        initial: int = 4,
        *,
        overlap: bool = True,
        decay: float = 0.8,
        prior_alpha: float = 0.6,
        prior_weight: float = 4.0,
        useful_threshold: float = 0.05,
        tree_ranks: int = 4,
    ) -> None:
        if not (isinstance(gamma_min, int) and isinstance(gamma_max, int) and 1 <= gamma_min <= gamma_max):
            raise ValueError(f"need integers 1 <= gamma_min <= gamma_max, got {gamma_min!r}, {gamma_max!r}")
        if gamma is not None and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
            raise ValueError(f"fixed gamma must be an integer >= 1, got {gamma!r}")
        if not isinstance(initial, int) or isinstance(initial, bool) or initial < 1:
            raise ValueError(f"initial gamma must be an integer >= 1, got {initial!r}")
        if not (0.0 <= decay < 1.0):
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if not (0.0 <= prior_alpha <= 1.0) or prior_weight < 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight >= 0")
        if not (0.0 < useful_threshold < 1.0):
            raise ValueError(f"useful_threshold must be in (0, 1), got {useful_threshold!r}")
        if not isinstance(tree_ranks, int) or isinstance(tree_ranks, bool) or tree_ranks < 1:
            raise ValueError(f"tree_ranks must be an integer >= 1, got {tree_ranks!r}")
        self.fixed = gamma
        self.gamma_min = gamma_min
        self.gamma_max = gamma_max
        self.initial = min(max(initial, gamma_min), gamma_max)  # a default must not clash with bounds
        self.overlap = overlap
        self.decay = decay
        self.useful_threshold = useful_threshold
        self._succ = prior_alpha * prior_weight
        self._trials = prior_weight
        self._draft_s: float | None = None
        self._round_s: float | None = None
        self._rounds: deque[tuple[int, float]] = deque(maxlen=16)  # (window tokens, round seconds)
        self._ready: float | None = None  # EWMA of "the next window was pre-drafted" (dsd)
        self._won: float | None = None  # EWMA of "a window sent ahead on a bet was used" (dsd)
        # Weighted counts of the target's token being the draft's k-th choice: [beyond K, rank 1, .., rank K].
        self._ranks = [(1.0 - prior_alpha) * prior_weight, prior_alpha * prior_weight] + [0.0] * (tree_ranks - 1)
        self._layer_s: float | None = None  # seconds per batched draft layer of a tree (EWMA)
        self.load = 0.0  # the route's latest load L (see the module doc)

    @property
    def alpha(self) -> float:
        """Current estimate of the per-token acceptance probability."""
        if self._trials <= 0:
            return 0.0
        return min(1.0, max(0.0, self._succ / self._trials))

    @property
    def draft_s_per_token(self) -> float | None:
        """Smoothed drafting time per token (None before any observation)."""
        return self._draft_s

    @property
    def round_s(self) -> float | None:
        """Smoothed round time of a window (None before any observation)."""
        return self._round_s

    @staticmethod
    def expected_tokens(alpha: float, gamma: int) -> float:
        """E(γ) = (1 − α^{γ+1}) / (1 − α): expected tokens emitted by a window of γ drafts."""
        if alpha >= 1.0:
            return float(gamma + 1)
        return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)

    def observe(
        self, *, gamma: int, accepted: int, draft_s_per_token: float, round_s: float,
        ranks: Sequence[int | None] | None = None,
    ) -> None:
        """Record one verified chain window: γ drafted, `accepted` kept, the measured times and (optional)
        the ranks of the target's tokens in the draft's distributions (for `plan_tree`)."""
        if gamma < 0 or not 0 <= accepted <= gamma:
            raise ValueError(f"need 0 <= accepted <= gamma, got accepted={accepted}, gamma={gamma}")
        for name, v in (("draft_s_per_token", draft_s_per_token), ("round_s", round_s)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        self._check_ranks(ranks or ())
        trials = accepted + (1 if accepted < gamma else 0)
        self._succ = self.decay * self._succ + accepted
        self._trials = self.decay * self._trials + trials
        if gamma > 0:
            self._draft_s = self._smooth(self._draft_s, draft_s_per_token)
        self._observe_round(gamma + 1, round_s)
        if ranks:
            self._observe_ranks(ranks)

    def observe_tree(self, *, nodes: int, ranks: Sequence[int | None], layer_s: float, round_s: float) -> None:
        """Record one verified tree window of `nodes` drafted nodes: the ranks of the target's tokens at the
        walk's positions (None: beyond K), seconds per batched draft layer and the round time."""
        if nodes < 1:
            raise ValueError(f"a tree window holds at least one node, got {nodes}")
        for name, v in (("layer_s", layer_s), ("round_s", round_s)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        self._check_ranks(ranks)
        hits = sum(1 for r in ranks if r == 1)
        self._succ = self.decay * self._succ + hits
        self._trials = self.decay * self._trials + len(ranks)
        self._layer_s = self._smooth(self._layer_s, layer_s)
        self._observe_round(nodes + 1, round_s)
        if ranks:
            self._observe_ranks(ranks)

    def _smooth(self, old: float | None, x: float) -> float:
        """One EWMA step with the controller's decay (the first observation as it is)."""
        return x if old is None else self.decay * old + (1.0 - self.decay) * x

    def _observe_round(self, tokens: int, round_s: float) -> None:
        self._round_s = self._smooth(self._round_s, round_s)
        self._rounds.append((tokens, round_s))

    @staticmethod
    def _check_ranks(ranks: Sequence[int | None]) -> None:
        for r in ranks:
            if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
                raise ValueError(f"a rank is an integer >= 1 or None, got {r!r}")

    def _observe_ranks(self, ranks: Sequence[int | None]) -> None:
        """One round's ranks of the target's tokens in the draft's distributions (None: beyond K)."""
        k_max = len(self._ranks) - 1
        counts = [self.decay * c for c in self._ranks]
        for r in ranks:
            counts[r if r is not None and r <= k_max else 0] += 1.0
        self._ranks = counts

    @property
    def rank_probs(self) -> list[float]:
        """r_1..r_K: the smoothed share of positions where the target took the draft's k-th choice."""
        total = sum(self._ranks)
        return [c / total for c in self._ranks[1:]] if total > 0 else [0.0] * (len(self._ranks) - 1)

    def observe_ready(self, ready: bool) -> None:
        """Record whether the window after a trip was ready (a pre-drafted branch matched the verdict)."""
        self._ready = self._smooth(self._ready, 1.0 if ready else 0.0)

    def observe_ahead(self, won: bool) -> None:
        """Record whether a window sent ahead on a bet was used (the verdict matched it) or dropped."""
        self._won = self._smooth(self._won, 1.0 if won else 0.0)

    @property
    def ahead_won(self) -> float | None:
        """Smoothed share of windows sent ahead that were used (None before any was settled)."""
        return self._won

    def ahead_pays(self, p_win: float, gamma: int, saved_s: float) -> bool:
        """Whether a window of γ drafts sent ahead on a bet won with probability `p_win`, `saved_s` seconds before it
        could go otherwise, pays for the route's compute a lost bet wastes (and a later window then queues behind):
        p·saved ≥ (1 − p)·b·(γ + 1), b = the fitted per-token round time (`round_model`)."""
        p = min(max(p_win, 0.0), 1.0)
        _, b = self.round_model()
        return p * max(saved_s, 0.0) >= (1.0 - p) * b * (gamma + 1)

    @property
    def ready_share(self) -> float | None:
        """Smoothed share of ready windows (None before any observation)."""
        return self._ready

    def observe_load(self, load: float) -> None:
        """Record the load the route reported with its latest result (already averaged by its peers)."""
        if not math.isfinite(load) or load < 0:
            raise ValueError(f"load must be a finite number >= 0, got {load!r}")
        self.load = load

    def worth_ahead(self, p_win: float, gamma: int) -> bool:
        """Whether a window of γ drafts sent ahead on a bet won with probability `p_win` pays for its rows under
        the route's load: p·E(γ) ≥ (1 − p)·(γ + 1)·L (always true without load)."""
        if self.load <= 0:
            return True
        p = min(max(p_win, 0.0), 1.0)
        return p * self.expected_tokens(self.alpha, gamma) >= (1.0 - p) * (gamma + 1) * self.load

    def round_model(self) -> tuple[float, float]:
        """(a, b) of R(γ) = a + b·(γ+1), fitted on recent rounds; b = 0 while window sizes have not varied."""
        fit = cost_line((float(n), t) for n, t in self._rounds)
        return fit if fit is not None else (self._round_s or 0.0, 0.0)

    def expected_round_s(self, gamma: int) -> float | None:
        """R(γ): the expected trip of a window of γ drafts (None before any round was seen)."""
        if self._round_s is None:
            return None
        a, b = self.round_model()
        return a + b * (gamma + 1) if b > 0 else self._round_s

    def _round_time(self, gamma: int) -> float:
        r = self.expected_round_s(gamma) or 0.0
        d = self._draft_s or 0.0
        if not self.overlap:
            return r + gamma * d
        p_hidden = self._ready if self._ready is not None else self.alpha ** (gamma + 1)
        return p_hidden * max(r, (gamma + 1) * d) + (1.0 - p_hidden) * (r + gamma * d)

    def next_gamma(self) -> int:
        """γ for the next window (the fixed override if one was given)."""
        if self.fixed is not None:
            return self.fixed
        if self._round_s is None or self._draft_s is None:
            return self.initial
        alpha = self.alpha
        if alpha <= 0.0:
            return self.gamma_min
        if alpha >= 1.0:
            use_cap = self.gamma_max
        else:
            use_cap = math.ceil(math.log(self.useful_threshold) / math.log(alpha))
        hi = max(self.gamma_min, min(self.gamma_max, use_cap))
        lo = 0 if self.load >= alpha else self.gamma_min  # no drafted row is worth its cost: `ar`'s windows
        best_g, best_rate = lo, None
        for g in range(lo, hi + 1):
            t = self._round_time(g)
            net = self.expected_tokens(alpha, g) - self.load * g
            rate = net / t if t > 0 else net
            if best_rate is None or rate > best_rate + 1e-9 * abs(best_rate):
                best_g, best_rate = g, rate
        return best_g

    @staticmethod
    def tree_values(ranks: Sequence[float], nodes: int, depth: int, floor: float = 0.0) -> list[tuple[float, int, bool]]:
        """The `nodes` most valuable nodes of the static tree over rank probabilities r_1..r_K, best first:
        (value = Π r along the path, depth, True when every step is a rank-1 choice); values < floor are left out."""
        out: list[tuple[float, int, bool]] = []
        heap: list[tuple[float, int, int, bool]] = []  # (-value, depth, tie, chain)
        tie = 0

        def push(value: float, d: int, chain: bool) -> None:
            nonlocal tie
            for k, r in enumerate(ranks, start=1):
                v = value * r
                if v > 0.0 and v >= floor and d <= depth:
                    heapq.heappush(heap, (-v, d, tie, chain and k == 1))
                    tie += 1

        push(1.0, 1, True)
        while heap and len(out) < nodes:
            neg, d, _, chain = heapq.heappop(heap)
            out.append((-neg, d, chain))
            push(-neg, d + 1, chain)
        return out

    def plan_tree(self, gamma: int, *, cap: int, depth_cap: int, ready: bool = False) -> tuple[int, int]:
        """(nodes, depth) of the next window as a token tree, or (0, 0) to send a chain of γ drafts; `ready`: the
        chain is drafted already (a pre-drafted branch matched), so it costs no drafting and a tree must beat that."""
        if self.fixed is not None or cap < 2 or depth_cap < 1 or gamma < 1:
            return 0, 0
        if self._round_s is None or self._draft_s is None:
            return 0, 0
        d = self._draft_s
        layer = self._layer_s if self._layer_s is not None else d
        t_chain = (self.expected_round_s(gamma) or 0.0) + (0.0 if ready else gamma * d)
        chain_net = self.expected_tokens(self.alpha, gamma) - self.load * gamma
        chain_rate = chain_net / t_chain if t_chain > 0 else chain_net
        best, best_rate, gain, deepest, branched = (0, 0), chain_rate, 1.0, 0, False
        for n, (value, depth, chain) in enumerate(
            self.tree_values(self.rank_probs, cap, depth_cap, self.useful_threshold), start=1
        ):
            gain += value
            deepest = max(deepest, depth)
            branched = branched or not chain
            t = (self.expected_round_s(n) or 0.0) + deepest * layer
            net = gain - self.load * n
            rate = net / t if t > 0 else net
            if branched and rate > best_rate + 1e-9 * abs(best_rate):
                best, best_rate = (n, deepest), rate
        return best
