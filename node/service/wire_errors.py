"""The API's error object: a request answered with `{"error": {message, type, code, param}}` and its status."""

from __future__ import annotations

from typing import Any


class WireError(Exception):
    """A request answered with an OpenAI error object: `{"error": {message, type, code, param}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> WireError:
    """A 400 naming the field at fault."""
    return WireError(400, message, code=code, param=param)


def retry_headers(status: int) -> dict[str, str]:
    """Client errors but a timeout (408) or a full server (429) tell the `openai` client that retrying will not
    help."""
    return {"x-should-retry": "false"} if 400 <= status < 500 and status not in (408, 429) else {}
