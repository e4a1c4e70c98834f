"""Shard-transfer messages (`/dsd/shard/1`): round trips, fields validated and named, hostile frames refused.

Nothing but a sha256 can name a file on this protocol: paths, other strings, wrong lengths and
cases are refused at decode time, before a serving peer ever looks anything up.
"""

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
    FileChunk,
    FileEnd,
    FrameDecoder,
    GetFile,
    GetManifest,
    ManifestData,
    Message,
    ProtocolError,
    encode,
)
from dsd.protocol.limits import MAX_FILE_BYTES, SHARD_CHUNK_BYTES

SETTINGS = settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
SHA = "ab" * 32

shas = st.text("0123456789abcdef", min_size=64, max_size=64)
offsets = st.integers(0, MAX_FILE_BYTES)
messages = st.one_of(
    st.builds(GetManifest, st.text(min_size=1, max_size=40)),
    st.builds(ManifestData, st.text(min_size=1, max_size=40), st.binary(min_size=1, max_size=400)),
    st.builds(lambda s, o, n, c: GetFile(s, min(o, MAX_FILE_BYTES - n), n, c),
              shas, offsets, st.integers(1, 2**32), st.integers(1, SHARD_CHUNK_BYTES)),
    st.builds(FileChunk, shas, offsets, st.binary(min_size=1, max_size=300)),
    st.builds(FileEnd, shas, offsets),
)
SAMPLES: list[Message] = [
    GetManifest("tiny-llama8"),
    ManifestData("tiny-llama8", b'{"format_version": 1}'),
    GetFile(SHA, 0, 148_784),
    GetFile(SHA, 65_536, 8192, 4096),
    FileChunk(SHA, 65_536, b"\x00\x01" * 2048),
    FileEnd(SHA, 73_728),
]
STREAM = b"".join(encode(m) for m in SAMPLES)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=70)
    | st.binary(max_size=40) | st.sampled_from(["../../etc/passwd", "/etc/passwd", SHA.upper(), SHA[:-1], SHA + "0"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _survive(chunks: list[bytes]) -> list[Message] | None:
    dec = FrameDecoder()
    try:
        return [msg for chunk in chunks for msg in dec.feed(chunk)]
    except ProtocolError as exc:
        assert isinstance(exc.field, str | None)
        return None


def test_the_shard_messages_are_in_the_message_table() -> None:
    for cls in (GetManifest, ManifestData, GetFile, FileChunk, FileEnd):
        assert MESSAGE_TYPES[cls.TYPE] is cls


def test_wire_form_is_a_typed_map_and_chunk_defaults_to_the_limit() -> None:
    body = msgpack.unpackb(encode(GetFile(SHA, 3, 9))[4:])
    assert body == {"v": PROTOCOL_VERSION, "type": "get_file", "sha256": SHA, "offset": 3, "length": 9,
                    "chunk": SHARD_CHUNK_BYTES}
    del body["chunk"]  # optional on the wire
    assert FrameDecoder().feed(raw_frame(body)) == [GetFile(SHA, 3, 9)]
    assert FileChunk(SHA, 10, b"abc").end == 13


@SETTINGS
@given(msgs=st.lists(messages, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 10**5), max_size=8))
def test_round_trip_in_random_chunks(msgs: list[Message], cuts: list[int]) -> None:
    stream = b"".join(encode(m) for m in msgs)
    assert _survive(split_at(stream, cuts)) == msgs


@pytest.mark.parametrize(
    "build, field, code",
    [
        (lambda: GetFile("../../etc/passwd", 0, 1), "GetFile.sha256", "bad_frame"),
        (lambda: GetFile(SHA.upper(), 0, 1), "GetFile.sha256", "bad_frame"),
        (lambda: GetFile(SHA[:-1], 0, 1), "GetFile.sha256", "bad_frame"),
        (lambda: GetFile(SHA, -1, 1), "GetFile.offset", "bad_frame"),
        (lambda: GetFile(SHA, 0, 0), "GetFile.length", "bad_frame"),
        (lambda: GetFile(SHA, 0, MAX_FILE_BYTES + 1), "GetFile.length", "limit"),
        (lambda: GetFile(SHA, MAX_FILE_BYTES, 1), "GetFile.length", "limit"),
        (lambda: GetFile(SHA, 0, 1, SHARD_CHUNK_BYTES + 1), "GetFile.chunk", "limit"),
        (lambda: GetFile(SHA, 0, 1, 0), "GetFile.chunk", "bad_frame"),
        (lambda: GetFile(SHA, True, 1), "GetFile.offset", "bad_frame"),
        (lambda: FileChunk(SHA, 0, b""), "FileChunk.data", "bad_frame"),
        (lambda: FileChunk(SHA, 0, b"x" * (SHARD_CHUNK_BYTES + 1)), "FileChunk.data", "limit"),
        (lambda: FileChunk(SHA, 0, "text"), "FileChunk.data", "bad_frame"),
        (lambda: FileEnd(SHA, -5), "FileEnd.end", "bad_frame"),
        (lambda: GetManifest(""), "GetManifest.model", "bad_frame"),
        (lambda: ManifestData("m", b""), "ManifestData.data", "bad_frame"),
        (lambda: ManifestData("m", b"{" * (4 * 2**20 + 1)), "ManifestData.data", "limit"),
    ],
)
def test_construction_names_the_bad_field(build: Any, field: str, code: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        build()
    assert ei.value.field == field and ei.value.code == code


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"sha256": "../../../etc/shadow"}, "GetFile.sha256"),
        ({"sha256": "/" + SHA[1:]}, "GetFile.sha256"),
        ({"sha256": b"\xab" * 32}, "GetFile.sha256"),
        ({"sha256": None}, "GetFile.sha256"),
        ({"offset": 2**63}, "GetFile.offset"),
        ({"offset": 1.5}, "GetFile.offset"),
        ({"length": -1}, "GetFile.length"),
        ({"length": 2**64 - 1}, "GetFile.length"),
        ({"chunk": 2**31}, "GetFile.chunk"),
        ({"type": "get_path"}, "type"),
    ],
)
def test_decoding_names_the_bad_field(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(raw_frame({**GetFile(SHA, 0, 1).to_wire(), **patch}))
    assert ei.value.field == field


def test_a_missing_field_is_refused() -> None:
    body = GetFile(SHA, 0, 1).to_wire()
    del body["length"]
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder().feed(raw_frame(body))
    assert ei.value.field == "GetFile.length"


def test_a_full_chunk_fits_a_frame_and_a_huge_header_allocates_nothing() -> None:
    full = FileChunk(SHA, 0, b"\xee" * SHARD_CHUNK_BYTES)
    assert FrameDecoder().feed(encode(full)) == [full]
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            FrameDecoder().feed(b"\xff\xff\xff\xff")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_the_sample_stream_decodes() -> None:
    assert _survive([STREAM]) == SAMPLES


@SETTINGS
@given(data=st.data())
def test_damaged_streams_only_raise_protocol_errors(data: st.DataObject) -> None:
    damaged = bytearray(STREAM)
    for pos in data.draw(st.lists(st.integers(0, len(STREAM) - 1), min_size=1, max_size=6)):
        damaged[pos] = data.draw(st.integers(0, 255))
    _survive(split_at(bytes(damaged), data.draw(st.lists(st.integers(0, len(STREAM)), max_size=3))))


@SETTINGS
@given(msg=st.sampled_from(SAMPLES), field=st.sampled_from(["sha256", "offset", "length", "chunk", "data", "end",
                                                              "model", "type", "v"]), value=values)
def test_any_field_value_decodes_or_is_refused(msg: Message, field: str, value: Any) -> None:
    """Whatever a field holds, the decoder answers with a valid message or a ProtocolError; a sha256 that
    decodes is 64 lowercase hex characters, never a path."""
    out = _survive([raw_frame({**msg.to_wire(), field: value})])
    if out is None:
        return
    decoded = out[0]
    sha = getattr(decoded, "sha256", None)
    assert sha is None or (len(sha) == 64 and set(sha) <= set("0123456789abcdef"))
    if field in decoded.to_wire() and field not in ("v", "type"):
        assert decoded.to_wire()[field] == value
