"""Finding federated workers: the vocabulary pool key, worker records, the Hello exchange, listing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from dsd.discovery.announce import fetch_records
from dsd.discovery.framing import FramedStream, close_quietly
from dsd.discovery.host import P2PNode
from dsd.discovery.ping import measure_rtt
from dsd.discovery.records import PeerRecord
from dsd.node.head.backend import BackendError
from dsd.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
)
from dsd.protocol.ids import FEDERATED_PROTOCOL

log = logging.getLogger(__name__)


def pool_key(vocab_size: int) -> str:
    """The DHT "model" under which every federated worker of a vocabulary announces (models may differ)."""
    return f"federated/vocab-{int(vocab_size)}"


@dataclass(frozen=True)
class FederatedFailure:
    """Why federated generation cannot go on: the verdict, the message, the workers at fault."""

    verdict: str
    message: str
    blamed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "message": self.message, "blamed": list(self.blamed)}


class FederatedError(BackendError):
    """Federated generation cannot go on: no usable worker, mismatched vocabularies, bad options."""

    failure: FederatedFailure

    def __init__(self, message: str, *, verdict: str = "no_worker", blamed: Sequence[str] = ()) -> None:
        super().__init__(FederatedFailure(verdict, message, list(blamed)))


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


async def exchange_hello(stream: FramedStream) -> dict[str, Any]:
    """Greet a worker as a server on a fresh `/dsd/federated/1` stream; its Hello as `parse_hello` reads it.

    FederatedError if it refuses or answers something else; the deadline is the caller's.
    """
    await stream.send(Hello(PROTOCOL_VERSION, ("server",), "", ()))
    reply = await stream.receive()
    if isinstance(reply, Error):
        raise FederatedError(f"refused Hello: {reply.code}: {reply.message}")
    if not isinstance(reply, Hello):
        raise FederatedError(f"answered Hello with {type(reply).__name__}")
    return parse_hello(reply)


async def describe_worker(node: P2PNode, peer_id: str, addrs: Sequence[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask a worker to describe itself (Hello exchange on `/dsd/federated/1`, no session)."""
    with trio.fail_after(timeout_s):
        stream = await node.open(peer_id, addrs, FEDERATED_PROTOCOL)
        try:
            return await exchange_hello(stream)
        finally:
            await close_quietly(stream)


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


async def list_workers(node: Any, *, model: str | None, vocab: int | None) -> list[dict[str, Any]]:
    """Live federated workers of `model` (or of vocabulary `vocab`), with RTT and (via Hello) their model."""
    infos = await find_workers(node, vocab or 0, model=model)
    rows: list[dict[str, Any]] = []

    async def one(info: Any) -> None:
        row = {"peer_id": info.peer_id, "addrs": list(info.addrs), "model": info.model, "vocab_size": info.vocab_size,
               "topk_cap": info.topk_cap, "num_layers": info.num_layers, "throughput": round(info.throughput, 3),
               "rtt_ms": None}
        try:
            row["rtt_ms"] = round(await measure_rtt(node, info.peer_id, info.addrs) * 1000, 3)
            if info.model is None:
                row["model"] = (await describe_worker(node, info.peer_id, info.addrs))["model"]
        except Exception as exc:  # unreachable, timeout, refused
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)

    async with trio.open_nursery() as nursery:
        for info in infos:
            nursery.start_soon(one, info)
    return sorted(rows, key=lambda r: r["peer_id"])
