"""Hostile input: random bytes, mutated msgpack bodies, truncated and bit-flipped frames, huge claims.

Only ProtocolError may escape the decoder (or decode_tensor / TopKResult.arrays on what it
returns), and oversized claims must be refused before anything of that size is allocated.
About 21,000 generated cases run here: 9,000 from hypothesis and 12,000 from seeded loops.
"""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.frames import raw_frame, split_at

from dsd.protocol import (
    Ack,
    CloseSession,
    DraftWindow,
    Error,
    Forward,
    FrameDecoder,
    Hello,
    Hop,
    Limits,
    Message,
    OpenSession,
    Ping,
    Pong,
    ProtocolError,
    Result,
    TopKResult,
    Truncate,
    WireTensor,
    decode_tensor,
    encode,
    encode_tensor,
    topk_from_probs,
)


def _fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _samples() -> list[Message]:
    rng = np.random.default_rng(7)
    h = rng.standard_normal((3, 16)).astype(np.float32)
    probs = rng.dirichlet(np.ones(300), size=2)
    ids = np.argsort(-probs, axis=1)[:, :12]
    return [
        Hello("1.0", ("head", "block"), "qwen2.5-coder-1.5b", ("zstd", "int8")),
        OpenSession("sess", "m", 0, 14, 512, (Hop("QmPeer", ("/ip4/127.0.0.1/tcp/4001",), 14, 28), Hop("QmHead", (), 0, 0))),
        Forward("sess", 1, 5, 5, encode_tensor(h, "raw")),
        Forward("sess", 2, 8, None, encode_tensor(h, "int8", True, block=8)),
        Result("sess", 2, 8, encode_tensor(h, "fp16")),
        Result("sess", 3, 9, encode_tensor(h, "bf16", True)),
        Truncate("sess", 4),
        CloseSession("sess"),
        Ack("sess", 9),
        Error("busy", "too many sessions", "sess"),
        Error("unreachable", "QmPeer: next hop QmNext unreachable", "sess", "QmNext"),
        Ping(99, b"\x00\x01payload"),
        Pong(2**64 - 1),
        DraftWindow("sess", 0, 3, 3, (151_000, 2, 77), 320, 0.8, 0.95),
        Forward("sess", 4, 9, 5, encode_tensor(h, "fp16"), (-1, 0, 0), (0, 2, 3, 5)),
        DraftWindow("sess", 5, 7, 4, (9, 8, 7, 6), 16, 0.0, 1.0, 2, (-1, 0, -1, 2), (1, 2, 4)),
        TopKResult.build("sess", 0, 3, ids, np.take_along_axis(probs, ids, axis=1)),
        TopKResult.build("sess", 0, 3, ids, np.take_along_axis(probs, ids, axis=1), id_codec="uint32", prob_codec="fp32", zstd=True),
        TopKResult.build("sess", 0, 3, *topk_from_probs(probs[:, :40], 40)),
    ]


SAMPLES = _samples()
FRAMES = [encode(m) for m in SAMPLES]
STREAM = b"".join(FRAMES)


def _use(msg: Message) -> None:
    """Touch everything a consumer would decode from a message; only ProtocolError may come out."""
    encode(msg)
    for value in vars(msg).values():
        if isinstance(value, WireTensor):
            decode_tensor(value)
    if isinstance(msg, TopKResult):
        msg.arrays()


def _survive(chunks: list[bytes], limits: Limits | None = None) -> list[Message] | None:
    """Feed chunks; return the messages, or None if a ProtocolError ended the stream."""
    dec = FrameDecoder(limits or Limits())
    out: list[Message] = []
    try:
        for chunk in chunks:
            out += dec.feed(chunk)
    except ProtocolError as exc:
        assert exc.field is None or isinstance(exc.field, str)
        return None
    for msg in out:
        try:
            _use(msg)
        except ProtocolError:
            pass
    return out


@_fuzz(2000)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 400), max_size=5))
def test_random_bytes(data: bytes, cuts: list[int]) -> None:
    _survive(split_at(data, cuts))


@_fuzz(500)
@given(body=st.binary(min_size=1, max_size=300))
def test_random_bodies_with_valid_headers(body: bytes) -> None:
    _survive([len(body).to_bytes(4, "big") + body])


leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from(["1.0", "2.0", "1.99", "raw", "int8", "float32", "varint", ""])
)
values = st.recursive(
    leaves, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=12
)


def _mutate(wire: dict[str, Any], draw: st.DrawFn) -> None:
    """Replace, add or delete a key at the top level or inside a nested map (tensor, hop)."""
    target: Any = wire
    nested = [k for k, v in wire.items() if isinstance(v, dict) or (isinstance(v, list) and v and isinstance(v[0], dict))]
    if nested and draw(st.booleans()):
        inner = wire[draw(st.sampled_from(nested))]
        target = inner[0] if isinstance(inner, list) else inner
    key = draw(st.sampled_from(sorted(target) + ["extra"]))
    if draw(st.integers(0, 4)) == 0:
        target.pop(key, None)
    else:
        target[key] = draw(values)


@_fuzz(1000)
@given(data=st.data())
def test_mutated_message_maps(data: st.DataObject) -> None:
    wire = SAMPLES[data.draw(st.integers(0, len(SAMPLES) - 1))].to_wire()
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate(wire, data.draw)
    _survive([raw_frame(wire)])


tree_items = st.integers(-3, 70) | st.integers(-(2**63), 2**64 - 1) | st.booleans() | st.floats() | st.none() | st.text(max_size=3)
small_trees = st.integers(1, 5).flatmap(lambda n: st.tuples(*(st.integers(-1, i - 1) for i in range(n))).map(list))
tree_values = (
    small_trees  # fits a sample's 3 or 4 rows now and then
    | small_trees.flatmap(lambda t: st.integers(0, len(t) - 1).flatmap(
        lambda i: tree_items.map(lambda x: t[:i] + [x] + t[i + 1 :])))  # one entry wrong
    | st.lists(st.integers(-2, 70), max_size=70)
    | st.lists(tree_items, max_size=8)
    | st.just([-1] * 65)
    | st.just(list(range(-1, 64)))
    | st.none()
    | values
)


def _tree_sample(draw: st.DrawFn) -> tuple[Message, dict[str, Any]]:
    sample = draw(st.sampled_from([m for m in SAMPLES if isinstance(m, Forward | DraftWindow)]))
    wire = sample.to_wire()
    rows = len(sample.tokens) if isinstance(sample, DraftWindow) else sample.hidden.shape[-2]
    fitting = st.tuples(*(st.integers(-1, i - 1) for i in range(rows))).map(list)
    wire["parents"] = draw(fitting if draw(st.booleans()) else tree_values)
    if draw(st.booleans()):
        wire["keep"] = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5) if draw(st.booleans()) else tree_values)
    if draw(st.integers(0, 3)) == 0:
        wire["commit"] = None
    return sample, wire


@_fuzz(1500)
@given(data=st.data())
def test_fuzzed_tree_fields_decode_only_to_valid_trees(data: st.DataObject) -> None:
    """Random parents / keep values: a ProtocolError, or a window whose tree holds every wire rule."""
    sample, wire = _tree_sample(data.draw)
    try:
        (msg,) = FrameDecoder().feed(raw_frame(wire))
    except ProtocolError as exc:
        assert exc.code in ("bad_request", "limit", "bad_frame") and exc.field
        assert exc.field.startswith(type(sample).__name__)
        return
    assert isinstance(msg, Forward | DraftWindow)
    rows = len(msg.tokens) if isinstance(msg, DraftWindow) else msg.hidden.shape[-2]
    if msg.parents is not None:
        assert 1 <= len(msg.parents) <= 64 and len(msg.parents) == rows
        assert all(type(p) is int and -1 <= p < i for i, p in enumerate(msg.parents))
    if msg.keep is not None:
        assert msg.commit is not None and 1 <= len(msg.keep) <= 64
        assert all(type(r) is int and 0 <= r < 64 for r in msg.keep)
    assert FrameDecoder().feed(encode(msg)) == [msg]
    event("decoded")


@_fuzz(1500)
@given(i=st.integers(0, len(FRAMES) - 1), cut=st.integers(0, 10**6), follow=st.booleans())
def test_truncated_frames(i: int, cut: int, follow: bool) -> None:
    frame = FRAMES[i]
    part = frame[: cut % len(frame)]
    dec = FrameDecoder()
    assert dec.feed(part) == []
    assert dec.pending == part
    if follow:  # the stream goes on with another frame glued to the stump: must not crash
        _survive([part, FRAMES[(i + 1) % len(FRAMES)]])


@_fuzz(2000)
@given(
    i=st.integers(0, len(FRAMES) - 1),
    flips=st.lists(st.integers(0, 10**7), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 10**4), max_size=4),
)
def test_bit_flipped_frames(i: int, flips: list[int], cuts: list[int]) -> None:
    frame = bytearray(FRAMES[i])
    for f in flips:
        frame[(f // 8) % len(frame)] ^= 1 << (f % 8)
    _survive(split_at(bytes(frame), cuts))


@_fuzz(500)
@given(size=st.integers(Limits().max_frame_bytes + 1, 2**32 - 1), tail=st.binary(max_size=16))
def test_oversized_headers_are_refused_at_once(size: int, tail: bytes) -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError) as ei:
        dec.feed(size.to_bytes(4, "big") + tail)
    assert ei.value.field == "frame_length" and ei.value.code == "limit"
    assert dec.pending == b""


def test_seeded_random_bytes_sweep() -> None:
    """A plain loop of 4,000 more random byte strings, half of them behind a plausible header."""
    rnd = random.Random(99)
    for i in range(4000):
        body = rnd.randbytes(rnd.randint(1, 200))
        data = len(body).to_bytes(4, "big") + body if i % 2 else body
        _survive(split_at(data, [rnd.randrange(len(data) + 1) for _ in range(2)]))


def test_seeded_mutation_sweep() -> None:
    """A plain loop of 8,000 more mutations (flip, insert, delete, overwrite) over a whole stream."""
    rnd = random.Random(1234)
    decoded = 0
    for _ in range(8000):
        data = bytearray(STREAM)
        for _ in range(rnd.randint(1, 6)):
            op, pos = rnd.randint(0, 3), rnd.randrange(len(data))
            if op == 0:
                data[pos] ^= 1 << rnd.randrange(8)
            elif op == 1:
                data[pos:pos] = rnd.randbytes(rnd.randint(1, 4))
            elif op == 2:
                del data[pos : pos + rnd.randint(1, 4)]
            else:
                data[pos] = rnd.choice([0x00, 0x7F, 0x80, 0xC0, 0xC6, 0xCF, 0xDD, 0xDF, 0xFF])
        out = _survive(split_at(bytes(data), [rnd.randrange(len(data)) for _ in range(3)]))
        decoded += len(out or [])
    assert decoded > 0  # some mutations land in payload bytes and still decode


def test_unmutated_stream_decodes() -> None:
    assert _survive([STREAM]) == SAMPLES


def _peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _raises(fn: Any) -> Any:
    def run() -> None:
        with pytest.raises(ProtocolError):
            fn()

    return run


def test_4gib_header_allocates_nothing() -> None:
    dec = FrameDecoder()
    assert _peak(_raises(lambda: dec.feed(b"\xff\xff\xff\xff"))) < 64 * 1024


@pytest.mark.parametrize(
    "inner",
    [
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G items
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 G pairs
        b"\xc9\xff\xff\xff\xff\x01",  # ext32
        b"\x91" * 5000 + b"\xc0",  # deep nesting
    ],
)
def test_msgpack_claims_inside_a_small_frame(inner: bytes) -> None:
    body = b"\x82\xa1v\xa31.0\xa4type" + inner
    frame = len(body).to_bytes(4, "big") + body
    assert _peak(_raises(lambda: FrameDecoder().feed(frame))) < 256 * 1024


def _bomb(total: int) -> bytes:
    """A zstd stream of `total` zero bytes with no content size in its header."""
    obj = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(1 << 20)
    return b"".join(obj.compress(chunk) for _ in range(total >> 20)) + obj.flush()


BOMB = _bomb(256 << 20)


@pytest.mark.parametrize("elements", [16, 1 << 22])
def test_zstd_bomb_stops_at_the_expected_size(elements: int) -> None:
    t = WireTensor("float32", (elements,), "raw", True, BOMB)
    frame = encode(Forward("s", 0, 0, None, t))
    assert len(frame) < 64 * 1024
    (msg,) = FrameDecoder().feed(frame)
    peak = _peak(_raises(lambda: decode_tensor(msg.hidden)))
    assert peak < 2 * 4 * elements + (2 << 20)


def test_zstd_header_claiming_more_is_refused_without_decompressing() -> None:
    blob = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    assert zstandard.frame_content_size(blob) == 64 << 20
    assert _peak(_raises(lambda: WireTensor("float32", (16,), "raw", True, blob))) < 256 * 1024
