"""Block serving: per-session KV caches over a span of layers, forwarding each window along the ring.

A session is opened by an `OpenSession` that carries the rest of the route. The
peer opens its own stream to the next hop (another block peer, or the head for
the last hop), so hidden states go straight from peer to peer and the last peer
hands the result to the head: N+1 link crossings per window. Data flows forward;
acknowledgements and errors flow back along the streams they came in on.
A window may be a token tree (`Forward.parents`); the next window's `keep` names its
accepted path, which every peer of the ring keeps in its cache instead of truncating.
The span computes on its device in its dtype (weights and KV caches live there); hidden states
cross to the CPU only to be put on the wire, by default in the codec of the compute dtype.
A faulty peer (`faults`, `--faulty`: tests and demos only) sends lies instead, after the same honest step.
A leg opened over a relay moves to a direct stream once a direct connection to its peer exists, both ways
(`dsd.discovery.handover`): this peer moves its leg to the next hop, and takes over a new upstream after a `Move`.
Windows of different sessions that wait while the span computes run as one step (`batching.Batcher`, `--batching`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import trio

from dsd.discovery.announce import software_version
from dsd.discovery.framing import FramedStream, LinkError, close_quietly, send_quietly
from dsd.discovery.handover import ATTACH_TIMEOUT_S, Handover, LegMover
from dsd.discovery.host import P2PNode
from dsd.discovery.records import PeerRecord
from dsd.protocol import (
    DEFAULT_LIMITS,
    Ack,
    Attach,
    CloseSession,
    Error,
    Forward,
    Hop,
    Message,
    Move,
    Moved,
    OpenSession,
    ProtocolError,
    Result,
    SessionRuleError,
    SessionState,
    Truncate,
    WireFormat,
    decode_tensor,
)
from dsd.protocol.ids import INFER_PROTOCOL
from dsd.shard_store import SpanModule, SpanWindow, Store
from dsd.shard_store.dtypes import dtype_name

from .batching import Batcher, BatchOptions, Job, cpu_rows
from .faults import Fault, FaultySession
from .ledger import (
    Ledger,
    Liveness,
    SessionError,
    measure_throughput,
    receive_within,
    watch_upstream,
)
from .limits import ServerLimits
from .metrics import PeerMetrics

log = logging.getLogger(__name__)

FLOAT16_MAX = float(torch.finfo(torch.float16).max)


@dataclass
class Session:
    """One inference session on this peer: its rule state, KV cache, the stream it reads from upstream and the one to
    the next hop (each replaced when its leg moves off a relay)."""

    state: SessionState
    span: SpanModule
    cache: Any
    downstream: FramedStream
    last_hop: bool
    next_peer: str = ""
    remote: str = ""
    upstream: FramedStream | None = None
    next_start: int = 0
    handover: Handover | None = None  # streams that take over the upstream leg after a Move
    mover: LegMover | None = None  # moves the leg to the next hop off a relay
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    opened_at: float = field(default_factory=time.monotonic)
    windows: int = 0
    liveness: Liveness = field(default_factory=Liveness)
    links: tuple[str, ...] = ()  # how the legs from here to the head travel (direct | relayed | hole-punched)
    lies: FaultySession | None = None  # a faulty peer's lying state (tests and demos only)

    @property
    def id(self) -> str:
        return self.state.id

    @property
    def max_len(self) -> int:
        return self.state.max_len


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
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        metrics: PeerMetrics | None = None,
        fault: Fault | None = None,
        batching: BatchOptions | None = None,
        weights: str | None = None,
    ) -> None:
        self.node = node
        self.store = store
        self.model_id = store.manifest.model_id
        self.start, self.end = start, end
        self.limits = limits or ServerLimits()
        self.span: SpanModule = store.load_span(start, end, device=device, dtype=dtype, weights=weights)
        self.fault = fault
        if fault is not None:
            fault.prepare(self.span)
            log.warning("this peer LIES ON PURPOSE (--faulty %s): it returns wrong hidden states; for tests and "
                        "demos only, never on a real swarm", fault)
        self.dtype_name = dtype_name(self.span.dtype)
        self.wire = (wire or WireFormat("auto")).for_dtype(self.dtype_name)
        self.hidden_size = int(store.manifest.hidden_size)
        self.sessions: dict[tuple[str, int], Session] = {}
        self.ledger = Ledger(self.limits, "peer")
        self._subspans: dict[tuple[int, int], SpanModule] = {(start, end): self.span}
        self.batcher = Batcher(batching)  # one step at a time: shutdown and the throughput probe hold its limiter too
        self.windows_served = 0
        self.rows_served = 0  # window rows (drafted and committed tokens) run through the span
        self.closing = False
        self.throughput = 1.0
        self.metrics = metrics or PeerMetrics()
        self.metrics.watch_sessions(open_=lambda: len(self.ledger), reserved=lambda: self.ledger.reserved_tokens,
                                    used=lambda: sum(s.cache.length for s in self.sessions.values()),
                                    budget=self.limits.kv_budget_tokens)

    # --- accounting -------------------------------------------------------

    @property
    def cache_tokens_left(self) -> int:
        return self.ledger.cache_tokens_left

    @property
    def reserved_tokens(self) -> int:
        return self.ledger.reserved_tokens

    def records(self) -> list[PeerRecord]:
        """This span as announced in the DHT (called at every refresh, so free cache and load stay current)."""
        load = self.batcher.report()
        return [PeerRecord(
            peer_id=self.node.peer_id, addrs=tuple(self.node.addrs), model=self.model_id, start=self.start,
            end=self.end, role="block", throughput=float(self.throughput), version=software_version(),
            dtype=self.dtype_name, codec=self.wire.codec, weights=self.span.weights,
            cache_tokens_left=int(self.cache_tokens_left),
            busy=round(load.busy, 4), batch_rows=round(load.batch_rows, 3), rows_per_s=round(load.rows_per_s, 3),
            queued_rows=load.queued_rows,
        )]

    def kv_lengths(self) -> dict[str, int]:
        """KV length of every open session (for stats and tests)."""
        return {f"{sid}@{start}": s.cache.length for (sid, start), s in self.sessions.items()}

    # --- compute ----------------------------------------------------------

    def _run_span(
        self, span: SpanModule, hidden: np.ndarray, start_pos: int, cache: Any, parents: tuple[int, ...] | None = None,
        commit: int | None = None, keep: tuple[int, ...] | None = None,
    ) -> np.ndarray:
        out = span.step(torch.from_numpy(hidden).unsqueeze(0), start_pos, cache, commit=commit, parents=parents, keep=keep)
        return cpu_rows(out)  # cross in the compute dtype, widen on the CPU

    def _window(self, session: Session, hidden: np.ndarray, msg: Forward, commit: int | None) -> np.ndarray:
        """The rows one window sends down: the span's output, or a faulty peer's lie (after the same honest step)."""
        def honest() -> np.ndarray:
            return self._run_span(session.span, hidden, msg.start, session.cache, msg.parents, commit, msg.keep)

        return honest() if session.lies is None else session.lies.step(session.span, hidden, honest)

    async def measure_throughput(self, tokens: int = 1, repeats: int = 3) -> float:
        """Decode-step tokens per second of this span on its device and dtype, measured on a scratch cache
        (the copy back to the CPU in `_run_span` waits for the device, so the time is the real one)."""
        cache = self.span.new_cache()
        hidden = np.random.default_rng(0).standard_normal((tokens, self.hidden_size)).astype(np.float32)

        def step(i: int) -> None:
            self._run_span(self.span, hidden, i * tokens, cache)

        self.throughput = await measure_throughput(step, self.batcher.compute, tokens=tokens, repeats=repeats)
        return self.throughput

    # --- protocol ---------------------------------------------------------

    async def serve(self, upstream: FramedStream, remote: str, first: OpenSession) -> None:
        """Run one session from its `OpenSession` until close, error, idle timeout, EOF or shutdown."""
        me = self.node.peer_id
        try:
            session = await self._open(first, remote)
        except SessionError as exc:
            log.info("refused session %s from %s: %s", first.session, remote, exc.message)
            self.metrics.refused(exc.code)
            await send_quietly(upstream, Error(exc.code, exc.message, first.session, exc.blame or me))
            await close_quietly(upstream)
            return
        session.upstream = upstream
        if self.closing:  # opened while shutdown was cancelling the others: end it the same way
            session.scope.cancel()
        log.info("session %s open from %s (max_len %d, last hop %s)", session.id, remote, session.max_len, session.last_hop)
        self.metrics.sessions_opened.inc()
        try:
            async with trio.open_nursery() as nursery:
                if not session.last_hop:
                    nursery.start_soon(self._relay_back, session)
                nursery.start_soon(watch_upstream, self.node, remote, session.liveness, self.limits, session.scope)
                try:
                    await upstream.send(Ack(session.id, 0, session.links))
                    with session.scope:
                        await self._session_loop(session)
                    if session.scope.cancelled_caught and session.liveness.lost is not None:
                        log.info("session %s ended: %s", session.id, session.liveness.lost)
                        error = Error("unreachable", f"{me}: {session.liveness.lost}", session.id, remote)
                        self.metrics.error(error.code)
                        await send_quietly(session.downstream, error)
                    elif session.scope.cancelled_caught:
                        error = Error("draining", f"{me}: this peer is leaving the swarm", session.id, me)
                        self.metrics.error(error.code)
                        await send_quietly(session.upstream, error)
                        await send_quietly(session.downstream, error)
                except (SessionError, SessionRuleError) as exc:
                    log.info("session %s ended with error: %s", session.id, exc.message)
                    # Both ways: upstream relays it to the head, downstream carries it along the ring,
                    # so the head hears the cause before it sees the return leg close.
                    blame = exc.blame if isinstance(exc, SessionError) else None
                    error = Error(exc.code, f"{me}: {exc.message}", session.id, blame or me)
                    self.metrics.error(error.code)
                    await send_quietly(session.upstream, error)
                    await send_quietly(session.downstream, error)
                except ProtocolError as exc:
                    log.info("session %s: bad frame from upstream: %s", session.id, exc)
                    self.metrics.error(exc.code)
                    await send_quietly(session.upstream, Error(exc.code, f"{me}: {exc}", session.id, me))
                except (EOFError, LinkError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    log.info("session %s upstream gone: %r", session.id, exc)
                    self.metrics.error("unreachable")
                    await send_quietly(session.downstream, Error(
                        "unreachable", f"{me}: upstream {remote} went away ({type(exc).__name__})", session.id, remote
                    ))
                except Exception as exc:
                    log.exception("session %s failed", session.id)
                    self.metrics.error("internal")
                    await send_quietly(session.upstream, Error("internal", f"{type(exc).__name__}: {exc}", session.id, me))
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._release(session)
            await close_quietly(session.downstream)
            self.metrics.untrack(session.downstream)
            await close_quietly(session.upstream)
            if session.upstream is not upstream:
                await close_quietly(upstream)
            if session.handover is not None:
                session.handover.close()

    async def _open(self, msg: OpenSession, remote: str) -> Session:
        if self.closing:
            raise SessionError("draining", "this peer is leaving the swarm: open the session on another peer")
        if msg.model != self.model_id:
            raise SessionError("bad_request", f"this peer serves model {self.model_id!r}, not {msg.model!r}")
        if not self.start <= msg.start < msg.end <= self.end:
            raise SessionError(
                "bad_request", f"this peer serves blocks {self.start}:{self.end}, not {msg.start}:{msg.end}"
            )
        key = (msg.session, msg.start)
        if key in self.ledger:
            raise SessionError("bad_request", f"session {msg.session} is already open here for block {msg.start}")
        if not msg.route:
            raise SessionError("bad_request", "route is empty: it must end with the head")
        self.ledger.admit(key, remote, msg.max_len)
        try:
            downstream, nxt, links = await self._open_next_hop(msg)
        except BaseException:
            self.ledger.release(key)
            raise
        self.metrics.track(downstream)
        span = self._span_for(msg.start, msg.end)
        state = SessionState(msg.session, msg.max_len, self.limits.max_window)
        session = Session(state, span, span.new_cache(msg.max_len), downstream, nxt.start == nxt.end, nxt.peer_id, remote,
                          next_start=nxt.start, handover=Handover(remote), mover=LegMover(self.node, nxt.peer_id, nxt.addrs),
                          links=links, lies=self.fault.session() if self.fault else None)
        self.sessions[key] = session
        return session

    async def _open_next_hop(self, msg: OpenSession) -> tuple[FramedStream, Hop, tuple[str, ...]]:
        """Open the stream to the route's next hop: the head (last hop) gets an Ack, a peer the rest of the route.
        Also how the legs from here to the head travel (this one's link, then those the next hop reported)."""
        nxt: Hop = msg.route[0]
        further: tuple[str, ...] = ()
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                downstream = await self.node.open(nxt.peer_id, nxt.addrs, INFER_PROTOCOL)
                if nxt.start == nxt.end:
                    await downstream.send(Ack(msg.session, 0))
                else:
                    await downstream.send(
                        OpenSession(msg.session, msg.model, nxt.start, nxt.end, msg.max_len, tuple(msg.route[1:]))
                    )
                    reply = await downstream.receive()
                    if isinstance(reply, Error):
                        await close_quietly(downstream)
                        raise SessionError(
                            reply.code, f"next hop {nxt.peer_id}: {reply.message}", reply.blame or nxt.peer_id
                        )
                    if not isinstance(reply, Ack):
                        await close_quietly(downstream)
                        raise SessionError(
                            "bad_request", f"next hop answered {type(reply).__name__}, expected Ack", nxt.peer_id
                        )
                    further = reply.links
        except SessionError:
            raise
        except Exception as exc:  # timeout, refused connection, reset, bad frame
            raise SessionError(
                "unreachable", f"cannot open the next hop {nxt.peer_id}: {type(exc).__name__}: {exc}", nxt.peer_id
            ) from exc
        return downstream, nxt, (self.node.link_kind(nxt.peer_id, downstream) or "direct", *further)

    def _span_for(self, start: int, end: int) -> SpanModule:
        """The served span or a weight-sharing sub-span of it (a route may use part of our layers)."""
        if (start, end) not in self._subspans:
            self._subspans[(start, end)] = self.span.sub(start, end)
        return self._subspans[(start, end)]

    async def drain(self, drain_s: float, now: trio.Event, shutdown_s: float) -> None:
        """Leave the swarm without failing anyone: refuse new sessions ("draining": heads go elsewhere, blaming no one),
        let the open ones finish for up to `drain_s` (or until `now` is set), then `shutdown` what is left."""
        self.closing = True
        if self.sessions:
            log.warning("draining: refusing new sessions; %d open may finish within %.0f s (signal again to end them "
                        "now)", len(self.sessions), drain_s)
            with trio.move_on_after(drain_s):
                async with trio.open_nursery() as waiting:
                    async def cut_short() -> None:
                        await now.wait()
                        waiting.cancel_scope.cancel()

                    waiting.start_soon(cut_short)
                    await self.ledger.wait_empty()
                    waiting.cancel_scope.cancel()
            if self.sessions:
                log.warning("drained: ending the %d sessions still open (their heads fail over)", len(self.sessions))
            else:
                log.warning("drained: every session finished")
        await self.shutdown(shutdown_s)

    async def shutdown(self, deadline_s: float) -> None:
        """Refuse new sessions, let windows being computed finish, then end every session with an error."""
        self.closing = True
        with trio.move_on_after(deadline_s):
            async with self.batcher.compute:  # waits for the window in the worker thread, if any
                pass
        for session in list(self.sessions.values()):
            session.scope.cancel()
        with trio.move_on_after(min(5.0, deadline_s)):
            await self.ledger.wait_empty()

    def _release(self, session: Session) -> None:
        key = (session.id, session.span.start)
        self.sessions.pop(key, None)
        if self.ledger.release(key):
            log.info("session %s closed after %d windows", session.id, session.windows)

    async def _relay_back(self, session: Session) -> None:
        """Carry errors and moved legs' news from the next hop back toward the head (on from the new stream when the leg
        to the next hop moved)."""
        while True:
            stream = session.downstream
            try:
                while True:
                    msg = await stream.receive()
                    if isinstance(msg, (Error, Moved)) and session.upstream is not None:
                        await session.upstream.send(msg)
            except (EOFError, ProtocolError, LinkError, trio.BrokenResourceError, trio.ClosedResourceError):
                if session.downstream is stream:
                    return
                await close_quietly(stream)  # the old leg, ended by the next hop after our Move

    async def attach(self, stream: FramedStream, remote: str, msg: Attach) -> None:
        """A new stream that takes over a running session's upstream leg (after the `Move` its writer sent on the old
        one): hand it to the session, held until the session is done with it; anything else is refused."""
        session = self.sessions.get((msg.session, msg.start)) if msg.start is not None else None
        if session is not None and session.handover is not None and await session.handover.give(stream, remote):
            return
        log.info("refused an attach to session %s at %s from %s", msg.session, msg.start, remote)
        self.metrics.refused("unknown_session")
        await send_quietly(stream, Error("unknown_session", f"no session {msg.session!r} at block {msg.start} that "
                                         f"{remote} may attach to", msg.session, self.node.peer_id))
        await close_quietly(stream)

    async def _take_upstream(self, session: Session) -> None:
        """After a `Move`: read on from the stream that attaches (the old one is done)."""
        assert session.handover is not None and session.upstream is not None
        old = session.upstream
        try:
            session.upstream = await session.handover.take(ATTACH_TIMEOUT_S)
        except trio.TooSlowError as exc:
            raise SessionError("unreachable", f"upstream {session.remote} moved the session, but no stream attached "
                               f"within {ATTACH_TIMEOUT_S:.0f} s", session.remote) from exc
        await close_quietly(old)
        log.info("session %s: the leg from %s moved to a %s link", session.id, session.remote,
                 self.node.link_kind(session.remote, session.upstream))

    async def _move_down(self, session: Session) -> None:
        """Move the leg to the next hop onto a direct stream (see `dsd.discovery.handover`), and tell the head."""
        assert session.mover is not None
        attach = Attach(session.id, None if session.last_hop else session.next_start)
        try:
            with trio.fail_after(self.limits.send_timeout_s):
                new = await session.mover.move(session.downstream, session.id, attach)
        except Exception as exc:
            raise SessionError("unreachable", f"next hop {session.next_peer} unreachable while moving the leg: "
                               f"{type(exc).__name__}: {exc}", session.next_peer) from exc
        if new is None:
            return
        self.metrics.untrack(session.downstream)
        self.metrics.track(new)
        session.downstream = new  # the old one is closed by `_relay_back` once the next hop has ended it
        link = self.node.link_kind(session.next_peer, new) or "direct"
        if session.upstream is not None:
            await send_quietly(session.upstream, Moved(session.id, self.node.peer_id, link))

    async def _session_loop(self, session: Session) -> None:
        while True:
            assert session.upstream is not None
            msg = await receive_within(session.upstream, self.limits.idle_timeout_s)  # EOF: the upstream went away
            session.liveness.heard()
            if isinstance(msg, Forward):
                await self._forward(session, msg)
            elif isinstance(msg, Truncate):
                session.cache.truncate(session.state.truncate(msg.session, msg.length))
                await self._send_down(session, msg if not session.last_hop else Ack(session.id, msg.length))
            elif isinstance(msg, Error):
                log.info("session %s: error from upstream passed along: %s", session.id, msg.message)
                await send_quietly(session.downstream, msg)
                return
            elif isinstance(msg, Move):
                session.state.check(msg.session)
                await self._take_upstream(session)
            elif isinstance(msg, CloseSession):
                session.state.check(msg.session)
                if not session.last_hop:
                    await send_quietly(session.downstream, msg)
                return
            else:
                raise SessionError("bad_request", f"unexpected {type(msg).__name__} in an open session")

    def _hidden(self, msg: Forward) -> np.ndarray:
        """The window's hidden states as float32 [tokens, hidden], or SessionError('bad_tensor')."""
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
        peak = float(np.abs(hidden).max()) if self.span.dtype == torch.float16 and hidden.size else 0.0
        if peak > FLOAT16_MAX:  # a float16 peer would compute on inf
            raise SessionError(
                "bad_tensor", f"hidden states reach {peak:.4g}, beyond the float16 range ({FLOAT16_MAX:g}) this peer "
                "computes in; serve with --dtype bfloat16 or float32",
            )
        return np.ascontiguousarray(hidden, dtype=np.float32)

    async def _forward(self, session: Session, msg: Forward) -> None:
        """Run one window (a chain, or a token tree with `parents`) after committing the previous one:
        truncate to `commit`, or keep the accepted path `keep` of it; then pass it down the ring."""
        length = session.state.begin(msg.session, msg.epoch, msg.start, msg.commit, msg.keep)
        if length is None:
            log.debug("session %s: dropped window of stale epoch %d < %d", session.id, msg.epoch, session.state.epoch)
            return
        hidden = self._hidden(msg)
        session.state.extend(hidden.shape[0], msg.parents)
        commit = msg.commit if msg.keep else length  # begin checked a kept path against the last window
        window = SpanWindow(torch.from_numpy(hidden).unsqueeze(0), msg.start, session.cache, commit, msg.parents,
                            msg.keep)
        lie = None if session.lies is None else partial(self._window, session, hidden, msg, commit)
        job = Job(session.span, window, alone=lie, ahead=msg.ahead, owner=session.id)
        out = await self.batcher.run(job)
        self.metrics.observe_forward(hidden.shape[0], job.seconds, job.batch, msg.ahead)
        session.windows += 1
        self.windows_served += 1
        self.rows_served += int(hidden.shape[0])
        wire = self.wire.encode(out)
        open_now = {sid for sid, _ in self.sessions}
        load = min(msg.load + self.batcher.meter.load(session.id, open_now), float(DEFAULT_LIMITS.max_route))
        reply: Message = (
            Result(session.id, msg.epoch, msg.start, wire, load)  # a row per node, in window order
            if session.last_hop
            else Forward(session.id, msg.epoch, msg.start, msg.commit, wire, msg.parents, msg.keep, msg.ahead, load)
        )
        await self._send_down(session, reply)

    async def _send_down(self, session: Session, msg: Message) -> None:
        if isinstance(msg, (Forward, Result)) and session.mover is not None and session.mover.wants_move(session.downstream):
            await self._move_down(session)
        try:
            with trio.fail_after(self.limits.send_timeout_s):
                await session.downstream.send(msg)
        except Exception as exc:  # timeout, reset stream, peer gone
            raise SessionError(
                "unreachable", f"next hop {session.next_peer} unreachable: {type(exc).__name__}: {exc}", session.next_peer
            ) from exc
