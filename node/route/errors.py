"""How a route fails, as the head sees it."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RouteError(Exception):
    """A route failed: a peer answered with an error, went silent past a deadline, or vanished."""

    def __init__(self, message: str, *, peer: str | None = None, code: str = "route") -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code
