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


# --- token trees -------------------------------------------------------------------------------

TREE = (-1, 0, 0, 1, -1)  # depth 3: node 3 sits two below node 0; node 4 is a second root


def after_tree(start: int = 5, max_len: int = 16) -> SessionState:
    """A session holding `start` committed tokens plus the tree TREE appended after them."""
    s = state(length=start, max_len=max_len, max_window=8)
    assert s.forward("s", 0, start, None, len(TREE), parents=TREE) == start
    assert s.length == start + len(TREE)
    return s


def test_a_tree_window_appends_every_node_and_is_remembered_for_keep() -> None:
    s = after_tree()
    assert s.begin("s", 0, 8, 5, keep=(0, 1, 3)) == 8  # the accepted path: 3 rows kept after commit 5
    assert (s.length, s.window) == (8, None)  # a window is kept once
    assert s.forward("s", 0, 8, None, 2) == 8 and s.length == 10


@pytest.mark.parametrize(("keep", "length"), [((4,), 6), ((0, 2), 7), ((0,), 6)])
def test_keep_accepts_every_root_to_node_path(keep: tuple[int, ...], length: int) -> None:
    s = after_tree()
    assert s.begin("s", 1, length, 5, keep) == length
    assert (s.length, s.epoch) == (length, 1)


@pytest.mark.parametrize(
    ("keep", "field", "text"),
    [
        ((0, 1, 2), "keep[2]", "2 is not a child of node 1 (its parent is 0)"),
        ((1,), "keep[0]", "1 is not a child of the committed token (its parent is 0)"),
        ((0, 3), "keep[1]", "3 is not a child of node 0 (its parent is 1)"),
        ((0, 0), "keep[1]", "0 is not a child of node 0"),
        ((0, 5), "keep[1]", "5 is outside the last window's nodes [0, 5)"),
        ((4, 4), "keep[1]", "4 is not a child of node 4"),
    ],
)
def test_keep_that_is_not_a_path_is_refused_naming_the_index(keep: tuple[int, ...], field: str, text: str) -> None:
    s = after_tree()
    error = refused(lambda: s.begin("s", 0, 5 + len(keep), 5, keep), "bad_request", field, text)
    assert error.message.startswith(f"{field}: ")  # peers send the message alone: it names the index
    assert s.length == 10 and s.window is not None  # refused: nothing moved, the window can still be kept


def test_keep_must_name_the_last_window_by_its_start_and_start_after_the_path() -> None:
    s = after_tree()
    refused(lambda: s.begin("s", 0, 6, 4, (0, 1)), "bad_request", "commit",
            "keep needs commit = 5 (the last window's start), got 4")
    refused(lambda: s.begin("s", 0, 6, None, (0,)), "bad_request", "keep", "keep needs commit")
    refused(lambda: s.begin("s", 0, 7, 5, (0, 1, 3)), "bad_request", "start", "window starts at 7 but 8 tokens are cached")
    refused(lambda: s.begin("s", 0, 9, 11, (0,)), "bad_request", "commit", "cannot truncate to 11")
    assert s.length == 10 and s.window is not None


def test_keep_on_a_chain_is_a_truncate_and_a_cut_window_cannot_be_kept() -> None:
    s = state(length=3, max_window=8)
    s.forward("s", 0, 3, None, 4)  # a chain: parents -1, 0, 1, 2
    refused(lambda: s.begin("s", 0, 4, 3, (1,)), "bad_request", "keep[0]", "1 is not a child of the committed token")
    assert s.begin("s", 0, 5, 3, (0, 1)) == 5 and s.length == 5

    s = after_tree()
    s.truncate("s", 9)  # cut into the window: its rows are gone
    refused(lambda: s.begin("s", 0, 6, 5, (0,)), "bad_request", "keep", "no window to keep nodes of")
    s = after_tree()
    assert s.begin("s", 0, 7, 7, None) == 7  # commit alone inside the window also cuts it
    refused(lambda: s.begin("s", 0, 6, 5, (0,)), "bad_request", "keep", "no window to keep nodes of")
    s = after_tree()
    s.forward("s", 0, 10, None, 1)  # a newer window replaces it: commit must name the newer one
    refused(lambda: s.begin("s", 0, 6, 5, (0,)), "bad_request", "commit", "keep needs commit = 10")
    refused(lambda: state().begin("s", 0, 1, 0, (0,)), "bad_request", "keep", "no window to keep nodes of")


def test_stale_window_with_a_bad_keep_is_dropped() -> None:
    s = after_tree()
    s.begin("s", 3, 10, None)
    assert s.begin("s", 2, 99, 5, (3, 2, 1)) is None
    assert s.length == 10 and s.window is not None


def test_a_tree_must_fit_max_len_by_depth_and_by_rows() -> None:
    deep = (-1, 0, 1, 2, 3, -1)  # 6 nodes reaching 5 positions
    s = state(length=11, max_len=16, max_window=8)
    assert s.forward("s", 0, 11, None, 5, parents=(-1,) * 5) == 11  # 1 position, 5 rows: 16 fits
    assert s.length == 16
    s = state(length=12, max_len=16, max_window=8)
    error = refused(lambda: s.forward("s", 0, 12, None, 6, parents=deep), "limit", "start", "position 17")
    assert error.message == "position 17 is past the session's max_len 16"
    s = state(length=11, max_len=16, max_window=8)  # positions fit (16), the rows do not
    error = refused(lambda: s.forward("s", 0, 11, None, 6, parents=deep), "limit", "parents", "6 nodes")
    assert error.message == "a tree of 6 nodes needs 17 KV rows, past the session's max_len 16"
    assert (s.length, s.window) == (11, None)
    refused(lambda: state(max_window=8).extend(3, (-1, 0)), "bad_request", "parents", "2 parents for a window of 3 tokens")


def test_explicit_chain_parents_are_remembered_as_a_chain() -> None:
    s = state(max_window=8)
    s.forward("s", 0, 0, None, 3, parents=(-1, 0, 1))
    assert s.window is not None and s.window.parents is None
    assert s.begin("s", 0, 2, 0, (0, 1)) == 2
