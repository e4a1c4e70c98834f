"""Federated mode (SpecFed): workers holding whole models answer draft windows with top-K distributions.

Worker side (`FederatedWorker`, protocol `/dsd/federated/1`): per session a KV cache over
the whole model (the store's head plus one span covering every layer, so rollback is
`SpanCache.truncate`). A stream may open with `Hello` (the worker answers with its own:
model id and capabilities `vocab:V`, `topk_cap:K`, `layers:L`), then `OpenSession`
(route empty; model = the worker's model id or its vocabulary pool, see `pool_key`),
`Ack`, and per `DraftWindow` one `TopKResult`: the worker truncates to `commit`, runs the
window in one forward pass, warps the logits with `dsd.node.sampling.warp` and returns
the top-K of the last `rows` positions, K = min(requested, its cap).

Greedy (temperature 0): a one-hot would make the aggregate's argmax a majority vote that
ignores confidence, so for temperature 0 the worker sends its softmax at temperature 1
(top-p off); the server's greedy choice is the argmax of the weighted average of those.

Server side (`FederatedBackend`, a `TargetBackend` with `returns_probs = True`): broadcasts
each window to every active worker in parallel, waits until every one answered or the
window's deadline passed, rebuilds each distribution (renormalize | residual), averages
with the weights renormalised over the workers that answered, and hands the engine
probabilities [rows, V]. A worker that misses a deadline is left out of that window
(logged, counted); its KV stays consistent because it still processes every window in
stream order (late answers are discarded by (epoch, start)), so it rejoins when it keeps
up again; after `max_misses` consecutive misses it is dropped for the rest of the
generation. A worker whose stream fails is dropped at once. Generation goes on while at
least one worker answers.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import trio

from dsd.discovery.framing import FramedStream, LinkError
from dsd.discovery.host import P2PNode
from dsd.discovery.records import PeerRecord, _software_version, fetch_records
from dsd.protocol import (
    PROTOCOL_VERSION,
    Ack,
    CloseSession,
    DraftWindow,
    Error,
    Hello,
    OpenSession,
    ProtocolError,
    TopKResult,
    Truncate,
    aggregate,
    reconstruct,
    topk_from_probs,
)
from dsd.protocol.topk import RECONSTRUCT_METHODS
from dsd.shard_store import HeadModule, SpanModule, Store

from .head import Drafter, GenerationConfig, HeadEngine
from .sampling import SamplingParams, warp
from .server import SessionError, _close_quietly, _send_quietly
from .settings import ServerLimits

log = logging.getLogger(__name__)

FEDERATED_PROTOCOL = "/dsd/federated/1"
PROB_CODECS = ("fp16", "bf16", "fp32")
# Longest window the server sends; longer prompts are prefilled in chunks of this size.
PREFILL_CHUNK = ServerLimits.max_window


def pool_key(vocab_size: int) -> str:
    """The DHT "model" under which every federated worker of a vocabulary announces (models may differ)."""
    return f"federated/vocab-{int(vocab_size)}"


class FederatedError(Exception):
    """Federated generation cannot go on: no usable worker, mismatched vocabularies, bad options."""


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------


@dataclass
class WorkerSession:
    """One server's session on this worker: its KV cache over the whole model."""

    id: str
    max_len: int
    cache: Any
    epoch: int = 0
    windows: int = 0
    opened_at: float = field(default_factory=time.monotonic)


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
) -> tuple[np.ndarray, np.ndarray, float]:
    """Run `tokens` at positions start.. through the whole model (appending to `cache`) and return the
    top-K (ids int64 [rows, k], probs float32 [rows, k]) of the last `rows` warped distributions and
    the mean missing mass eps. Temperature 0 is sent as the temperature-1 softmax (see module doc)."""
    with torch.inference_mode():
        hidden = head.embed(torch.tensor([list(tokens)], dtype=torch.long))
        hidden = span(hidden, start, cache)
        logits = head.logits(hidden[:, -rows:])[0].to(torch.float32)
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
    ) -> None:
        if prob_codec not in PROB_CODECS:
            raise ValueError(f"prob_codec must be one of {PROB_CODECS}, got {prob_codec!r}")
        self.node = node
        self.store = store
        self.model_id = store.manifest.model_id
        self.num_layers = int(store.manifest.num_layers)
        self.head: HeadModule = store.load_head()
        self.span: SpanModule = store.load_span(0, self.num_layers)
        self.vocab_size = int(self.head.vocab_size)
        if topk_cap is not None and not 1 <= topk_cap:
            raise ValueError(f"--topk-cap must be >= 1, got {topk_cap}")
        self.topk_cap = min(int(topk_cap), self.vocab_size) if topk_cap else self.vocab_size
        self.prob_codec = prob_codec
        self.limits = limits or ServerLimits()
        self.sessions: dict[str, WorkerSession] = {}
        self.reserved_tokens = 0
        self.windows_served = 0
        self.throughput = 1.0
        self._compute = trio.CapacityLimiter(1)

    @property
    def cache_tokens_left(self) -> int:
        return max(0, self.limits.kv_budget_tokens - self.reserved_tokens)

    def hello(self) -> Hello:
        """This worker described: model id and capabilities vocab:V, topk_cap:K, layers:L."""
        caps = ("federated", f"vocab:{self.vocab_size}", f"topk_cap:{self.topk_cap}", f"layers:{self.num_layers}")
        return Hello(PROTOCOL_VERSION, ("federated",), self.model_id, caps)

    def records(self) -> list[PeerRecord]:
        """Announced under the model id and under the vocabulary pool (servers find mixed models there)."""
        version = _software_version()
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

        await trio.to_thread.run_sync(step, 0, limiter=self._compute)
        t0 = time.perf_counter()
        for i in range(repeats):
            await trio.to_thread.run_sync(step, i + 1, limiter=self._compute)
        self.throughput = repeats / max(time.perf_counter() - t0, 1e-9)
        return self.throughput

    # --- protocol ---------------------------------------------------------

    async def serve(self, stream: FramedStream, remote: str) -> None:
        """Handle one `/dsd/federated/1` stream: optional Hello, then one session until close or error."""
        session: WorkerSession | None = None
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                first = await stream.receive()
                if isinstance(first, Hello):
                    await stream.send(self.hello())
                    first = await stream.receive()
            if not isinstance(first, OpenSession):
                raise SessionError("bad_request", f"a session must start with OpenSession, got {type(first).__name__}")
            session = self._open(first)
            log.info("federated session %s open from %s (max_len %d)", session.id, remote, session.max_len)
            await stream.send(Ack(session.id, 0))
            await self._session_loop(session, stream)
        except SessionError as exc:
            log.info("federated stream from %s ended with error: %s", remote, exc.message)
            await _send_quietly(stream, Error(exc.code, exc.message, session.id if session else None))
        except (trio.TooSlowError, EOFError, ProtocolError, LinkError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("federated stream from %s gone: %r", remote, exc)
            if isinstance(exc, ProtocolError):
                await _send_quietly(stream, Error("bad_frame", str(exc), session.id if session else None))
        except Exception as exc:
            log.exception("federated session from %s failed", remote)
            await _send_quietly(stream, Error("internal", f"{type(exc).__name__}: {exc}", session.id if session else None))
        finally:
            if session is not None:
                self._release(session)
            await _close_quietly(stream)

    def _open(self, msg: OpenSession) -> WorkerSession:
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
        if msg.session in self.sessions:
            raise SessionError("bad_request", f"session {msg.session} is already open here")
        if msg.max_len > self.limits.max_len:
            raise SessionError("limit", f"max_len {msg.max_len} exceeds this worker's limit {self.limits.max_len}")
        if len(self.sessions) >= self.limits.max_sessions:
            raise SessionError("busy", f"session limit reached ({self.limits.max_sessions})")
        if msg.max_len > self.cache_tokens_left:
            raise SessionError("busy", f"KV budget exhausted: {self.cache_tokens_left} tokens left, {msg.max_len} asked")
        self.reserved_tokens += msg.max_len
        session = WorkerSession(msg.session, msg.max_len, self.span.new_cache())
        self.sessions[msg.session] = session
        return session

    def _release(self, session: WorkerSession) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.reserved_tokens -= session.max_len
            log.info("federated session %s closed after %d windows", session.id, session.windows)

    async def _session_loop(self, session: WorkerSession, stream: FramedStream) -> None:
        while True:
            with trio.move_on_after(self.limits.idle_timeout_s) as idle:
                try:
                    msg = await stream.receive()
                except EOFError:
                    return
            if idle.cancelled_caught:
                raise SessionError("idle", f"session idle for {self.limits.idle_timeout_s:.0f} s: closed")
            if getattr(msg, "session", session.id) != session.id:
                raise SessionError("unknown_session", f"unknown session {msg.session!r} on the stream of session {session.id}")
            if isinstance(msg, DraftWindow):
                reply = await self._window(session, msg)
                if reply is not None:
                    with trio.fail_after(self.limits.send_timeout_s):
                        await stream.send(reply)
            elif isinstance(msg, Truncate):
                self._truncate(session, msg.length)
                await stream.send(Ack(session.id, msg.length))
            elif isinstance(msg, CloseSession):
                return
            else:
                raise SessionError("bad_request", f"unexpected {type(msg).__name__} in an open federated session")

    @staticmethod
    def _truncate(session: WorkerSession, length: int) -> None:
        if length > session.cache.length:
            raise SessionError("bad_request", f"cannot truncate to {length}: only {session.cache.length} tokens are cached")
        session.cache.truncate(length)

    async def _window(self, session: WorkerSession, msg: DraftWindow) -> TopKResult | None:
        if msg.epoch < session.epoch:
            log.debug("session %s: dropped window of stale epoch %d < %d", session.id, msg.epoch, session.epoch)
            return None
        session.epoch = msg.epoch
        if msg.commit is not None:
            self._truncate(session, msg.commit)
        if msg.start != session.cache.length:
            raise SessionError("bad_request", f"window starts at {msg.start} but {session.cache.length} tokens are cached")
        n = len(msg.tokens)
        if n > self.limits.max_window:
            raise SessionError("limit", f"window of {n} tokens (allowed 1..{self.limits.max_window})")
        if msg.start + n > session.max_len:
            raise SessionError("limit", f"position {msg.start + n} is past the session's max_len {session.max_len}")
        bad = next((t for t in msg.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise SessionError("bad_request", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        rows = msg.rows or n
        k = min(msg.top_k, self.topk_cap)
        ids, p, _ = await trio.to_thread.run_sync(
            lambda: window_topk(self.head, self.span, session.cache, msg.tokens, msg.start, rows=rows, top_k=k,
                                temperature=msg.temperature, top_p=msg.top_p),
            limiter=self._compute,
        )
        session.windows += 1
        self.windows_served += 1
        return TopKResult.build(session.id, msg.epoch, msg.start + n - rows, ids, p, prob_codec=self.prob_codec)


def make_handler(worker: FederatedWorker) -> Callable[[FramedStream, str], Any]:
    """The `/dsd/federated/1` stream handler of a worker."""

    async def handle(stream: FramedStream, remote: str) -> None:
        await worker.serve(stream, remote)

    return handle


# --------------------------------------------------------------------------------------------
# discovery
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """A federated worker as announced: where it is, its vocabulary, K cap and layers (model via Hello)."""

    peer_id: str
    addrs: tuple[str, ...]
    num_layers: int
    vocab_size: int
    topk_cap: int
    throughput: float = 0.0
    model: str | None = None

    @classmethod
    def from_record(cls, rec: PeerRecord) -> WorkerInfo:
        """From a federated PeerRecord; the model is filled in unless the record is a pool record."""
        if rec.role != "federated" or rec.vocab_size is None or rec.topk_cap is None:
            raise FederatedError(f"peer {rec.peer_id} announced role {rec.role!r}, not a federated worker")
        model = None if rec.model.startswith("federated/vocab-") else rec.model
        return cls(rec.peer_id, rec.addrs, rec.end, rec.vocab_size, rec.topk_cap, rec.throughput, model)


def parse_hello(hello: Hello) -> dict[str, Any]:
    """A worker's Hello as a dict: model, vocab_size, topk_cap, num_layers (None where not announced)."""
    caps: dict[str, int] = {}
    for cap in hello.capabilities:
        name, _, value = cap.partition(":")
        if value.isdigit():
            caps[name] = int(value)
    return {"model": hello.model, "vocab_size": caps.get("vocab"), "topk_cap": caps.get("topk_cap"),
            "num_layers": caps.get("layers")}


async def describe_worker(node: P2PNode, peer_id: str, addrs: Sequence[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask a worker to describe itself (Hello exchange on `/dsd/federated/1`, no session)."""
    with trio.fail_after(timeout_s):
        stream = await node.open(peer_id, addrs, FEDERATED_PROTOCOL)
        try:
            await stream.send(Hello(PROTOCOL_VERSION, ("server",), "", ()))
            reply = await stream.receive()
        finally:
            await _close_quietly(stream)
    if isinstance(reply, Error):
        raise FederatedError(f"worker {peer_id} refused Hello: {reply.code}: {reply.message}")
    if not isinstance(reply, Hello):
        raise FederatedError(f"worker {peer_id} answered Hello with {type(reply).__name__}")
    return parse_hello(reply)


async def find_workers(
    node: P2PNode, vocab_size: int, *, model: str | None = None, peer_ids: Sequence[str] | None = None
) -> list[WorkerInfo]:
    """Live federated workers of a vocabulary (or of one model), sorted by peer id, or the named ones
    in the order named; a named worker that is not announced is a FederatedError."""
    key = model if model is not None else pool_key(vocab_size)
    recs = [r for r in await fetch_records(node, key, 0) if r.role == "federated"]
    found = {r.peer_id: WorkerInfo.from_record(r) for r in recs}
    if peer_ids:
        missing = [p for p in peer_ids if p not in found]
        if missing:
            raise FederatedError(f"no live federated worker record for {', '.join(missing)} (looked under {key!r})")
        return [found[p] for p in peer_ids]
    return [found[p] for p in sorted(found)]


# --------------------------------------------------------------------------------------------
# server side
# --------------------------------------------------------------------------------------------


@dataclass
class WorkerLink:
    """The server's view of one worker during a generation: stream, weight, state and statistics."""

    info: WorkerInfo
    weight: float
    model: str | None = None
    stream: FramedStream | None = None
    state: str = "opening"  # opening | active | dropped | failed
    reason: str = ""
    k: int = 0
    windows_sent: int = 0
    windows_answered: int = 0
    windows_missed: int = 0
    consecutive_misses: int = 0
    rows_received: int = 0
    eps_sum: float = 0.0
    results: dict[tuple[int, int], TopKResult] = field(default_factory=dict)

    @property
    def peer_id(self) -> str:
        return self.info.peer_id

    @property
    def bytes_received(self) -> int:
        return self.stream.bytes_received if self.stream is not None else 0

    @property
    def bytes_sent(self) -> int:
        return self.stream.bytes_sent if self.stream is not None else 0

    def report(self) -> dict[str, Any]:
        """Per-worker statistics for `--json`."""
        return {
            "peer_id": self.peer_id,
            "model": self.model,
            "weight": self.weight,
            "state": self.state,
            "reason": self.reason,
            "k": self.k,
            "topk_cap": self.info.topk_cap,
            "windows_sent": self.windows_sent,
            "windows_answered": self.windows_answered,
            "windows_missed": self.windows_missed,
            "rows_received": self.rows_received,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "bytes_per_row": round(self.bytes_received / self.rows_received, 2) if self.rows_received else None,
            "mean_eps": round(self.eps_sum / self.rows_received, 8) if self.rows_received else None,
        }


@dataclass
class _Window:
    epoch: int
    first_row: int
    rows: int
    deadline: float
    targets: list[WorkerLink]


class FederatedBackend:
    """The head engine's target backend over federated workers: returns aggregated probabilities [rows, V].

    Use as an async context manager (it opens one session per worker, in parallel, and owns
    the reader tasks). `returns_probs` tells the engine to verify against log(p̂) at temperature 1.
    """

    returns_probs = True

    def __init__(
        self,
        node: P2PNode,
        workers: Sequence[WorkerInfo],
        *,
        vocab_size: int,
        params: SamplingParams,
        max_len: int,
        top_k: int | None = None,
        weights: Sequence[float] | None = None,
        method: str = "residual",
        window_timeout_s: float = 60.0,
        open_timeout_s: float = 60.0,
        max_misses: int = 3,
        session_id: str | None = None,
    ) -> None:
        if not workers:
            raise FederatedError("federated generation needs at least one worker")
        if method not in RECONSTRUCT_METHODS:
            raise FederatedError(f"--reconstruct must be one of {', '.join(RECONSTRUCT_METHODS)}, got {method!r}")
        if top_k is not None and not 1 <= top_k <= vocab_size:
            raise FederatedError(f"--topk must be in [1, {vocab_size}] (the vocabulary size), got {top_k}")
        if weights is None:
            weights = [1.0] * len(workers)
        if len(weights) != len(workers):
            raise FederatedError(f"got {len(weights)} weights for {len(workers)} workers")
        if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise FederatedError(f"weights must be finite, >= 0 and not all zero, got {list(weights)}")
        if window_timeout_s <= 0:
            raise FederatedError(f"--worker-timeout must be > 0, got {window_timeout_s}")
        for w in workers:
            if w.vocab_size != vocab_size:
                raise FederatedError(
                    f"worker {w.peer_id} ({w.model or 'model unknown'}) has a vocabulary of {w.vocab_size} tokens, "
                    f"the server's has {vocab_size}: federated workers must share the vocabulary"
                )
        if len({w.peer_id for w in workers}) != len(workers):
            raise FederatedError("a worker is listed twice")
        self.node = node
        self.vocab_size = int(vocab_size)
        self.params = params
        self.max_len = max_len
        self.top_k = top_k
        self.method = method
        self.window_timeout_s = window_timeout_s
        self.open_timeout_s = open_timeout_s
        self.max_misses = max_misses
        self.id = session_id or secrets.token_hex(8)
        self.links = [WorkerLink(w, float(wt), model=w.model) for w, wt in zip(workers, weights, strict=True)]
        self.windows = 0
        self.misses = 0
        self.drops = 0
        self.aggregate_s = 0.0
        self._window: _Window | None = None
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._nursery_cm = trio.open_nursery()

    # --- lifecycle --------------------------------------------------------

    @property
    def active(self) -> list[WorkerLink]:
        return [link for link in self.links if link.state == "active"]

    async def __aenter__(self) -> FederatedBackend:
        self._nursery = await self._nursery_cm.__aenter__()
        try:
            async with trio.open_nursery() as opening:
                for link in self.links:
                    opening.start_soon(self._open, link)
            mismatched = [link for link in self.links if link.reason.startswith("vocabulary mismatch")]
            if mismatched:
                raise FederatedError("; ".join(f"worker {link.peer_id}: {link.reason}" for link in mismatched))
            if not self.active:
                reasons = "; ".join(f"{link.peer_id}: {link.reason}" for link in self.links)
                raise FederatedError(f"no federated worker could be opened ({reasons})")
            for link in self.active:
                self._nursery.start_soon(self._reader, link)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self._close_all()
            self._nursery.cancel_scope.cancel()
            await self._nursery_cm.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        try:
            await self._close_all()
        finally:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
        return await self._nursery_cm.__aexit__(*exc)

    async def _close_all(self) -> None:
        async with trio.open_nursery() as n:
            for link in self.links:
                n.start_soon(self._close_link, link)

    async def _close_link(self, link: WorkerLink) -> None:
        if link.stream is None:
            return
        with trio.move_on_after(3):
            try:
                await link.stream.send(CloseSession(self.id))
            except Exception as exc:
                log.debug("close to %s: %r", link.peer_id, exc)
        await _close_quietly(link.stream)

    async def _open(self, link: WorkerLink) -> None:
        info = link.info
        try:
            with trio.fail_after(self.open_timeout_s):
                link.stream = await self.node.open(info.peer_id, info.addrs, FEDERATED_PROTOCOL)
                await link.stream.send(Hello(PROTOCOL_VERSION, ("server",), "", ()))
                hello = await link.stream.receive()
                if isinstance(hello, Error):
                    raise FederatedError(f"refused: {hello.code}: {hello.message}")
                if not isinstance(hello, Hello):
                    raise FederatedError(f"answered Hello with {type(hello).__name__}")
                desc = parse_hello(hello)
                link.model = desc["model"]
                if desc["vocab_size"] is not None and desc["vocab_size"] != self.vocab_size:
                    raise FederatedError(
                        f"vocabulary mismatch: model {desc['model']!r} has {desc['vocab_size']} tokens, the server's "
                        f"has {self.vocab_size}; federated workers must share the vocabulary"
                    )
                await link.stream.send(
                    OpenSession(self.id, pool_key(self.vocab_size), 0, info.num_layers, self.max_len, ())
                )
                reply = await link.stream.receive()
                if isinstance(reply, Error):
                    raise FederatedError(f"refused the session: {reply.code}: {reply.message}")
                if not isinstance(reply, Ack):
                    raise FederatedError(f"answered OpenSession with {type(reply).__name__}")
            link.state = "active"
            log.info("federated session %s open on %s (%s)", self.id, info.peer_id, link.model)
        except Exception as exc:  # refused, unreachable, timeout, bad frame
            link.state = "failed"
            link.reason = str(exc) if isinstance(exc, FederatedError) else f"{type(exc).__name__}: {exc}"
            log.warning("federated worker %s not used: %s", info.peer_id, link.reason)
            if link.stream is not None:
                await _close_quietly(link.stream)

    async def _reader(self, link: WorkerLink) -> None:
        """Collect a worker's answers (keyed by epoch and first row) until its stream ends."""
        assert link.stream is not None
        try:
            while True:
                msg = await link.stream.receive()
                if isinstance(msg, TopKResult):
                    link.results[(msg.epoch, msg.start)] = msg
                elif isinstance(msg, Error):
                    raise FederatedError(f"worker error {msg.code}: {msg.message}")
                self._notify()
        except Exception as exc:  # EOF, reset, bad frame, worker error
            if link.state == "active":
                link.state = "failed"
                link.reason = str(exc) if isinstance(exc, FederatedError) else f"stream ended: {type(exc).__name__}: {exc}"
                self.drops += 1
                log.warning("federated worker %s dropped: %s", link.peer_id, link.reason)
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    # --- TargetBackend ----------------------------------------------------

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int) -> None:
        """Broadcast the window to every active worker; a prefill (start 0) asks for its last row only."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("a window needs at least one token")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        rows = 1 if start == 0 else len(tokens)
        if rows > PREFILL_CHUNK:
            raise ValueError(f"a draft window holds at most {PREFILL_CHUNK} tokens, got {len(tokens)}")
        msgs: list[DraftWindow] = []
        at, first_commit = 0, commit
        while len(tokens) - at > PREFILL_CHUNK:  # long prompts: chunks whose answers are ignored
            msgs.append(DraftWindow(self.id, epoch, start + at, first_commit, tuple(tokens[at : at + PREFILL_CHUNK]), 1, 1.0))
            at += PREFILL_CHUNK
            first_commit = None
        rest = tuple(tokens[at:])
        k = self.top_k if self.top_k is not None else self.vocab_size
        msgs.append(DraftWindow(self.id, epoch, start + at, first_commit, rest, k, self.params.temperature,
                                self.params.top_p, rows=min(rows, len(rest))))
        targets = self.active
        if not targets:
            raise FederatedError(self._none_left())
        self._window = _Window(epoch, start + len(tokens) - rows, rows, time.monotonic() + self.window_timeout_s, targets)
        async with trio.open_nursery() as n:
            for link in targets:
                n.start_soon(self._send_window, link, msgs)

    async def _send_window(self, link: WorkerLink, msgs: list[DraftWindow]) -> None:
        assert link.stream is not None
        try:
            with trio.fail_after(self.window_timeout_s):
                for m in msgs:
                    await link.stream.send(m)
            link.windows_sent += 1
        except Exception as exc:
            if link.state == "active":
                link.state = "failed"
                link.reason = f"send failed: {type(exc).__name__}: {exc}"
                self.drops += 1
                log.warning("federated worker %s dropped: %s", link.peer_id, link.reason)
            self._notify()

    def _none_left(self) -> str:
        reasons = "; ".join(f"{link.peer_id} ({link.model}): {link.state} {link.reason}" for link in self.links)
        return f"no federated worker is left ({reasons})"

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        """Aggregated probabilities [rows, V] for the submitted window, from the workers that met its deadline."""
        w = self._window
        if w is None or w.epoch != epoch:
            raise RuntimeError(f"collect(epoch={epoch}) without a matching submit()")
        if rows != w.rows:
            raise ValueError(f"collect asked for {rows} rows but the window was submitted for {w.rows}")
        key = (w.epoch, w.first_row)
        with trio.move_on_at(trio.current_time() + max(0.0, w.deadline - time.monotonic())):
            while True:
                wake = self._wake
                if all(key in link.results or link.state != "active" for link in w.targets):
                    break
                await wake.wait()
        t0 = time.perf_counter()
        self.windows += 1
        answered: list[tuple[WorkerLink, TopKResult]] = []
        for link in w.targets:
            res = link.results.pop(key, None)
            link.results.clear()  # older answers are stale
            if res is not None:
                answered.append((link, res))
                link.windows_answered += 1
                link.consecutive_misses = 0
            elif link.state == "active":
                link.windows_missed += 1
                link.consecutive_misses += 1
                self.misses += 1
                log.warning("federated worker %s missed the deadline of window (epoch %d, row %d)", link.peer_id, *key)
                if link.consecutive_misses >= self.max_misses:
                    link.state = "dropped"
                    link.reason = f"missed {link.consecutive_misses} window deadlines in a row"
                    self.drops += 1
                    log.warning("federated worker %s dropped: %s", link.peer_id, link.reason)
        if not answered:
            raise FederatedError(f"no worker answered window (epoch {epoch}, row {w.first_row}): " + self._none_left())
        dists, weights = [], []
        for link, res in answered:
            ids, p = res.arrays()
            if res.positions != rows:
                raise FederatedError(f"worker {link.peer_id} answered {res.positions} rows, {rows} expected")
            link.k = res.k
            link.rows_received += rows
            link.eps_sum += float(np.sum(1.0 - p.astype(np.float64).sum(axis=1)))
            dists.append(reconstruct(ids, p, self.vocab_size, self.method))  # type: ignore[arg-type]
            weights.append(link.weight)
        if sum(weights) <= 0:
            weights = [1.0] * len(weights)
        probs = torch.from_numpy(aggregate(dists, weights)).to(torch.float32)
        self.aggregate_s += time.perf_counter() - t0
        return probs

    def report(self) -> dict[str, Any]:
        """Federated statistics for `--json`: per-worker bytes, mean eps, K, answers and misses."""
        workers = [link.report() for link in self.links]
        rows = sum(link.rows_received for link in self.links)
        received = sum(link.bytes_received for link in self.links)
        return {
            "federated": True,
            "reconstruct": self.method,
            "top_k": self.top_k,
            "vocab_size": self.vocab_size,
            "windows": self.windows,
            "missed": self.misses,
            "dropped": self.drops,
            "workers": workers,
            "bytes_received": received,
            "bytes_sent": sum(link.bytes_sent for link in self.links),
            "uplink_bytes_per_row": round(received / rows, 2) if rows else None,
            "full_distribution_bytes_per_row": 4 * self.vocab_size,
            "aggregate_s": round(self.aggregate_s, 4),
        }


async def generate_federated(
    node: P2PNode,
    workers: Sequence[WorkerInfo],
    drafter: Drafter | None,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    vocab_size: int,
    top_k: int | None = None,
    weights: Sequence[float] | None = None,
    method: str = "residual",
    window_timeout_s: float = 60.0,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> dict[str, Any]:
    """One federated generation: open the workers, run the head engine over them, return the `--json` report."""
    max_len = len(prompt) + cfg.max_new_tokens + cfg.gamma_max + 2
    backend = FederatedBackend(
        node, workers, vocab_size=vocab_size, params=cfg.params, max_len=max_len, top_k=top_k, weights=weights,
        method=method, window_timeout_s=window_timeout_s,
    )
    failure: FederatedError | None = None
    async with backend:
        engine = HeadEngine(backend, drafter, cfg, tokenizer)
        try:
            result = await engine.generate(prompt, on_tokens=on_tokens)
        except FederatedError as exc:  # re-raised below, outside the backend's nursery (no exception group)
            failure = exc
    if failure is not None:
        raise failure
    report = result.as_dict()
    report.update(backend.report())
    n = max(1, len(result.tokens))
    report["uplink_bytes_per_token"] = round(report["bytes_received"] / n, 2)
    return report
