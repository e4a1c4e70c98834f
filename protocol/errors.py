"""The wire layer's exceptions: `ProtocolError`, naming the field that was wrong, and its `SessionRuleError`."""

from __future__ import annotations

# Codes a peer can put in an `Error` reply when a ProtocolError ends a stream.
BAD_FRAME = "bad_frame"
VERSION = "version"
LIMIT = "limit"
BAD_TENSOR = "bad_tensor"
BAD_REQUEST = "bad_request"
UNKNOWN_SESSION = "unknown_session"


class ProtocolError(Exception):
    """Malformed, oversized or inconsistent wire data; `.field` names what was wrong, `.code` the Error code."""

    def __init__(self, message: str, field: str | None = None, code: str = BAD_FRAME) -> None:
        self.field = field
        self.code = code
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class SessionRuleError(ProtocolError):
    """A well-formed message that breaks a session rule (see `peer_session.SessionState`); it ends the session.

    `.code` is the `Error` code to answer with (bad_request, limit or unknown_session), `.field`
    the message field at fault and `.message` the human text the peer sends.
    """

    def __init__(self, message: str, field: str, code: str) -> None:
        super().__init__(message, field, code)
