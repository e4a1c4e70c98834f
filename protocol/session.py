"""The session rules both serving roles enforce, as a sans-IO state machine over numbers.

A serving peer (block server or federated worker) keeps one `SessionState` per session
next to its KV cache. The state tracks what the cache must hold: the newest `epoch`,
the cached `length` and the session's `max_len`. Each incoming window, truncate or
close is checked against it; a window of an older epoch is dropped silently (it was
in flight when the head rolled back), anything else that breaks a rule raises a
`SessionRuleError` naming the rule, which ends the session. The state never touches
the cache: on acceptance it says what length to keep, and the server applies that.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BAD_REQUEST, LIMIT, UNKNOWN_SESSION, SessionRuleError


@dataclass
class SessionState:
    """One session's epoch, cached length and limits; methods accept a message's numbers or raise."""

    id: str
    max_len: int
    max_window: int
    epoch: int = 0
    length: int = 0

    def check(self, session: str | None) -> None:
        """A message on this session's stream must name this session."""
        if session != self.id:
            raise SessionRuleError(
                f"unknown session {session!r} on the stream of session {self.id}", "session", UNKNOWN_SESSION
            )

    def begin(self, session: str, epoch: int, start: int, commit: int | None) -> int | None:
        """Start a window: None if its epoch is stale (drop it), else the KV length to keep before it (== start)."""
        self.check(session)
        if epoch < self.epoch:
            return None
        keep = self.length if commit is None else commit
        if keep > self.length:
            raise SessionRuleError(
                f"cannot truncate to {keep}: only {self.length} tokens are cached", "commit", BAD_REQUEST
            )
        if start != keep:
            raise SessionRuleError(f"window starts at {start} but {keep} tokens are cached", "start", BAD_REQUEST)
        self.epoch, self.length = epoch, keep
        return keep

    def extend(self, tokens: int) -> int:
        """Append the `tokens` positions of the window just begun; returns the new cached length."""
        if not 0 < tokens <= self.max_window:
            raise SessionRuleError(f"window of {tokens} tokens (allowed 1..{self.max_window})", "tokens", LIMIT)
        end = self.length + tokens
        if end > self.max_len:
            raise SessionRuleError(f"position {end} is past the session's max_len {self.max_len}", "start", LIMIT)
        self.length = end
        return end

    def forward(self, session: str, epoch: int, start: int, commit: int | None, tokens: int) -> int | None:
        """`begin` then `extend` for a window whose size is known up front: None if stale, else the length to keep."""
        keep = self.begin(session, epoch, start, commit)
        if keep is not None:
            self.extend(tokens)
        return keep

    def truncate(self, session: str, length: int) -> int:
        """Drop cached positions >= length (never grow); returns the new length."""
        self.check(session)
        if length > self.length:
            raise SessionRuleError(
                f"cannot truncate to {length}: only {self.length} tokens are cached", "length", BAD_REQUEST
            )
        self.length = length
        return length
