"""The head engine: one decoding loop for `ar`, `sd`, `dsd` and `dsd-adaptive` over any target backend.

The head keeps the committed tokens; the target's KV (on the peers) holds all of
them but the last. A window is `[last committed token, d1..dγ]`: the target
returns logits for γ+1 positions, the verifier keeps a prefix of the drafts and
adds one correction or bonus token. In `dsd` mode the head drafts the next
window while the current one is in flight, assuming it will be fully accepted
(its first drafted token is a guess of the bonus token); if that guess holds,
the next window goes out the moment the result is verified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import trio

from .adaptive import AdaptiveVerifier
from .modes import MODES
from .sampling import SamplingParams
from .verify import Decoder, find_stop, verify_window
from .window import WindowController

log = logging.getLogger(__name__)



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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


@dataclass
class TimeBreakdown:
    """Where the head's wall time went, in seconds."""

    drafting: float = 0.0
    drafting_overlapped: float = 0.0
    waiting: float = 0.0
    verifying: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "drafting_s": round(self.drafting, 4),
            "drafting_overlapped_s": round(self.drafting_overlapped, 4),
            "waiting_s": round(self.waiting, 4),
            "verifying_s": round(self.verifying, 4),
            "overlap_share": round(self.drafting_overlapped / self.drafting, 4) if self.drafting > 0 else 0.0,
        }


@dataclass
class GenerationResult:
    """New tokens and the statistics `--json` reports."""

    mode: str
    tokens: list[int]
    elapsed_s: float
    rounds: int
    drafted: int
    accepted: int
    accepted_per_round: list[int]
    times: TimeBreakdown
    prefill_s: float = 0.0

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted_per_round)) if self.accepted_per_round else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        n = len(self.tokens)
        return {
            "mode": self.mode,
            "tokens": self.tokens,
            "new_tokens": n,
            "elapsed_s": round(self.elapsed_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "tokens_per_s": round(n / self.elapsed_s, 4) if self.elapsed_s > 0 else 0.0,
            "rounds": self.rounds,
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "time_breakdown": self.times.as_dict(),
        }


@dataclass
class _Draft:
    tokens: list[int]
    probs: list[torch.Tensor | None]

    def stacked_probs(self, skip: int = 0) -> torch.Tensor | None:
        rows = self.probs[skip:]
        if not rows or any(p is None for p in rows):
            return None
        return torch.stack([p for p in rows if p is not None])


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
        # In dsd the drafting hides behind the trip; in sd it adds to it.
        self.window = WindowController(gamma=cfg.gamma, gamma_max=cfg.gamma_max, overlap=cfg.mode != "sd")
        # A probability backend already applied temperature/top-p: verify against log(p) at temperature 1
        # (warp gives p back; the user's top-k, if any, then filters the aggregate); greedy = argmax of p.
        self.returns_probs = bool(getattr(backend, "returns_probs", False))
        self.verify_params = cfg.params
        if self.returns_probs and not cfg.params.greedy:
            self.verify_params = SamplingParams(temperature=1.0, top_k=cfg.params.top_k)
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

    async def _draft(self, context: list[int], gamma: int, stop: trio.Event | None = None) -> _Draft:
        """Draft up to `gamma` tokens one step at a time; stop early once `stop` is set (the result is in)."""
        out = _Draft([], [])
        overlapped = stop is not None
        while len(out.tokens) < gamma and not (stop is not None and stop.is_set() and out.tokens):
            step = 1 if stop is not None else gamma - len(out.tokens)
            t0 = time.perf_counter()
            toks, probs = await trio.to_thread.run_sync(self._propose, context + out.tokens, step)
            dt = time.perf_counter() - t0
            self.times.drafting += dt
            if overlapped and not (stop is not None and stop.is_set()):
                self.times.drafting_overlapped += dt
            if not toks:
                break
            self._draft_token_s = dt / len(toks)
            out.tokens.extend(toks)
            out.probs.extend(list(probs) if probs is not None else [None] * len(toks))
        return out

    # --- the loop ---------------------------------------------------------

    async def generate(self, prompt: Sequence[int], on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        cfg = self.cfg
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        committed = list(prompt)
        self.progress = new = []
        t_start = time.perf_counter()
        rounds = drafted_total = accepted_total = 0
        per_round: list[int] = []
        epoch = 0
        # Prefill: the whole prompt; its last logits give the first new token.
        window = list(prompt)
        drafts = _Draft([], [])
        start = 0
        prefill_s = 0.0
        finished = False
        while not finished:
            await self.backend.submit(window, start=start, commit=start, epoch=epoch)
            t_sent = time.perf_counter()
            pre: _Draft | None = None
            gamma_next = self._next_gamma(len(new) + len(drafts.tokens) + 1)
            if cfg.mode in ("dsd", "dsd-adaptive") and gamma_next > 0:
                # Draft the next window during the trip, assuming this one is fully accepted.
                arrived = trio.Event()
                box: list[torch.Tensor | Exception] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._collect_into, box, arrived, epoch, len(drafts.tokens) + 1)
                    pre = await self._draft(committed + drafts.tokens, gamma_next + 1, stop=arrived)
                    t_wait = time.perf_counter()
                    await arrived.wait()
                    self.times.waiting += time.perf_counter() - t_wait
                if isinstance(box[0], Exception):
                    raise box[0]
                logits = box[0]
            else:
                t_wait = time.perf_counter()
                logits = await self.backend.collect(epoch=epoch, rows=len(drafts.tokens) + 1)
                self.times.waiting += time.perf_counter() - t_wait
            round_s = time.perf_counter() - t_sent
            if start == 0:
                prefill_s = round_s
            t_v = time.perf_counter()
            verdict_tokens, k = self._verify(logits, drafts)
            self.times.verifying += time.perf_counter() - t_v
            rounds += 1
            gamma = len(drafts.tokens)
            if gamma:
                drafted_total += gamma
                accepted_total += k
                per_round.append(k)
                self.window.observe(gamma=gamma, accepted=k, draft_s_per_token=self._draft_token_s or 1e-3, round_s=round_s)
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
            # The next window: reuse the pre-drafted one if its bonus guess came true.
            gamma_next = self._next_gamma(len(new) + 1)
            drafts = _Draft([], [])
            if pre is not None and k == gamma and pre.tokens and pre.tokens[0] == committed[-1]:
                drafts = _Draft(pre.tokens[1 : gamma_next + 1], pre.probs[1 : gamma_next + 1])
            if len(drafts.tokens) < gamma_next:
                more = await self._draft(committed + drafts.tokens, gamma_next - len(drafts.tokens))
                drafts = _Draft(drafts.tokens + more.tokens, drafts.probs + more.probs)
            window = [committed[-1], *drafts.tokens]
        elapsed = time.perf_counter() - t_start
        return GenerationResult(
            mode=cfg.mode,
            tokens=new,
            elapsed_s=elapsed,
            rounds=rounds,
            drafted=drafted_total,
            accepted=accepted_total,
            accepted_per_round=per_round,
            times=self.times,
            prefill_s=prefill_s,
        )

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
