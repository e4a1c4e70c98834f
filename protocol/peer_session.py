"""The session rules both serving roles enforce, as a sans-IO state machine over numbers.

A serving peer (block server or federated worker) keeps one `SessionState` per session
next to its KV cache. The state tracks what the cache must hold: the newest `epoch`,
the cached `length` and the session's `max_len`. Each incoming window, truncate or
close is checked against it; a window of an older epoch is dropped silently (it was
in flight when the head rolled back), anything else that breaks a rule raises a
`SessionRuleError` naming the rule, which ends the session. The state never touches
the cache: on acceptance it says what length to keep, and the server applies that.

Token trees: the state remembers the last window (start, nodes, parents) while the cache
still holds all of it, so a `keep` path can be checked against it (see `tree_rules.check_path`).
A tree's positions reach committed length + depth, its KV rows committed length + nodes;
both must fit max_len.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import BAD_REQUEST, LIMIT, UNKNOWN_SESSION, ProtocolError, SessionRuleError
from .tree_rules import check_path, is_chain, positions


@dataclass(frozen=True)
class Window:
    """The last window appended: where it starts, how many nodes, its parents (None = a chain)."""

    start: int
    nodes: int
    parents: tuple[int, ...] | None = None


@dataclass
class SessionState:
    """One session's epoch, cached length and limits; methods accept a message's numbers or raise."""

    id: str
    max_len: int
    max_window: int
    epoch: int = 0
    length: int = 0
    window: Window | None = field(default=None, repr=False)  # the last window, while wholly cached

    def check(self, session: str | None) -> None:
        """A message on this session's stream must name this session."""
        if session != self.id:
            raise SessionRuleError(
                f"unknown session {session!r} on the stream of session {self.id}", "session", UNKNOWN_SESSION
            )

    def begin(
        self, session: str, epoch: int, start: int, commit: int | None, keep: Sequence[int] | None = None
    ) -> int | None:
        """Start a window: None if its epoch is stale (drop it), else the KV length to keep before it (== start).

        With `keep` (the accepted nodes of the last window, root first) that length is commit + len(keep):
        commit must be the last window's start and keep a root-to-node path of it.
        """
        self.check(session)
        if epoch < self.epoch:
            return None
        length = self.length if commit is None else commit
        if length > self.length:
            raise SessionRuleError(
                f"cannot truncate to {length}: only {self.length} tokens are cached", "commit", BAD_REQUEST
            )
        if keep:
            length += len(self._kept(commit, keep))
        if start != length:
            raise SessionRuleError(f"window starts at {start} but {length} tokens are cached", "start", BAD_REQUEST)
        if keep or length < self.length:
            self.window = None  # its rows moved or were dropped: no path of it can be kept any more
        self.epoch, self.length = epoch, length
        return length

    def _kept(self, commit: int | None, keep: Sequence[int]) -> tuple[int, ...]:
        """Check `keep` against the last window (which `commit` must name by its start)."""
        if commit is None:
            raise SessionRuleError("keep needs commit: the start of the window it keeps nodes of", "keep", BAD_REQUEST)
        window = self.window
        if window is None:
            raise SessionRuleError(
                "no window to keep nodes of: it was truncated, kept already or never sent", "keep", BAD_REQUEST
            )
        if commit != window.start:
            raise SessionRuleError(
                f"keep needs commit = {window.start} (the last window's start), got {commit}", "commit", BAD_REQUEST
            )
        try:
            return check_path(window.parents, window.nodes, list(keep))
        except ProtocolError as exc:
            field = exc.field or "keep"  # named in the message too: peers send only the message
            raise SessionRuleError(f"{field}: {exc.message}", field, BAD_REQUEST) from None

    def extend(self, tokens: int, parents: Sequence[int] | None = None) -> int:
        """Append the `tokens` nodes of the window just begun (a tree if `parents`, as a message carries them
        checked); returns the new cached length."""
        if not 0 < tokens <= self.max_window:
            raise SessionRuleError(f"window of {tokens} tokens (allowed 1..{self.max_window})", "tokens", LIMIT)
        if parents is not None and len(parents) != tokens:
            raise SessionRuleError(f"{len(parents)} parents for a window of {tokens} tokens", "parents", BAD_REQUEST)
        reach = self.length + positions(parents, tokens)
        if reach > self.max_len:
            raise SessionRuleError(f"position {reach} is past the session's max_len {self.max_len}", "start", LIMIT)
        end = self.length + tokens
        if end > self.max_len:
            raise SessionRuleError(
                f"a tree of {tokens} nodes needs {end} KV rows, past the session's max_len {self.max_len}",
                "parents",
                LIMIT,
            )
        tree = None if parents is None or is_chain(parents) else tuple(parents)
        self.window = Window(self.length, tokens, tree)
        self.length = end
        return end

    def forward(
        self,
        session: str,
        epoch: int,
        start: int,
        commit: int | None,
        tokens: int,
        *,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> int | None:
        """`begin` then `extend` for a window whose size is known up front: None if stale, else the length to keep."""
        length = self.begin(session, epoch, start, commit, keep)
        if length is not None:
            self.extend(tokens, parents)
        return length

    def truncate(self, session: str, length: int) -> int:
        """Drop cached positions >= length (never grow); returns the new length."""
        self.check(session)
        if length > self.length:
            raise SessionRuleError(
                f"cannot truncate to {length}: only {self.length} tokens are cached", "length", BAD_REQUEST
            )
        if length < self.length:
            self.window = None
        self.length = length
        return length
