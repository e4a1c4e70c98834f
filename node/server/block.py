"""Block serving: per-session KV caches over a span of layers, forwarding each window along the ring.

A session is opened by an `OpenSession` that carries the rest of the route. The
peer opens its own stream to the next hop (another block peer, or the head for
the last hop), so hidden states go straight from peer to peer and the last peer
hands the result to the head: N+1 link crossings per window. Data flows forward;
acknowledgements and errors flow back along the streams they came in on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import trio

from dsd.discovery.announce import software_version
from dsd.discovery.framing import FramedStream, LinkError, close_quietly, send_quietly
from dsd.discovery.host import P2PNode
from dsd.discovery.records import PeerRecord
from dsd.protocol import (
    Ack,
    CloseSession,
    Error,
    Forward,
    Hop,
    Message,
    OpenSession,
    ProtocolError,
    Result,
    Truncate,
    WireFormat,
    decode_tensor,
)
from dsd.protocol.ids import INFER_PROTOCOL
from dsd.shard_store import SpanModule, Store

from .ledger import ServerLimits, SessionError

log = logging.getLogger(__name__)


@dataclass
class Session:
    """One inference session on this peer: its KV cache and the stream to the next hop."""

    id: str
    max_len: int
    span: SpanModule
    cache: Any
    downstream: FramedStream
    last_hop: bool
    next_peer: str = ""
    remote: str = ""
    epoch: int = 0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    opened_at: float = field(default_factory=time.monotonic)
    windows: int = 0


class BlockServer:
    """Serves layers [start, end) of one model to many sessions at once."""

    def __init__(
        self,
        node: P2PNode,
        store: Store,
        start: int,
        end: int,
        *,
        limits: ServerLimits | None = None,
        wire: WireFormat | None = None,
    ) -> None:
        self.node = node
        self.store = store
        self.model_id = store.manifest.model_id
        self.start, self.end = start, end
        self.limits = limits or ServerLimits()
        self.wire = wire or WireFormat()
        self.span: SpanModule = store.load_span(start, end)
        self.hidden_size = int(store.manifest.hidden_size)
        self.sessions: dict[tuple[str, int], Session] = {}
        self._subspans: dict[tuple[int, int], SpanModule] = {(start, end): self.span}
        self.reserved_tokens = 0
        self._compute = trio.CapacityLimiter(1)
        self.windows_served = 0
        self.closing = False
        self.throughput = 1.0

    # --- accounting -------------------------------------------------------

    @property
    def cache_tokens_left(self) -> int:
        return max(0, self.limits.kv_budget_tokens - self.reserved_tokens)

    def records(self) -> list[PeerRecord]:
        """This span as announced in the DHT (called at every refresh, so free cache stays current)."""
        return [PeerRecord(
            peer_id=self.node.peer_id, addrs=tuple(self.node.addrs), model=self.model_id, start=self.start,
            end=self.end, role="block", throughput=float(self.throughput), version=software_version(),
            dtype=str(self.span.dtype).removeprefix("torch."), cache_tokens_left=int(self.cache_tokens_left),
        )]

    def kv_lengths(self) -> dict[str, int]:
        """KV length of every open session (for stats and tests)."""
        return {f"{sid}@{start}": s.cache.length for (sid, start), s in self.sessions.items()}

    # --- compute ----------------------------------------------------------

    def _run_span(self, span: SpanModule, hidden: np.ndarray, start_pos: int, cache: Any) -> np.ndarray:
        with torch.inference_mode():
            out = span(torch.from_numpy(hidden).unsqueeze(0), start_pos, cache)
        return out[0].to(torch.float32).numpy()

    async def measure_throughput(self, tokens: int = 1, repeats: int = 3) -> float:
        """Decode-step tokens per second of this span, measured on a scratch cache."""
        cache = self.span.new_cache()
        hidden = np.random.default_rng(0).standard_normal((tokens, self.hidden_size)).astype(np.float32)
        await trio.to_thread.run_sync(self._run_span, self.span, hidden, 0, cache, limiter=self._compute)
        t0 = time.perf_counter()
        for i in range(repeats):
            await trio.to_thread.run_sync(self._run_span, self.span, hidden, (i + 1) * tokens, cache, limiter=self._compute)
        self.throughput = repeats * tokens / max(time.perf_counter() - t0, 1e-9)
        return self.throughput

    # --- protocol ---------------------------------------------------------

    async def serve(self, upstream: FramedStream, remote: str, first: OpenSession) -> None:
        """Run one session from its `OpenSession` until close, error, idle timeout, EOF or shutdown."""
        try:
            session = await self._open(first, remote)
        except SessionError as exc:
            log.info("refused session %s from %s: %s", first.session, remote, exc.message)
            await send_quietly(upstream, Error(exc.code, exc.message, first.session))
            await close_quietly(upstream)
            return
        log.info("session %s open from %s (max_len %d, last hop %s)", session.id, remote, session.max_len, session.last_hop)
        try:
            async with trio.open_nursery() as nursery:
                if not session.last_hop:
                    nursery.start_soon(self._relay_back, session, upstream)
                try:
                    await upstream.send(Ack(session.id, 0))
                    with session.scope:
                        await self._session_loop(session, upstream)
                    if session.scope.cancelled_caught:
                        error = Error("shutting_down", f"{self.node.peer_id}: peer shutting down", session.id)
                        await send_quietly(upstream, error)
                        await send_quietly(session.downstream, error)
                except SessionError as exc:
                    log.info("session %s ended with error: %s", session.id, exc.message)
                    # Both ways: upstream relays it to the head, downstream carries it along the ring,
                    # so the head hears the cause before it sees the return leg close.
                    error = Error(exc.code, f"{self.node.peer_id}: {exc.message}", session.id)
                    await send_quietly(upstream, error)
                    await send_quietly(session.downstream, error)
                except ProtocolError as exc:
                    log.info("session %s: bad frame from upstream: %s", session.id, exc)
                    await send_quietly(upstream, Error(exc.code, f"{self.node.peer_id}: {exc}", session.id))
                except (EOFError, LinkError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    log.info("session %s upstream gone: %r", session.id, exc)
                    await send_quietly(session.downstream, Error(
                        "unreachable", f"{self.node.peer_id}: upstream {remote} went away ({type(exc).__name__})", session.id
                    ))
                except Exception as exc:
                    log.exception("session %s failed", session.id)
                    await send_quietly(upstream, Error("internal", f"{type(exc).__name__}: {exc}", session.id))
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._release(session)
            await close_quietly(session.downstream)
            await close_quietly(upstream)

    async def _open(self, msg: OpenSession, remote: str) -> Session:
        if self.closing:
            raise SessionError("shutting_down", "this peer is shutting down")
        if msg.model != self.model_id:
            raise SessionError("bad_request", f"this peer serves model {self.model_id!r}, not {msg.model!r}")
        if not self.start <= msg.start < msg.end <= self.end:
            raise SessionError(
                "bad_request", f"this peer serves blocks {self.start}:{self.end}, not {msg.start}:{msg.end}"
            )
        key = (msg.session, msg.start)
        if key in self.sessions:
            raise SessionError("bad_request", f"session {msg.session} is already open here for block {msg.start}")
        if not msg.route:
            raise SessionError("bad_request", "route is empty: it must end with the head")
        if msg.max_len > self.limits.max_len:
            raise SessionError("limit", f"max_len {msg.max_len} exceeds this peer's limit {self.limits.max_len}")
        if len(self.sessions) >= self.limits.max_sessions:
            raise SessionError("busy", f"session limit reached ({self.limits.max_sessions})")
        if sum(1 for s in self.sessions.values() if s.remote == remote) >= self.limits.max_sessions_per_peer:
            raise SessionError("busy", f"per-peer session limit reached ({self.limits.max_sessions_per_peer})")
        if msg.max_len > self.cache_tokens_left:
            raise SessionError("busy", f"KV budget exhausted: {self.cache_tokens_left} tokens left, {msg.max_len} asked")
        nxt: Hop = msg.route[0]
        last_hop = nxt.start == nxt.end
        self.reserved_tokens += msg.max_len
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                downstream = await self.node.open(nxt.peer_id, nxt.addrs, INFER_PROTOCOL)
                if last_hop:
                    await downstream.send(Ack(msg.session, 0))
                else:
                    await downstream.send(
                        OpenSession(msg.session, msg.model, nxt.start, nxt.end, msg.max_len, tuple(msg.route[1:]))
                    )
                    reply = await downstream.receive()
                    if isinstance(reply, Error):
                        await close_quietly(downstream)
                        raise SessionError(reply.code, f"next hop {nxt.peer_id}: {reply.message}")
                    if not isinstance(reply, Ack):
                        await close_quietly(downstream)
                        raise SessionError("bad_request", f"next hop answered {type(reply).__name__}, expected Ack")
        except SessionError:
            self.reserved_tokens -= msg.max_len
            raise
        except Exception as exc:  # timeout, refused connection, reset, bad frame
            self.reserved_tokens -= msg.max_len
            raise SessionError("unreachable", f"cannot open the next hop {nxt.peer_id}: {type(exc).__name__}: {exc}") from exc
        span = self._span_for(msg.start, msg.end)
        session = Session(msg.session, msg.max_len, span, span.new_cache(), downstream, last_hop, nxt.peer_id, remote)
        self.sessions[key] = session
        return session

    def _span_for(self, start: int, end: int) -> SpanModule:
        """The served span or a weight-sharing sub-span of it (a route may use part of our layers)."""
        if (start, end) not in self._subspans:
            self._subspans[(start, end)] = self.span.sub(start, end)
        return self._subspans[(start, end)]

    async def shutdown(self, deadline_s: float) -> None:
        """Refuse new sessions, let windows being computed finish, then end every session with an error."""
        self.closing = True
        with trio.move_on_after(deadline_s):
            async with self._compute:  # waits for the window in the worker thread, if any
                pass
        for session in list(self.sessions.values()):
            session.scope.cancel()
        with trio.move_on_after(min(5.0, deadline_s)):
            while self.sessions:
                await trio.sleep(0.05)

    def _release(self, session: Session) -> None:
        if self.sessions.pop((session.id, session.span.start), None) is not None:
            self.reserved_tokens -= session.max_len
            log.info("session %s closed after %d windows", session.id, session.windows)

    async def _relay_back(self, session: Session, upstream: FramedStream) -> None:
        """Carry errors from the next hop back toward the head."""
        try:
            while True:
                msg = await session.downstream.receive()
                if isinstance(msg, Error):
                    await upstream.send(msg)
        except (EOFError, ProtocolError, LinkError, trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def _session_loop(self, session: Session, upstream: FramedStream) -> None:
        while True:
            with trio.move_on_after(self.limits.idle_timeout_s) as idle:
                msg = await upstream.receive()  # EOF without CloseSession: the upstream went away
            if idle.cancelled_caught:
                raise SessionError("idle", f"session idle for {self.limits.idle_timeout_s:.0f} s: closed")
            if isinstance(msg, Forward):
                await self._forward(session, msg)
            elif isinstance(msg, Truncate):
                self._check_session(session, msg.session)
                self._truncate(session, msg.length)
                await self._send_down(session, msg if not session.last_hop else Ack(session.id, msg.length))
            elif isinstance(msg, Error):
                log.info("session %s: error from upstream passed along: %s", session.id, msg.message)
                await send_quietly(session.downstream, msg)
                return
            elif isinstance(msg, CloseSession):
                self._check_session(session, msg.session)
                if not session.last_hop:
                    await send_quietly(session.downstream, msg)
                return
            else:
                raise SessionError("bad_request", f"unexpected {type(msg).__name__} in an open session")

    @staticmethod
    def _check_session(session: Session, sid: str) -> None:
        if sid != session.id:
            raise SessionError("unknown_session", f"unknown session {sid!r} on the stream of session {session.id}")

    @staticmethod
    def _truncate(session: Session, length: int) -> None:
        if length > session.cache.length:
            raise SessionError(
                "bad_request", f"cannot truncate to {length}: only {session.cache.length} tokens are cached"
            )
        session.cache.truncate(length)

    async def _forward(self, session: Session, msg: Forward) -> None:
        self._check_session(session, msg.session)
        if msg.epoch < session.epoch:
            log.debug("session %s: dropped window of stale epoch %d < %d", session.id, msg.epoch, session.epoch)
            return
        session.epoch = msg.epoch
        if msg.commit is not None:
            self._truncate(session, msg.commit)
        if msg.start != session.cache.length:
            raise SessionError(
                "bad_request", f"window starts at {msg.start} but {session.cache.length} tokens are cached"
            )
        try:
            hidden = decode_tensor(msg.hidden)
        except ProtocolError as exc:
            raise SessionError("bad_tensor", str(exc)) from exc
        if hidden.dtype.kind != "f":
            raise SessionError("bad_tensor", f"hidden states must be floating point, got {hidden.dtype}")
        if hidden.ndim == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden_size:
            raise SessionError(
                "bad_tensor", f"hidden must have shape [tokens, {self.hidden_size}], got {list(msg.hidden.shape)}"
            )
        tokens = hidden.shape[0]
        if not 0 < tokens <= self.limits.max_window:
            raise SessionError("limit", f"window of {tokens} tokens (allowed 1..{self.limits.max_window})")
        if msg.start + tokens > session.max_len:
            raise SessionError("limit", f"position {msg.start + tokens} is past the session's max_len {session.max_len}")
        out = await trio.to_thread.run_sync(
            self._run_span, session.span, np.ascontiguousarray(hidden, dtype=np.float32), msg.start, session.cache,
            limiter=self._compute,
        )
        session.windows += 1
        self.windows_served += 1
        wire = self.wire.encode(out)
        reply: Message = (
            Result(session.id, msg.epoch, msg.start, wire)
            if session.last_hop
            else Forward(session.id, msg.epoch, msg.start, msg.commit, wire)
        )
        await self._send_down(session, reply)

    async def _send_down(self, session: Session, msg: Message) -> None:
        try:
            with trio.fail_after(self.limits.send_timeout_s):
                await session.downstream.send(msg)
        except Exception as exc:  # timeout, reset stream, peer gone
            raise SessionError(
                "unreachable", f"next hop {session.next_peer} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
