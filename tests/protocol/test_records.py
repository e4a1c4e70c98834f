"""Record-store messages: round trips under RECORDS_LIMITS, validated fields, and hostile frames refused."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.frames import raw_frame, split_at

from dsd.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    RECORDS_LIMITS,
    FrameDecoder,
    Message,
    Ping,
    ProtocolError,
    RecordsFound,
    RecordsGet,
    RecordsPut,
    RecordsStored,
    encode,
)
from dsd.protocol.records import (
    KEY_BYTES,
    MAX_RECORD_BYTES,
    MAX_RECORDS_PER_KEY,
    MAX_RECORDS_PER_PUT,
    RECORDS_FRAME_BYTES,
)

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
KEY = bytes(range(KEY_BYTES))

keys = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)
blobs = st.binary(max_size=300)
messages = st.one_of(
    st.builds(RecordsPut, keys, st.lists(blobs, max_size=MAX_RECORDS_PER_PUT).map(tuple)),
    st.builds(RecordsGet, keys),
    st.builds(RecordsStored, st.integers(0, MAX_RECORDS_PER_PUT)),
    st.builds(RecordsFound, st.lists(blobs, max_size=40).map(tuple)),
)
SAMPLES: list[Message] = [
    RecordsPut(KEY, (b"signed-a", b"signed-b")),
    RecordsGet(KEY),
    RecordsStored(2),
    RecordsFound((b"signed-a", b"\x00" * 100)),
    RecordsFound(()),
]


STREAM = b"".join(encode(m, RECORDS_LIMITS) for m in SAMPLES)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _survive(chunks: list[bytes]) -> list[Message] | None:
    """Feed chunks to a records decoder; the messages, or None when a ProtocolError ended the stream."""
    dec = FrameDecoder(RECORDS_LIMITS)
    try:
        return [msg for chunk in chunks for msg in dec.feed(chunk)]
    except ProtocolError as exc:
        assert isinstance(exc.field, str | None)
        return None


def test_the_record_messages_are_in_the_message_table() -> None:
    for cls in (RecordsPut, RecordsGet, RecordsStored, RecordsFound):
        assert MESSAGE_TYPES[cls.TYPE] is cls


@SETTINGS
@given(msgs=st.lists(messages, min_size=1, max_size=3), cuts=st.lists(st.integers(0, 10**5), max_size=8))
def test_round_trip_in_random_chunks(msgs: list[Message], cuts: list[int]) -> None:
    stream = b"".join(encode(m, RECORDS_LIMITS) for m in msgs)
    assert _survive(split_at(stream, cuts)) == msgs


def test_wire_form_is_a_typed_map() -> None:
    frame = encode(RecordsPut(KEY, (b"r",)), RECORDS_LIMITS)
    assert msgpack.unpackb(frame[4:]) == {"v": PROTOCOL_VERSION, "type": "records_put", "key": KEY, "records": [b"r"]}


def test_the_fullest_reply_fits_a_records_frame_and_no_more() -> None:
    full = RecordsFound((b"\xab" * MAX_RECORD_BYTES,) * MAX_RECORDS_PER_KEY)
    frame = encode(full, RECORDS_LIMITS)
    assert len(frame) - 4 <= RECORDS_FRAME_BYTES
    assert FrameDecoder(RECORDS_LIMITS).feed(frame) == [full]
    with pytest.raises(ProtocolError) as ei:  # one byte more is refused as soon as the header arrives
        FrameDecoder(RECORDS_LIMITS).feed((RECORDS_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert ei.value.field == "frame_length" and ei.value.code == "limit"


@pytest.mark.parametrize(
    "build, field, code",
    [
        (lambda: RecordsGet(KEY[:-1]), "RecordsGet.key", "bad_frame"),
        (lambda: RecordsGet(KEY + b"x"), "RecordsGet.key", "limit"),
        (lambda: RecordsGet("k" * KEY_BYTES), "RecordsGet.key", "bad_frame"),
        (lambda: RecordsPut(KEY, (b"r",) * (MAX_RECORDS_PER_PUT + 1)), "RecordsPut.records", "limit"),
        (lambda: RecordsPut(KEY, (b"x" * (MAX_RECORD_BYTES + 1),)), "RecordsPut.records[0]", "limit"),
        (lambda: RecordsPut(KEY, (b"ok", "text")), "RecordsPut.records[1]", "bad_frame"),
        (lambda: RecordsFound((b"r",) * (MAX_RECORDS_PER_KEY + 1)), "RecordsFound.records", "limit"),
        (lambda: RecordsStored(MAX_RECORDS_PER_PUT + 1), "RecordsStored.stored", "limit"),
        (lambda: RecordsStored(-1), "RecordsStored.stored", "bad_frame"),
        (lambda: RecordsStored(True), "RecordsStored.stored", "bad_frame"),
    ],
)
def test_construction_names_the_bad_field(build: Any, field: str, code: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        build()
    assert ei.value.field == field and ei.value.code == code


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"key": b"short"}, "RecordsPut.key"),
        ({"key": None}, "RecordsPut.key"),
        ({"records": b"not a list"}, "RecordsPut.records"),
        ({"records": [1]}, "RecordsPut.records[0]"),
        ({"records": [b"r"] * (MAX_RECORDS_PER_PUT + 1)}, "RecordsPut.records"),
    ],
)
def test_decoding_names_the_bad_field(patch: dict[str, Any], field: str) -> None:
    wire = {**RecordsPut(KEY, (b"r",)).to_wire(), **patch}
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(RECORDS_LIMITS).feed(raw_frame(wire))
    assert ei.value.field == field


def test_a_missing_field_is_refused() -> None:
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(RECORDS_LIMITS).feed(raw_frame({"v": PROTOCOL_VERSION, "type": "records_found"}))
    assert ei.value.field == "RecordsFound.records"


def test_an_oversized_header_allocates_nothing() -> None:
    dec = FrameDecoder(RECORDS_LIMITS)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            dec.feed(b"\xff\xff\xff\xff")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_bad_msgpack_is_a_protocol_error() -> None:
    for body in (b"\xc1", b"\x92\x01", b"\xdd\xff\xff\xff\xff", b"\x81\xa1v"):
        assert _survive([len(body).to_bytes(4, "big") + body]) is None


def test_the_sample_stream_decodes() -> None:
    assert _survive([STREAM]) == SAMPLES


def test_other_messages_still_decode_under_records_limits() -> None:
    assert FrameDecoder(RECORDS_LIMITS).feed(encode(Ping(3))) == [Ping(3)]


@SETTINGS
@given(data=st.data())
def test_damaged_streams_only_raise_protocol_errors(data: st.DataObject) -> None:
    """Bytes overwritten anywhere in a stream of every record message: messages or a ProtocolError, nothing else."""
    damaged = bytearray(STREAM)
    for pos in data.draw(st.lists(st.integers(0, len(STREAM) - 1), min_size=1, max_size=6)):
        damaged[pos] = data.draw(st.integers(0, 255))
    _survive(split_at(bytes(damaged), data.draw(st.lists(st.integers(0, len(STREAM)), max_size=3))))


@SETTINGS
@given(msg=st.sampled_from(SAMPLES), field=st.sampled_from(["key", "records", "stored", "type", "v"]), value=values)
def test_any_field_value_decodes_or_is_refused(msg: Message, field: str, value: Any) -> None:
    out = _survive([raw_frame({**msg.to_wire(), field: value})])
    if out is not None and field in out[0].to_wire():  # what decodes carries exactly the value sent
        assert out[0].to_wire()[field] == value
