"""How a route fails, as the head sees it: a fault of one session (`RouteError`), or the route gone (`RouteGaveOut`)."""

from __future__ import annotations

from dsd.node.head.backend import BackendError
from dsd.protocol.route_state import Fault, RouteFailure


class RouteError(Exception):
    """A session of the route failed: a peer answered with an error, a stream ended, a window found no answer."""

    def __init__(self, message: str, *, peer: str | None = None, code: str = "route") -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code

    def fault(self) -> Fault:
        """The failure as the route's state machine takes it."""
        return Fault(self.code, str(self), self.peer)


class RouteGaveOut(BackendError):
    """No route is left for this generation: `failure` (a `RouteFailure`) gives the verdict, the blamed peers and
    every recovery tried."""

    failure: RouteFailure

    def __init__(self, failure: RouteFailure) -> None:
        super().__init__(failure)
