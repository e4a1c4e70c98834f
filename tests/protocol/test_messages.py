"""Protocol messages: every type round-trips through encode -> chunked feed, and bad values are refused."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.frames import raw_frame, split_at

from dsd.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    CloseSession,
    DraftWindow,
    Error,
    Forward,
    FrameDecoder,
    Hello,
    Hop,
    Limits,
    Message,
    Move,
    Moved,
    OpenSession,
    Ping,
    Pong,
    ProtocolError,
    Result,
    TopKResult,
    Truncate,
    WireTensor,
    encode,
    encode_tensor,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

idents = st.from_regex(r"[a-z0-9_]{1,12}", fullmatch=True)
names = st.text(min_size=1, max_size=24)
texts = st.text(max_size=40)
positions = st.integers(0, 2**31 - 1)
epochs = st.integers(0, 2**63 - 1)
opt_positions = st.none() | positions


@st.composite
def tensors(draw: st.DrawFn) -> WireTensor:
    """A real encoded tensor of random shape, codec and compression."""
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank)))
    codec = draw(st.sampled_from(["raw", "fp16", "bf16", "int8"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(["float32", "float16", "int64", "uint8"])) if codec == "raw" else "float32"
    x = (rng.standard_normal(shape) * 10).astype(dtype)
    return encode_tensor(
        x,
        codec,
        zstd=draw(st.booleans()),
        block=draw(st.integers(1, 70)),
        scale_dtype=draw(st.sampled_from(["fp16", "fp32"])),
    )


hops = st.builds(
    lambda pid, addrs, a, b: Hop(pid, tuple(addrs), min(a, b), max(a, b)),
    names,
    st.lists(texts.filter(bool), max_size=3),
    st.integers(0, 200),
    st.integers(0, 200),
)


@st.composite
def topk_results(draw: st.DrawFn) -> TopKResult:
    """A TopKResult packed from random distributions."""
    n = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 300))
    k = draw(st.integers(1, vocab))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(n)])  # k == vocab exercises the dense codec
    probs = rng.dirichlet(np.ones(vocab), size=n)[:, :k]
    return TopKResult.build(
        draw(names),
        draw(epochs),
        draw(positions),
        ids,
        probs,
        id_codec=draw(st.sampled_from(["varint", "uint32", "auto"])),
        prob_codec=draw(st.sampled_from(["fp16", "fp32", "bf16"])),
        zstd=draw(st.booleans()),
    )


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 64) -> tuple[int, ...]:
    """A random token tree in topological order: each node hangs off an earlier one or the committed token."""
    n = draw(st.integers(1, max_nodes))
    return tuple(draw(st.integers(-1, i - 1)) for i in range(n))


@st.composite
def paths(draw: st.DrawFn) -> tuple[int, ...]:
    """A root-to-node path of a random tree (what a head sends as `keep`)."""
    parents = draw(trees())
    node = draw(st.integers(0, len(parents) - 1))
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return tuple(path[::-1])


@st.composite
def tree_forwards(draw: st.DrawFn) -> Forward:
    """A Forward whose window is a token tree, often committing the accepted path of the last one."""
    parents = draw(trees())
    hidden = encode_tensor(np.ones((len(parents), 3), np.float32) * draw(st.floats(-4, 4)), "raw")
    keep = draw(st.none() | paths())
    return Forward(draw(names), draw(epochs), draw(positions), draw(positions), hidden, parents, keep)


@st.composite
def tree_draft_windows(draw: st.DrawFn) -> DraftWindow:
    """A DraftWindow of a token tree, with `keep` or without."""
    parents = draw(trees())
    tokens = tuple(draw(st.lists(st.integers(0, 151_935), min_size=len(parents), max_size=len(parents))))
    rows = draw(st.none() | st.integers(1, len(parents)))
    return DraftWindow(draw(names), draw(epochs), draw(positions), draw(positions), tokens, draw(st.integers(1, 1000)),
                       draw(st.floats(0, 4, allow_nan=False)), 1.0, rows, parents, draw(st.none() | paths()))


messages = st.one_of(
    st.builds(Hello, st.just(PROTOCOL_VERSION), st.lists(idents, max_size=4).map(tuple), texts, st.lists(idents, max_size=4).map(tuple)),
    st.builds(
        lambda s, m, a, b, ml, r: OpenSession(s, m, min(a, b), max(a, b), ml, tuple(r)),
        names, names, st.integers(0, 100), st.integers(0, 100), st.integers(1, 2**31 - 1), st.lists(hops, max_size=5),
    ),
    st.builds(Forward, names, epochs, positions, opt_positions, tensors()),
    st.builds(Result, names, epochs, positions, tensors()),
    st.builds(Truncate, names, positions),
    st.builds(CloseSession, names),
    st.builds(Ack, names, positions),
    st.builds(Move, names),
    st.builds(Attach, names, opt_positions),
    st.builds(Moved, names, names, idents),
    st.builds(Error, st.sampled_from(["busy", "limit", "unknown_session", "internal"]), texts, st.none() | names, st.none() | names),
    st.builds(Ping, st.integers(0, 2**64 - 1), st.binary(max_size=64)),
    st.builds(Pong, st.integers(0, 2**64 - 1), st.binary(max_size=64)),
    st.builds(
        DraftWindow,
        names, epochs, positions, opt_positions,
        st.lists(st.integers(0, 151_935), min_size=1, max_size=20).map(tuple),
        st.integers(1, 1000),
        st.floats(0, 4, allow_nan=False),
        st.floats(0.01, 1.0),
    ),
    topk_results(),
    tree_forwards(),
    tree_draft_windows(),
)


@SETTINGS
@given(msgs=st.lists(messages, min_size=1, max_size=3), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_messages_round_trip_in_random_chunks(msgs: list[Message], cuts: list[int]) -> None:
    blob = b"".join(encode(m) for m in msgs)
    dec = FrameDecoder()
    out: list[Message] = []
    for piece in split_at(blob, cuts):
        out += dec.feed(piece)
    assert out == msgs
    assert [type(m) for m in out] == [type(m) for m in msgs]
    assert dec.pending == b""


def test_byte_at_a_time_and_pending() -> None:
    msg = Truncate("abc", 7)
    frame = encode(msg)
    dec = FrameDecoder()
    for i, b in enumerate(frame[:-1]):
        assert dec.feed(bytes([b])) == []
        assert dec.pending == frame[: i + 1]
    assert dec.feed(frame[-1:]) == [msg]
    assert dec.pending == b""


def test_frame_layout_is_length_prefixed_msgpack_map() -> None:
    frame = encode(Ack("s1", 12))
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    body = msgpack.unpackb(frame[4:])
    assert body == {"v": PROTOCOL_VERSION, "type": "ack", "session": "s1", "length": 12}


def test_newer_minor_unknown_fields_are_ignored() -> None:
    body = Forward("s", 3, 10, 8, encode_tensor(np.ones((2, 4), np.float32), "raw")).to_wire()
    body["v"] = "1.9"
    body["priority"] = {"nested": [1, 2, 3]}
    body["hidden"]["future_field"] = "x"
    (msg,) = FrameDecoder().feed(raw_frame(body))
    assert msg == Forward("s", 3, 10, 8, encode_tensor(np.ones((2, 4), np.float32), "raw"))


def test_a_window_sent_ahead_says_so_and_one_that_is_not_reads_as_before() -> None:
    """`Forward.ahead` (a window sent on a bet): on the wire only when set, so older peers read every window the
    same; a frame without it decodes as not ahead."""
    hidden = encode_tensor(np.ones((2, 4), np.float32), "raw")
    assert "ahead" not in Forward("s", 3, 10, 8, hidden).to_wire()
    body = Forward("s", 3, 10, 8, hidden, ahead=True).to_wire()
    assert body["ahead"] is True
    (msg,) = FrameDecoder().feed(raw_frame(body))
    assert isinstance(msg, Forward) and msg.ahead
    del body["ahead"]
    (msg,) = FrameDecoder().feed(raw_frame(body))
    assert isinstance(msg, Forward) and not msg.ahead


def test_a_routes_load_rides_windows_and_results_and_a_bad_one_is_refused_by_name() -> None:
    """`Forward.load` / `Result.load` (what one more row costs the others on the hops so far): on the wire only when
    non-zero (older peers read the same frames), a number in [0, max_route]; anything else is a named error."""
    from dsd.protocol import Result

    hidden = encode_tensor(np.ones((2, 4), np.float32), "raw")
    assert "load" not in Forward("s", 3, 10, 8, hidden).to_wire() and "load" not in Result("s", 3, 10, hidden).to_wire()
    for msg in (Forward("s", 3, 10, 8, hidden, load=0.75), Result("s", 3, 10, hidden, load=1.5)):
        (back,) = FrameDecoder().feed(raw_frame(msg.to_wire()))
        assert back == msg and back.load == msg.load
    for bad in (-0.1, float("nan"), 1e6, "0.5", True):
        body = Result("s", 3, 10, hidden).to_wire()
        body["load"] = bad
        with pytest.raises(ProtocolError) as ei:
            FrameDecoder().feed(raw_frame(body))
        assert ei.value.field == "Result.load", (bad, ei.value)


@pytest.mark.parametrize("version", ["2.0", "0.9", "17.1"])
def test_unknown_major_version_is_refused(version: str) -> None:
    body = Ack("s", 1).to_wire()
    body["v"] = version
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(raw_frame(body))
    assert ei.value.field == "v" and ei.value.code == "version"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"epoch": None}, "Forward.epoch"),
        ({"start": -1}, "Forward.start"),
        ({"start": True}, "Forward.start"),
        ({"commit": "3"}, "Forward.commit"),
        ({"session": "x" * 2000}, "Forward.session"),
        ({"session": "x" * 5000}, "frame"),  # beyond what msgpack may even unpack
        ({"hidden": {"dtype": "float32", "shape": [2, 4], "codec": "raw", "zstd": False, "data": b"\0" * 31}}, "Forward.hidden.data"),
        ({"hidden": {"dtype": "float32", "shape": [1, 1, 1, 1, 1], "codec": "raw", "zstd": False, "data": b"\0" * 4}}, "Forward.hidden.shape"),
        ({"hidden": {"dtype": "complex64", "shape": [1], "codec": "raw", "zstd": False, "data": b"\0" * 8}}, "Forward.hidden.dtype"),
        ({"hidden": {"dtype": "float32", "shape": [1], "codec": "int4", "zstd": False, "data": b"\0"}}, "Forward.hidden.codec"),
        ({"hidden": {"dtype": "float32", "shape": [1 << 30], "codec": "raw", "zstd": True, "data": b"x"}}, "Forward.hidden.shape[0]"),
        ({"type": "launch_missiles"}, "type"),
        ({"ahead": 1}, "Forward.ahead"),
    ],
)
def test_bad_fields_are_named(patch: dict, field: str) -> None:
    body = Forward("s", 3, 10, None, encode_tensor(np.ones((2, 4), np.float32), "raw")).to_wire()
    for key, value in patch.items():
        if value is None:
            del body[key]
        else:
            body[key] = value
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(raw_frame(body))
    assert ei.value.field == field
    assert field in str(ei.value)


def test_construction_validates() -> None:
    t = encode_tensor(np.zeros((1, 4), np.float32), "raw")
    with pytest.raises(ProtocolError, match="Forward.start"):
        Forward("s", 0, -1, None, t)
    with pytest.raises(ProtocolError, match="Forward.epoch"):
        Forward("s", True, 0, None, t)
    with pytest.raises(ProtocolError, match="Forward.hidden"):
        Forward("s", 0, 0, None, np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="Truncate.session"):
        Truncate("", 3)
    with pytest.raises(ProtocolError, match="OpenSession.start"):
        OpenSession("s", "m", 5, 4, 10, ())
    with pytest.raises(ProtocolError) as ei:
        OpenSession("s", "m", 0, 4, 10, tuple(Hop("p", (), 0, 0) for _ in range(33)))
    assert ei.value.field == "OpenSession.route" and ei.value.code == "limit"
    with pytest.raises(ProtocolError, match=r"hop.start"):
        Hop("p", (), 5, 2)
    with pytest.raises(ProtocolError, match="DraftWindow.tokens"):
        DraftWindow("s", 0, 0, None, (), 8, 1.0)
    with pytest.raises(ProtocolError, match="DraftWindow.temperature"):
        DraftWindow("s", 0, 0, None, (1,), 8, float("nan"))
    with pytest.raises(ProtocolError, match="DraftWindow.top_p"):
        DraftWindow("s", 0, 0, None, (1,), 8, 1.0, top_p=0.0)
    with pytest.raises(ProtocolError, match="Hello.version"):
        Hello("one", (), "m", ())
    with pytest.raises(ProtocolError, match=r"Hello.roles\[0\]"):
        Hello("1.0", ("has space",), "m", ())
    with pytest.raises(ProtocolError, match="Ping.payload"):
        Ping(1, b"x" * (Limits().max_payload + 1))
    with pytest.raises(ProtocolError, match="Truncate.session"):
        Truncate("\ud800", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Truncate("s", 3).length = 4  # type: ignore[misc]


def test_lists_become_tuples_and_messages_hash() -> None:
    msg = OpenSession("s", "m", 0, 4, 10, [Hop("p", ["/ip4/127.0.0.1/tcp/1"], 0, 0)])  # type: ignore[arg-type]
    assert isinstance(msg.route, tuple) and isinstance(msg.route[0].addrs, tuple)
    assert msg.route[0].is_head
    assert hash(msg) == hash(OpenSession("s", "m", 0, 4, 10, (Hop("p", ("/ip4/127.0.0.1/tcp/1",), 0, 0),)))


def test_error_message_is_cut_not_refused() -> None:
    err = Error("internal", "boom " * 1000, "s")
    assert len(err.message) == Limits().max_str
    assert FrameDecoder().feed(encode(err)) == [err]


def test_error_blame_is_optional_on_the_wire_and_checked() -> None:
    err = Error("unreachable", "A: next hop B unreachable", "s", "B")
    assert FrameDecoder().feed(encode(err)) == [err]
    body = err.to_wire()
    assert body["blame"] == "B"
    del body["blame"]  # an older peer sends none
    assert FrameDecoder().feed(raw_frame(body)) == [Error("unreachable", "A: next hop B unreachable", "s")]
    for bad in (7, "", "x" * (Limits().max_str + 1)):
        body["blame"] = bad
        with pytest.raises(ProtocolError) as ei:
            FrameDecoder().feed(raw_frame(body))
        assert ei.value.field == "Error.blame"
    with pytest.raises(ProtocolError, match="Error.blame"):
        Error("internal", "boom", None, "")


def test_limits_apply_on_both_sides() -> None:
    small = Limits(max_frame_bytes=64, max_route=1)
    big = Ping(1, b"x" * 100)
    with pytest.raises(ProtocolError) as ei:
        encode(big, small)
    assert ei.value.field == "frame" and ei.value.code == "limit"
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(small).feed(encode(big)[:4])
    assert ei.value.field == "frame_length"
    two_hops = OpenSession("s", "m", 0, 1, 8, (Hop("a", (), 1, 2), Hop("h", (), 0, 0)))
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(Limits(max_route=1)).feed(encode(two_hops))
    assert ei.value.field == "OpenSession.route"


def test_decoder_stays_failed_after_an_error() -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError):
        dec.feed(b"\x00\x00\x00\x00")
    with pytest.raises(ProtocolError):
        dec.feed(encode(Ack("s", 1)))


def test_topk_result_checks_its_parts() -> None:
    r = TopKResult.build("s", 0, 0, np.array([[5, 1, 9]]), np.array([[0.5, 0.2, 0.1]]))
    with pytest.raises(ProtocolError, match="TopKResult.probs"):
        TopKResult("s", 0, 0, 4, r.ids, r.probs)
    with pytest.raises(ProtocolError, match="TopKResult.ids"):
        TopKResult("s", 0, 0, 3, r.ids[:-1], r.probs)
    with pytest.raises(ProtocolError, match="TopKResult.ids"):
        TopKResult("s", 0, 0, 3, r.ids, r.probs, id_codec="uint32")
    ids, p = r.arrays()
    assert ids.tolist() == [[5, 1, 9]]
    np.testing.assert_allclose(p, [[0.5, 0.2, 0.1]], rtol=2**-11)


def _tree_forward(**patch: object) -> bytes:
    """A 3-row Forward frame with `patch` applied to its wire map (as a hostile peer would send it)."""
    body = Forward("s", 3, 10, 8, encode_tensor(np.ones((3, 4), np.float32), "raw")).to_wire()
    body.update(patch)
    return raw_frame(body)


def test_tree_fields_round_trip_and_default_to_a_chain() -> None:
    hidden = encode_tensor(np.ones((4, 4), np.float32), "raw")
    tree = Forward("s", 1, 7, 5, hidden, [-1, 0, 0, 2], [0, 1])  # type: ignore[arg-type]
    assert (tree.parents, tree.keep) == ((-1, 0, 0, 2), (0, 1))
    body = tree.to_wire()
    assert (body["parents"], body["keep"]) == ([-1, 0, 0, 2], [0, 1])
    assert FrameDecoder().feed(encode(tree)) == [tree]
    chain = Forward("s", 1, 7, 5, hidden)
    assert (chain.parents, chain.keep) == (None, None)
    old = chain.to_wire()
    del old["parents"], old["keep"]  # a 1.0 peer sends neither
    assert FrameDecoder().feed(raw_frame(old)) == [chain]
    window = DraftWindow("s", 0, 3, 3, (5, 6, 7), 8, 0.0, parents=(-1, -1, 1), keep=(2,))
    assert FrameDecoder().feed(encode(window)) == [window]


@pytest.mark.parametrize(
    ("patch", "field", "code"),
    [
        ({"parents": [-1, 0, 7]}, "Forward.parents[2]", "bad_request"),  # index out of range
        ({"parents": [-1, 2, 0]}, "Forward.parents[1]", "bad_request"),  # forward reference
        ({"parents": [-1, 1, 0]}, "Forward.parents[1]", "bad_request"),  # its own parent: a cycle
        ({"parents": [0, -1, 0]}, "Forward.parents[0]", "bad_request"),
        ({"parents": [-1, -2, 0]}, "Forward.parents[1]", "bad_request"),
        ({"parents": [-1, True, 0]}, "Forward.parents[1]", "bad_request"),
        ({"parents": [-1, 0.0, 0]}, "Forward.parents[1]", "bad_request"),
        ({"parents": "-1 0 1"}, "Forward.parents", "bad_request"),
        ({"parents": []}, "Forward.parents", "bad_request"),
        ({"parents": [-1] * 65}, "Forward.parents", "limit"),  # before the 65 entries are even looked at
        ({"parents": [-1, 0]}, "Forward.parents", "bad_request"),  # 2 parents for 3 hidden rows
        ({"keep": [0, 64]}, "Forward.keep[1]", "bad_request"),
        ({"keep": [-1]}, "Forward.keep[0]", "bad_request"),
        ({"keep": []}, "Forward.keep", "bad_request"),
        ({"keep": [0] * 65}, "Forward.keep", "limit"),
        ({"keep": [0, 1], "commit": None}, "Forward.keep", "bad_request"),
        ({"keep": {"0": 1}}, "Forward.keep", "bad_request"),
    ],
)
def test_bad_trees_are_refused_naming_the_index(patch: dict, field: str, code: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(_tree_forward(**patch))
    assert (ei.value.field, ei.value.code) == (field, code)


def test_tree_checks_apply_at_build_and_under_the_decoders_limits() -> None:
    hidden = encode_tensor(np.ones((3, 4), np.float32), "raw")
    with pytest.raises(ProtocolError, match=r"Forward.parents\[2\]: 3 is not -1 or an earlier node in \[0, 2\)"):
        Forward("s", 0, 0, None, hidden, (-1, 0, 3))
    with pytest.raises(ProtocolError, match="Forward.parents: 2 parents for a window of 3 hidden rows"):
        Forward("s", 0, 0, None, hidden, (-1, 0))
    with pytest.raises(ProtocolError, match="Forward.parents: a tree window needs hidden"):
        Forward("s", 0, 0, None, encode_tensor(np.ones(3, np.float32), "raw"), (-1, 0, 1))
    with pytest.raises(ProtocolError, match="Forward.keep: keep needs commit"):
        Forward("s", 0, 0, None, hidden, None, (0,))
    with pytest.raises(ProtocolError, match="DraftWindow.parents: 1 parents for a window of 2 tokens"):
        DraftWindow("s", 0, 0, None, (1, 2), 4, 0.0, parents=(-1,))
    with pytest.raises(ProtocolError, match=r"DraftWindow.keep\[0\]"):
        DraftWindow("s", 0, 4, 3, (1, 2), 4, 0.0, keep=(True,))
    batched = Forward("s", 0, 0, None, encode_tensor(np.ones((1, 3, 4), np.float32), "raw"), (-1, 0, 0))
    assert batched.parents == (-1, 0, 0)

    five = encode(Forward("s", 0, 0, 0, encode_tensor(np.ones((5, 4), np.float32), "raw"), (-1,) * 5, (0,)))
    small = Limits(max_tree_nodes=4)
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(small).feed(five)
    assert (ei.value.field, ei.value.code) == ("Forward.parents", "limit")
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(small).feed(_tree_forward(keep=[0, 1, 2, 4]))
    assert ei.value.field == "Forward.keep[3]"
    with pytest.raises(ValueError, match="max_tree_nodes"):
        Limits(max_tree_nodes=2048)


def test_ack_links_round_trip_and_an_ack_without_them_keeps_its_old_wire_form() -> None:
    ack = Ack("s1", 0, ("hole-punched", "relayed", "direct"))
    assert msgpack.unpackb(encode(ack)[4:])["links"] == ["hole-punched", "relayed", "direct"]
    assert FrameDecoder().feed(encode(ack)) == [ack]
    assert "links" not in msgpack.unpackb(encode(Ack("s1", 0))[4:])
    with pytest.raises(ProtocolError):
        Ack("s1", 0, ("no spaces allowed",)).validate(Limits())


def test_moving_a_leg_names_its_session_and_a_bad_link_or_start_is_refused() -> None:
    assert FrameDecoder().feed(encode(Attach("s1"))) == [Attach("s1", None)]  # None: the return leg into the head
    assert msgpack.unpackb(encode(Attach("s1", 7))[4:]) == {"v": PROTOCOL_VERSION, "type": "attach", "session": "s1",
                                                           "start": 7}
    with pytest.raises(ProtocolError, match="start"):
        Attach("s1", -1)
    with pytest.raises(ProtocolError, match="link"):
        Moved("s1", "peer", "over the moon")
    with pytest.raises(ProtocolError, match="session"):
        Message.from_wire({"v": PROTOCOL_VERSION, "type": "move"})
