"""Federated mode (SpecFed): workers holding whole models answer draft windows with top-K distributions.

Worker side (`FederatedWorker`, protocol `/dsd/federated/1`): per session a KV cache over
the whole model (the store's head plus one span covering every layer, so rollback is
`SpanCache.truncate`). A stream may open with `Hello` (the worker answers with its own:
model id and capabilities `vocab:V`, `topk_cap:K`, `layers:L`), then `OpenSession`
(route empty; model = the worker's model id or its vocabulary pool, see `pool_key`),
`Ack`, and per `DraftWindow` one `TopKResult`: the worker truncates to `commit` (or keeps
the accepted path `keep` of the last window), runs the window in one forward pass (a token
tree when it has `parents`), warps the logits with `dsd.node.sampling.warp` and returns
the top-K of the last `rows` positions (tree nodes, in window order), K = min(requested, its cap).

Greedy (temperature 0): a one-hot would make the aggregate's argmax a majority vote that
ignores confidence, so for temperature 0 the worker sends its softmax at temperature 1
(top-p off); the server's greedy choice is the argmax of the weighted average of those.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import trio

from dsd.discovery.announce import software_version
from dsd.discovery.framing import FramedStream, LinkError, close_quietly, send_quietly
from dsd.discovery.host import P2PNode
from dsd.discovery.records import PeerRecord
from dsd.node.head.sampling import SamplingParams, warp
from dsd.node.server.ledger import (
    Ledger,
    Liveness,
    SessionError,
    measure_throughput,
    receive_within,
    watch_upstream,
)
from dsd.node.server.limits import ServerLimits
from dsd.node.server.metrics import PeerMetrics, timed
from dsd.protocol import (
    PROTOCOL_VERSION,
    Ack,
    CloseSession,
    DraftWindow,
    Error,
    Hello,
    OpenSession,
    ProtocolError,
    SessionRuleError,
    SessionState,
    TopKResult,
    Truncate,
    topk_from_probs,
)
from dsd.shard_store import HeadModule, SpanModule, Store

from .pool import pool_key

log = logging.getLogger(__name__)


PROB_CODECS = ("fp16", "bf16", "fp32")


@dataclass
class WorkerSession:
    """One server's session on this worker: its rule state and KV cache over the whole model."""

    state: SessionState
    cache: Any
    windows: int = 0
    opened_at: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.state.id

    @property
    def max_len(self) -> int:
        return self.state.max_len


def window_topk(
    head: HeadModule,
    span: SpanModule,
    cache: Any,
    tokens: Sequence[int],
    start: int,
    *,
    rows: int,
    top_k: int,
    temperature: float,
    top_p: float = 1.0,
    parents: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Run `tokens` at positions start.. through the whole model (appending to `cache`; a token tree
    if `parents`) and return the top-K (ids int64 [rows, k], probs float32 [rows, k]) of the last
    `rows` warped distributions and the mean missing mass eps. Temperature 0 is sent as the
    temperature-1 softmax (see module doc)."""
    with torch.inference_mode():
        hidden = head.embed(torch.tensor([list(tokens)], dtype=torch.long))
        hidden = span(hidden, start, cache, parents)
        logits = head.logits(hidden[:, -rows:])[0].to("cpu").to(torch.float32)
    params = SamplingParams(temperature=1.0) if temperature == 0 else SamplingParams(temperature=temperature, top_p=top_p)
    probs = warp(logits, params).numpy()
    ids, p = topk_from_probs(probs, min(top_k, probs.shape[1]))
    eps = float(np.mean(1.0 - p.astype(np.float64).sum(axis=1)))
    return ids, p, eps


class FederatedWorker:
    """Serves `/dsd/federated/1` over a whole model from a store: sessions, KV caches, top-K answers."""

    def __init__(
        self,
        node: P2PNode,
        store: Store,
        *,
        topk_cap: int | None = None,
        prob_codec: str = "fp16",
        limits: ServerLimits | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        metrics: PeerMetrics | None = None,
    ) -> None:
        if prob_codec not in PROB_CODECS:
            raise ValueError(f"prob_codec must be one of {PROB_CODECS}, got {prob_codec!r}")
        self.node = node
        self.store = store
        self.model_id = store.manifest.model_id
        self.num_layers = int(store.manifest.num_layers)
        self.head: HeadModule = store.load_head(device=device, dtype=dtype)
        self.span: SpanModule = store.load_span(0, self.num_layers, device=device, dtype=dtype)
        self.vocab_size = int(self.head.vocab_size)
        if topk_cap is not None and not 1 <= topk_cap:
            raise ValueError(f"--topk-cap must be >= 1, got {topk_cap}")
        self.topk_cap = min(int(topk_cap), self.vocab_size) if topk_cap else self.vocab_size
        self.prob_codec = prob_codec
        self.limits = limits or ServerLimits()
        self.sessions: dict[str, WorkerSession] = {}
        self.ledger = Ledger(self.limits, "worker")
        self.windows_served = 0
        self.throughput = 1.0
        self._compute = trio.CapacityLimiter(1)
        self.metrics = metrics or PeerMetrics()  # counted like a block peer's (`start --metrics-port`)
        self.metrics.watch_sessions(open_=lambda: len(self.ledger), reserved=lambda: self.ledger.reserved_tokens,
                                    used=lambda: sum(s.cache.length for s in self.sessions.values()),
                                    budget=self.limits.kv_budget_tokens)

    @property
    def cache_tokens_left(self) -> int:
        return self.ledger.cache_tokens_left

    @property
    def reserved_tokens(self) -> int:
        return self.ledger.reserved_tokens

    def hello(self) -> Hello:
        """This worker described: model id and capabilities vocab:V, topk_cap:K, layers:L."""
        caps = ("federated", f"vocab:{self.vocab_size}", f"topk_cap:{self.topk_cap}", f"layers:{self.num_layers}")
        return Hello(PROTOCOL_VERSION, ("federated",), self.model_id, caps)

    def records(self) -> list[PeerRecord]:
        """Announced under the model id and under the vocabulary pool (servers find mixed models there)."""
        version = software_version()
        dtype = str(self.span.dtype).removeprefix("torch.")
        return [
            PeerRecord(
                peer_id=self.node.peer_id, addrs=tuple(self.node.addrs), model=model, start=0, end=self.num_layers,
                role="federated", throughput=float(self.throughput), version=version, dtype=dtype,
                cache_tokens_left=int(self.cache_tokens_left), vocab_size=self.vocab_size, topk_cap=self.topk_cap,
            )
            for model in (self.model_id, pool_key(self.vocab_size))
        ]

    async def measure_throughput(self, repeats: int = 3) -> float:
        """Decode-step tokens per second through the whole model (logits included), on a scratch cache."""
        cache = self.span.new_cache()

        def step(pos: int) -> None:
            window_topk(self.head, self.span, cache, [1], pos, rows=1, top_k=1, temperature=1.0)

        self.throughput = await measure_throughput(step, self._compute, repeats=repeats)
        return self.throughput

    # --- protocol ---------------------------------------------------------

    async def serve(self, stream: FramedStream, remote: str) -> None:
        """Handle one `/dsd/federated/1` stream: optional Hello, then one session until close or error."""
        session: WorkerSession | None = None
        me = self.node.peer_id
        self.metrics.track(stream)
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                first = await stream.receive()
                if isinstance(first, Hello):
                    await stream.send(self.hello())
                    first = await stream.receive()
            if not isinstance(first, OpenSession):
                raise SessionError("bad_request", f"a session must start with OpenSession, got {type(first).__name__}")
            try:
                session = self._open(first, remote)
            except SessionError as exc:
                log.info("refused federated session %s from %s: %s", first.session, remote, exc.message)
                self.metrics.refused(exc.code)
                await send_quietly(stream, Error(exc.code, exc.message, first.session, me))
                return
            self.metrics.sessions_opened.inc()
            log.info("federated session %s open from %s (max_len %d)", session.id, remote, session.max_len)
            await stream.send(Ack(session.id, 0))
            await self._watched_loop(session, stream, remote)
        except (SessionError, SessionRuleError) as exc:
            log.info("federated stream from %s ended with error: %s", remote, exc.message)
            self.metrics.error(exc.code)
            await send_quietly(stream, Error(exc.code, exc.message, session.id if session else None, me))
        except (trio.TooSlowError, EOFError, ProtocolError, LinkError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("federated stream from %s gone: %r", remote, exc)
            if isinstance(exc, ProtocolError):
                self.metrics.error("bad_frame")
                await send_quietly(stream, Error("bad_frame", str(exc), session.id if session else None, me))
        except Exception as exc:
            log.exception("federated session from %s failed", remote)
            self.metrics.error("internal")
            await send_quietly(stream, Error("internal", f"{type(exc).__name__}: {exc}", session.id if session else None, me))
        finally:
            if session is not None:
                self._release(session)
            await close_quietly(stream)
            self.metrics.untrack(stream)

    def _open(self, msg: OpenSession, remote: str) -> WorkerSession:
        if msg.model not in (self.model_id, pool_key(self.vocab_size)):
            raise SessionError(
                "bad_request", f"this worker serves {self.model_id!r} (pool {pool_key(self.vocab_size)!r}), not {msg.model!r}"
            )
        if (msg.start, msg.end) != (0, self.num_layers):
            raise SessionError(
                "bad_request", f"a federated worker runs the whole model: blocks 0:{self.num_layers}, not {msg.start}:{msg.end}"
            )
        if msg.route:
            raise SessionError("bad_request", "a federated session has no route (it answers on its own stream)")
        if msg.session in self.ledger:
            raise SessionError("bad_request", f"session {msg.session} is already open here")
        self.ledger.admit(msg.session, remote, msg.max_len)
        state = SessionState(msg.session, msg.max_len, self.limits.max_window)
        session = WorkerSession(state, self.span.new_cache())
        self.sessions[msg.session] = session
        return session

    def _release(self, session: WorkerSession) -> None:
        self.sessions.pop(session.id, None)
        if self.ledger.release(session.id):
            log.info("federated session %s closed after %d windows", session.id, session.windows)

    async def _watched_loop(self, session: WorkerSession, stream: FramedStream, remote: str) -> None:
        """The session loop, ended early when the server stops answering pings (a silent upstream)."""
        liveness = Liveness()
        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_upstream, self.node, remote, liveness, self.limits, scope)
            with scope:
                await self._session_loop(session, stream, liveness)
            nursery.cancel_scope.cancel()
        if scope.cancelled_caught and liveness.lost is not None:
            log.info("federated session %s ended: %s", session.id, liveness.lost)

    async def _session_loop(self, session: WorkerSession, stream: FramedStream, liveness: Liveness) -> None:
        while True:
            try:
                msg = await receive_within(stream, self.limits.idle_timeout_s)
            except EOFError:
                return
            liveness.heard()
            session.state.check(getattr(msg, "session", session.id))
            if isinstance(msg, DraftWindow):
                reply = await self._window(session, msg)
                if reply is not None:
                    with trio.fail_after(self.limits.send_timeout_s):
                        await stream.send(reply)
            elif isinstance(msg, Truncate):
                session.cache.truncate(session.state.truncate(msg.session, msg.length))
                await stream.send(Ack(session.id, msg.length))
            elif isinstance(msg, CloseSession):
                return
            else:
                raise SessionError("bad_request", f"unexpected {type(msg).__name__} in an open federated session")

    async def _window(self, session: WorkerSession, msg: DraftWindow) -> TopKResult | None:
        n = len(msg.tokens)
        length = session.state.forward(msg.session, msg.epoch, msg.start, msg.commit, n, parents=msg.parents, keep=msg.keep)
        if length is None:
            log.debug("session %s: dropped window of stale epoch %d < %d", session.id, msg.epoch, session.state.epoch)
            return None
        if msg.keep and msg.commit is not None:  # the state checked the path against the last window
            session.cache.keep(msg.commit, msg.keep)
        else:
            session.cache.truncate(length)
        bad = next((t for t in msg.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise SessionError("bad_request", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        rows = msg.rows or n
        k = min(msg.top_k, self.topk_cap)
        (ids, p, _), seconds = await trio.to_thread.run_sync(
            lambda: timed(lambda: window_topk(self.head, self.span, session.cache, msg.tokens, msg.start, rows=rows,
                                              top_k=k, temperature=msg.temperature, top_p=msg.top_p,
                                              parents=msg.parents)),
            limiter=self._compute,
        )
        self.metrics.observe_forward(n, seconds)
        session.windows += 1
        self.windows_served += 1
        return TopKResult.build(session.id, msg.epoch, msg.start + n - rows, ids, p, prob_codec=self.prob_codec)


def make_handler(worker: FederatedWorker) -> Callable[[FramedStream, str], Any]:
    """The `/dsd/federated/1` stream handler of a worker."""

    async def handle(stream: FramedStream, remote: str) -> None:
        await worker.serve(stream, remote)

    return handle
