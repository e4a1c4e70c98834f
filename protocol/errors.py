"""The one exception the wire layer raises: `ProtocolError`, naming the field that was wrong."""

from __future__ import annotations

# Codes a peer can put in an `Error` reply when a ProtocolError ends a stream.
BAD_FRAME = "bad_frame"
VERSION = "version"
LIMIT = "limit"
BAD_TENSOR = "bad_tensor"
BAD_REQUEST = "bad_request"


class ProtocolError(Exception):
    """Malformed, oversized or inconsistent wire data; `.field` names what was wrong, `.code` the Error code."""

    def __init__(self, message: str, field: str | None = None, code: str = BAD_FRAME) -> None:
        self.field = field
        self.code = code
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)
