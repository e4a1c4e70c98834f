"""Hostile input against a live block peer: every bad stream gets an Error frame or a closed stream,
the daemon stays up with bounded memory, and a well-behaved session afterwards is still exact.
Also: a peer with an allow-list refuses strangers; SIGTERM shuts a peer down cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import trio
from support.frames import raw_exchange, raw_frame, read_frames
from support.processes import DaemonSwarm, daemon
from support.trees import path_to
from transformers import AutoModelForCausalLM

from dsd.node.peer.host import head_node
from dsd.node.route.errors import RouteError
from dsd.node.route.session import RouteSession, open_route_session
from dsd.node.testnet.processes import pid_alive, stop_processes, wait_ready
from dsd.protocol import Attach, Error, FrameDecoder, Hop, OpenSession, encode, encode_tensor
from dsd.protocol import Forward as Fwd
from dsd.protocol.ids import INFER_PROTOCOL
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
MAX_SESSIONS = 6


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def peer(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A bootstrap node and one peer serving all 5 layers with small limits."""
    state = tmp_path_factory.mktemp("hostile")
    with DaemonSwarm(state) as net:
        info = net.peer("peer", tiny_qwen2_root / "store", "0:5", "--max-sessions", str(MAX_SESSIONS),
                        "--max-len", "64", "--idle-timeout", "30")
        yield {**info, "state": state}


def assert_refused(frames: list) -> Error:
    """Exactly one frame, an Error (the daemon answers every bad opening with one before it closes)."""
    assert len(frames) == 1 and isinstance(frames[0], Error), frames
    return frames[0]


def long_route_open(peer_id: str) -> bytes:
    """An OpenSession whose route has 40 hops (the limit is 32): built by hand, as a hostile client would."""
    body = msgpack.unpackb(encode(OpenSession("s", MODEL, 0, 5, 32, (Hop(peer_id, ("/ip4/127.0.0.1/tcp/1",), 0, 0),)))[4:])
    body["route"] = body["route"] * 40
    return raw_frame(body)


def test_hostile_streams_are_refused_and_the_peer_keeps_serving(peer: dict, tiny_qwen2_root: Path) -> None:
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    hops = [Hop(peer["peer_id"], tuple(peer["addrs"]), 0, 5)]
    outcomes: dict[str, str] = {}
    rss_before = rss_kib(peer["pid"])

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return head.embed(torch.tensor([ids]))[0].numpy()

    async def bad_window(node, legs, label: str, send) -> None:
        async with open_route_session(node, legs, hops, model=MODEL, max_len=32) as session:
            with pytest.raises(RouteError) as info:
                await send(session)
                await session.receive_result(timeout=20)
            outcomes[label] = f"Error {info.value.code}: {info.value}"

    async def main() -> None:
        async with head_node([peer["bootstrap"]]) as (node, legs):
            rng = np.random.default_rng(0)
            raw_cases = {
                "garbage bytes": rng.bytes(256),
                "garbage msgpack body": (16).to_bytes(4, "big") + rng.bytes(16),
                "truncated frame": encode(OpenSession("t", MODEL, 0, 5, 16, tuple(hops)))[:20],
                "4 GiB length header": b"\xff\xff\xff\xff" + b"x" * 16,
                "Forward before OpenSession": encode(Fwd("nope", 0, 0, 0, encode_tensor(np.zeros((1, 64), np.float32), "raw"))),
                "route longer than the limit": long_route_open(node.peer_id),
            }
            for label, data in raw_cases.items():
                error = assert_refused(await raw_exchange(node, peer, INFER_PROTOCOL, data, close_write=True))
                outcomes[label] = f"Error {error.code}: {error.message}"
            assert outcomes["Forward before OpenSession"].startswith("Error bad_request")
            assert outcomes["4 GiB length header"].startswith("Error")

            await bad_window(node, legs, "wrong shape", lambda s: s.send_window(np.zeros((3, 17), np.float32), start=0, commit=0))
            await bad_window(node, legs, "wrong dtype", lambda s: s.send_message(
                Fwd(s.id, 0, 0, 0, encode_tensor(np.zeros((2, 64), np.int32), "raw"))))
            nan = embed([1, 2, 3])
            nan[1, 5] = np.nan
            await bad_window(node, legs, "NaN in hidden states", lambda s: s.send_window(nan, start=0, commit=0))
            await bad_window(node, legs, "position past max_len", lambda s: s.send_window(embed(list(range(3, 40))), start=0, commit=0))
            await bad_window(node, legs, "unknown session", lambda s: s.send_message(
                Fwd("someone-else", 0, 0, 0, encode_tensor(embed([1]), "raw"))))
            await bad_window(node, legs, "start beyond the cache", lambda s: s.send_window(embed([1, 2]), start=7, commit=None))
            for label in ("wrong shape", "wrong dtype", "NaN in hidden states"):
                assert "bad_tensor" in outcomes[label], outcomes[label]
            assert "limit" in outcomes["position past max_len"]
            assert "unknown_session" in outcomes["unknown session"]

            # A flood of session opens: the first MAX_SESSIONS succeed, the rest are refused as busy.
            sessions = []
            refused = 0
            async with trio.open_nursery() as nursery:
                for _ in range(MAX_SESSIONS + 4):
                    s = RouteSession(node, legs, hops, model=MODEL, max_len=8)
                    try:
                        await s.open(nursery)
                        sessions.append(s)
                    except RouteError as exc:
                        assert exc.code == "busy", exc
                        refused += 1
                assert len(sessions) == MAX_SESSIONS and refused == 4
                outcomes["flood of session opens"] = f"{MAX_SESSIONS} opened, {refused} refused busy"
                for s in sessions:
                    await s.close()
            await trio.sleep(0.5)

            # Afterwards a well-behaved session is still exact.
            ids = [1, 17, 42, 99, 5, 6, 7]
            async with open_route_session(node, legs, hops, model=MODEL, max_len=32) as session:
                out = await session.forward(embed(ids), start=0, commit=0)
            with torch.no_grad():
                got = head.logits(torch.from_numpy(out).unsqueeze(0))[0]
                want = reference(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(got, want, atol=1e-4)

    trio.run(main)
    assert pid_alive(peer["pid"])
    rss_after = rss_kib(peer["pid"])
    print("\nhostile outcomes:")
    for label, what in outcomes.items():
        print(f"  {label}: {what}")
    print(f"peer RSS before {rss_before} KiB, after {rss_after} KiB")
    # Measured growth over this sequence: 1148-1164 KiB (3 runs); the bound is the largest + 20 MiB.
    assert rss_after - rss_before < 1_164 + 20_480, (rss_before, rss_after)


def test_a_leg_moves_to_a_new_stream_mid_session_and_only_its_writer_may_move_it(
    peer: dict, tiny_qwen2_root: Path
) -> None:
    """Upgrade in place, its mechanics on a direct link: the head moves its leg to a new stream between two windows
    (`Move` on the old, `Attach` on the new) and the session carries on from the same KV cache, exact; an `Attach`
    from another peer, to a session not here, or to a return leg that is not its own is refused with an Error."""
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    hops = [Hop(peer["peer_id"], tuple(peer["addrs"]), 0, 5)]
    ids = [1, 17, 42, 99, 5, 6, 7, 8, 9]

    def embed(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return head.embed(torch.tensor([tokens]))[0].numpy()

    async def main() -> np.ndarray:
        async with head_node([peer["bootstrap"]]) as (node, legs), head_node([peer["bootstrap"]]) as (other, _):
            async with open_route_session(node, legs, hops, model=MODEL, max_len=32) as session:
                first = await session.forward(embed(ids[:5]), start=0, commit=0)
                stranger = [
                    Attach(session.id, 0),  # someone else's session: refused, the session goes on
                    Attach("not-here", 0),
                ]
                for msg in stranger:
                    refused = assert_refused(await raw_exchange(other, peer, INFER_PROTOCOL, encode(msg)))
                    assert refused.code == "unknown_session", refused
                mine = {"peer_id": node.peer_id, "addrs": node.addrs}
                refused = assert_refused(await raw_exchange(other, mine, INFER_PROTOCOL, encode(Attach(session.id))))
                assert refused.code == "unknown_session", refused
                old = session._stream
                await session.move_first_leg()
                assert session._stream is not old and session.moves == [{"from": node.peer_id, "link": "direct"}]
                second = await session.forward(embed(ids[5:]), start=5, commit=5)
                return np.concatenate([first, second])

    out = trio.run(main)
    with torch.no_grad():
        got = head.logits(torch.from_numpy(out).unsqueeze(0))[0]
        want = reference(input_ids=torch.tensor([ids])).logits[0]
    assert torch.allclose(got, want, atol=1e-4)
    assert pid_alive(peer["pid"])
    tails = _log_tails(peer["log"])
    assert any("moved to a direct link" in t for t in tails), tails[-20:]


def raw_forward(session: str, rows: int, **patch: object) -> bytes:
    """A Forward frame of `rows` zero hidden rows at 0 with `patch` applied to its wire map: what a hostile
    head sends (the message classes refuse to build it)."""
    body = Fwd(session, 0, 0, 0, encode_tensor(np.zeros((rows, 64), np.float32), "raw")).to_wire()
    body.update(patch)
    return raw_frame(body)


async def raw_session_exchange(node, legs, peer: dict, session: str, frame: bytes) -> list:
    """Open `session` on a raw infer stream (return leg to this head), then write `frame`: the frames answered."""
    legs.expect(session)
    try:
        stream = await node.open_raw(peer["peer_id"], peer["addrs"], INFER_PROTOCOL)
        decoder = FrameDecoder()
        with trio.fail_after(20):
            head_hop = Hop(node.peer_id, tuple(node.addrs), 0, 0)
            await stream.write(encode(OpenSession(session, MODEL, 0, 5, 32, (head_hop,))))
            got = await read_frames(stream, decoder, replies=1)  # the Ack first, so the bad frame is read inside the session
            await stream.write(frame)
            return got + await read_frames(stream, decoder)
    finally:
        legs.forget(session)


def _log_tails(log: str) -> list[str]:
    """The messages of a daemon log's lines (after 'LEVEL logger: ')."""
    return [line.split(": ", 1)[1] for line in Path(log).read_text().splitlines() if ": " in line]




def test_hostile_trees_are_refused_before_compute(peer: dict, tiny_qwen2_root: Path) -> None:
    """Malformed token trees get Error bad_request (too many nodes: limit) and end only their session;
    the peer then serves a well-formed tree exactly."""
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    hops = [Hop(peer["peer_id"], tuple(peer["addrs"]), 0, 5)]
    outcomes: dict[str, str] = {}
    computed: dict[str, int] = {}  # session id: the windows it ran before its bad one

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return head.embed(torch.tensor([ids]))[0].numpy()

    async def refused(node, legs, label: str, prefix: list[int], send, good_windows: int = 1) -> RouteError:
        """Send `prefix` as a chain (it must succeed), then `send`'s window, which must be refused."""
        async with open_route_session(node, legs, hops, model=MODEL, max_len=32) as session:
            await session.forward(embed(prefix), start=0, commit=0)
            with pytest.raises(RouteError) as info:
                await send(session)
                await session.receive_result(timeout=20)
            computed[session.id] = good_windows
        outcomes[label] = f"Error {info.value.code}: {info.value}"
        return info.value

    async def main() -> None:
        async with head_node([peer["bootstrap"]]) as (node, legs):
            raw_cases = {  # label: (hidden rows, wire fields, code, field named)
                "tree index out of range": (3, {"parents": [-1, 0, 7]}, "bad_request", "Forward.parents[2]"),
                "tree forward reference": (3, {"parents": [-1, 2, 0]}, "bad_request", "Forward.parents[1]"),
                "tree node its own parent": (2, {"parents": [-1, 1]}, "bad_request", "Forward.parents[1]"),
                "too many tree nodes": (65, {"parents": [-1] * 65}, "limit", "Forward.parents"),
                "parents for other rows": (3, {"parents": [-1, 0]}, "bad_request", "Forward.parents"),
                "keep without commit": (1, {"commit": None, "keep": [0]}, "bad_request", "Forward.keep"),
            }
            for i, (label, (rows, patch, code, field)) in enumerate(raw_cases.items()):
                session = f"tree-{i}"
                frames = await raw_session_exchange(node, legs, peer, session, raw_forward(session, rows, **patch))
                assert [type(f).__name__ for f in frames] == ["Ack", "Error"], frames
                error = frames[1]
                outcomes[label] = f"Error {error.code}: {error.message}"
                assert error.code == code and f"{field}:" in error.message, error
                assert error.blame == peer["peer_id"]
                computed[session] = 0

            deep = [-1] + list(range(14))  # 15 nodes, depth 14: positions 20..34 of a 32-token session
            error = await refused(node, legs, "tree deeper than max_len", list(range(3, 23)),
                                  lambda s: s.send_window(embed(list(range(40, 55))), start=20, commit=None, parents=deep))
            assert error.code == "limit" and "position 35 is past the session's max_len 32" in str(error)
            error = await refused(node, legs, "tree rows beyond max_len", list(range(3, 23)),
                                  lambda s: s.send_window(embed(list(range(40, 53))), start=20, commit=None, parents=[-1] * 13))
            assert error.code == "limit" and "a tree of 13 nodes needs 33 KV rows" in str(error)

            async def bad_keep(session, keep: list[int], commit: int) -> None:
                await session.forward(embed([40, 41, 42, 43]), start=4, commit=None, parents=[-1, 0, 0, 1])
                await session.send_window(embed([50]), start=commit + len(keep), commit=commit, keep=keep)

            error = await refused(node, legs, "keep that is not a path", [3, 4, 5, 6], lambda s: bad_keep(s, [0, 3], 4), 2)
            assert error.code == "bad_request" and "keep[1]: 3 is not a child of node 0 (its parent is 1)" in str(error)
            error = await refused(node, legs, "keep of another window", [3, 4, 5, 6], lambda s: bad_keep(s, [0, 1], 3), 2)
            assert error.code == "bad_request" and "keep needs commit = 4" in str(error)

            # The peer still serves trees exactly: every node equals its path run as a chain.
            prefix, parents, tokens = [1, 17, 42, 99, 5], [-1, 0, 0, 1, -1, 4], [6, 7, 8, 9, 10, 11]
            async with open_route_session(node, legs, hops, model=MODEL, max_len=32) as session:
                await session.forward(embed(prefix), start=0, commit=0)
                out = await session.forward(embed(tokens), start=5, commit=None, parents=parents)
            with torch.no_grad():
                got = head.logits(torch.from_numpy(out).unsqueeze(0))[0]
                for leaf in (2, 3, 5):
                    path = path_to(parents, leaf)
                    want = reference(input_ids=torch.tensor([prefix + [tokens[i] for i in path]])).logits[0, len(prefix):]
                    assert torch.allclose(got[path], want, atol=1e-4), leaf

    trio.run(main)
    assert pid_alive(peer["pid"])
    # Refused before any compute: each session ran only its good windows (the peer logs the count at close).
    want = {f"session {sid} closed after {n} windows" for sid, n in computed.items()}
    deadline = time.monotonic() + 10
    while not want <= set(_log_tails(peer["log"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert want <= set(_log_tails(peer["log"])), want - set(_log_tails(peer["log"]))
    print("\nhostile tree outcomes:")
    for label, what in outcomes.items():
        print(f"  {label}: {what}")


def test_allow_list_refuses_strangers(tiny_qwen2_root: Path, tmp_path: Path) -> None:
    """The peer its allow-list names gets a session and a result; a stranger's stream is reset unanswered."""
    from dsd.discovery.identity import load_or_create_identity, peer_id_of

    friend_key = tmp_path / "friend.key"
    friend = peer_id_of(load_or_create_identity(friend_key))
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# only this friend\n{friend}\n")
    p = daemon("private", ["start", "--store", str(tiny_qwen2_root / "store"), "--blocks", "0:5",
                          "--identity", str(tmp_path / "k.key"), "--ready-file", str(tmp_path / "r.json"),
                          "--threads", "1", "--allow-peers", str(allow)], tmp_path)
    head = Store(tiny_qwen2_root / "store").load_head()
    try:
        info = wait_ready(tmp_path / "r.json", p, 120)
        hops = [Hop(info["peer_id"], tuple(info["addrs"]), 0, 5)]

        async def main() -> tuple[str, RouteError]:
            async with head_node([], None, identity=friend_key) as (node, legs):
                assert node.peer_id == friend
                async with open_route_session(node, legs, hops, model=MODEL, max_len=16, open_timeout_s=20) as session:
                    with torch.no_grad():
                        out = await session.forward(head.embed(torch.tensor([[1, 17, 42]]))[0].numpy(), start=0, commit=0)
                assert out.shape == (3, 64)
            async with head_node([], None) as (node, legs):
                with pytest.raises(RouteError) as refused:
                    async with open_route_session(node, legs, hops, model=MODEL, max_len=16, open_timeout_s=20):
                        pass
                return node.peer_id, refused.value

        stranger, error = trio.run(main)
        # Reset at once (not a timeout, not an Error frame from the session layer): the allow-list did it.
        assert error.code == "route" and "opening the route failed" in str(error), error
        reset = f"reset {INFER_PROTOCOL} stream from {stranger}: not in allow_peers"
        deadline = time.monotonic() + 10
        while reset not in _log_tails(p.log) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reset in _log_tails(p.log)
        assert not any(friend in line and "not in allow_peers" in line for line in _log_tails(p.log))
        assert pid_alive(p.pid)
    finally:
        stop_processes([p])


def test_sigterm_shuts_down_cleanly(peer: dict) -> None:
    """Last in this module: the shared peer is stopped."""
    t = time.monotonic()
    os.kill(peer["pid"], signal.SIGTERM)
    while pid_alive(peer["pid"]) and time.monotonic() - t < 20:
        time.sleep(0.1)
    assert not pid_alive(peer["pid"])
    assert "shut down cleanly" in Path(peer["log"]).read_text()

