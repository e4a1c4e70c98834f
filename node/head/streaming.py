"""Streaming generated text: one streamer for every command and the service.

Accepted tokens arrive in bursts; the text shown so far must never change, so the
streamer emits only complete characters (no trailing U+FFFD of a half-decoded
byte sequence) and holds back any tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .verify import stream_safe_length


class TextStreamer:
    """Turns accepted token ids into text deltas that are final once emitted."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        """Add accepted tokens; returns the new text that is safe to show (may be empty)."""
        self.tokens.extend(int(t) for t in tokens)
        text = self._decode(self.tokens)
        safe = min(len(text.rstrip("\ufffd")), stream_safe_length(text, self.stop_strings))
        if safe <= self.emitted:
            return ""
        delta, self.emitted = text[self.emitted : safe], safe
        return delta

    def finish(self, final_tokens: Sequence[int]) -> str:
        """The rest of the final text (the engine's tokens, already cut at a stop string or EOS)."""
        text = self._decode(final_tokens)
        delta, self.emitted = text[self.emitted :], max(self.emitted, len(text))
        return delta


class RepairGuard:
    """Passes accepted tokens on once each across regenerations: after `rewind(n)` (a generation redone from token n),
    regenerated tokens equal to those already passed on are swallowed; the first that differs stops the passing on,
    since text already shown cannot be taken back (`wrong_from` says from which token it was wrong)."""

    def __init__(self, on_tokens: Callable[[list[int]], None] | None) -> None:
        self.on_tokens = on_tokens
        self.passed: list[int] = []
        self.at = 0  # the token of `passed` the next accepted token stands at
        self.wrong_from: int | None = None

    def push(self, tokens: Sequence[int]) -> None:
        new: list[int] = []
        for t in tokens:
            if self.wrong_from is not None:
                return
            if self.at < len(self.passed):
                if self.passed[self.at] != t:
                    self.wrong_from = self.at
                    return
            else:
                new.append(int(t))
                self.passed.append(int(t))
            self.at += 1
        if new and self.on_tokens is not None:
            self.on_tokens(new)

    def rewind(self, n: int) -> None:
        """The generation goes on from token `n` again."""
        self.at = n
