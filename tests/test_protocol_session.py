"""The session rules as a sans-IO state machine: every rule accepted and refused, with the wire code it names."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dsd.protocol import ProtocolError, SessionRuleError, SessionState


def state(length: int = 0, epoch: int = 0, max_len: int = 16, max_window: int = 4) -> SessionState:
    s = SessionState("s", max_len, max_window)
    s.length, s.epoch = length, epoch
    return s


def refused(fn: Callable[[], object], code: str, field: str, text: str) -> SessionRuleError:
    with pytest.raises(SessionRuleError) as info:
        fn()
    assert (info.value.code, info.value.field) == (code, field)
    assert text in info.value.message
    assert isinstance(info.value, ProtocolError)
    return info.value


def test_windows_append_in_order_and_report_the_length_to_keep() -> None:
    s = state()
    assert s.forward("s", 0, 0, None, 3) == 0
    assert (s.length, s.epoch) == (3, 0)
    assert s.forward("s", 0, 3, None, 2) == 3
    assert s.length == 5


def test_commit_truncates_before_the_window() -> None:
    s = state(length=7, epoch=1)
    assert s.forward("s", 2, 5, 5, 3) == 5  # rejected drafts 5, 6 dropped, then 3 new positions
    assert (s.length, s.epoch) == (8, 2)
    assert s.forward("s", 2, 8, 8, 1) == 8  # committing everything cached is allowed


def test_commit_beyond_the_cache_is_refused() -> None:
    s = state(length=4)
    refused(lambda: s.forward("s", 0, 6, 6, 1), "bad_request", "commit", "cannot truncate to 6: only 4 tokens are cached")


@pytest.mark.parametrize(("start", "commit"), [(3, None), (5, None), (4, 2)])
def test_window_must_start_where_the_cache_ends(start: int, commit: int | None) -> None:
    s = state(length=4)
    keep = 4 if commit is None else commit
    error = refused(lambda: s.forward("s", 0, start, commit, 1), "bad_request", "start", "window starts at")
    assert error.message == f"window starts at {start} but {keep} tokens are cached"
    assert (s.length, s.epoch) == (4, 0)  # a refused window leaves the numbers alone


def test_stale_epoch_is_dropped_without_checking_anything_else() -> None:
    s = state(length=4, epoch=3)
    assert s.forward("s", 2, 99, 50, 1000) is None  # would break every rule, but is stale
    assert (s.length, s.epoch) == (4, 3)
    assert s.forward("s", 3, 4, None, 1) == 4  # the same epoch is not stale
    assert s.forward("s", 9, 2, 2, 1) == 2  # a newer one moves the epoch on
    assert (s.length, s.epoch) == (3, 9)


def test_window_size_is_1_to_max_window() -> None:
    assert state().forward("s", 0, 0, None, 4) == 0
    refused(lambda: state().forward("s", 0, 0, None, 5), "limit", "tokens", "window of 5 tokens (allowed 1..4)")
    refused(lambda: state().extend(0), "limit", "tokens", "window of 0 tokens (allowed 1..4)")


def test_positions_stop_at_max_len() -> None:
    s = state(length=13, max_len=16)
    assert s.forward("s", 0, 13, None, 3) == 13 and s.length == 16
    s = state(length=13, max_len=16)
    refused(lambda: s.forward("s", 0, 13, None, 4), "limit", "start", "position 17 is past the session's max_len 16")


def test_begin_then_extend_is_forward_split_around_decoding() -> None:
    s = state(length=2)
    assert s.begin("s", 1, 2, None) == 2
    assert s.extend(3) == 5
    assert (s.length, s.epoch) == (5, 1)
    assert s.begin("s", 0, 5, None) is None


@pytest.mark.parametrize("other", ["t", "", None])
def test_messages_must_name_this_session(other: str | None) -> None:
    s = state(length=2)
    error = refused(lambda: s.forward(other, 0, 2, None, 1), "unknown_session", "session", "unknown session")  # type: ignore[arg-type]
    assert error.message == f"unknown session {other!r} on the stream of session s"
    refused(lambda: s.truncate(other, 0), "unknown_session", "session", "on the stream of session s")  # type: ignore[arg-type]
    refused(lambda: s.check(other), "unknown_session", "session", "unknown session")
    s.check("s")


def test_truncate_shrinks_but_never_grows() -> None:
    s = state(length=6)
    assert s.truncate("s", 6) == 6
    assert s.truncate("s", 2) == 2 and s.length == 2
    refused(lambda: s.truncate("s", 3), "bad_request", "length", "cannot truncate to 3: only 2 tokens are cached")
    assert s.truncate("s", 0) == 0
