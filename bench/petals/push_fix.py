"""A Petals 2.2.0.post1 server with server-to-server push working, as on Petals' main branch after that release.

Petals 2.2.0.post1's `rpc_inference` hands `_push_outputs` the metadata of the session's opening request, which
never names the next servers (the client adds `next_servers` from its second step on), so no server ever pushes
its outputs to the next one: the client relays every hop. Petals' main branch later passes each step's metadata.
This wrapper does the same without editing the installed package: it remembers the metadata of the step each
session is computing and gives that to `_push_outputs`. Run with the Petals venv's python, with
`petals.cli.run_server`'s arguments (bench/petals/swarm.py starts servers this way with `push_fix=True`).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any


def patch() -> None:
    """Make `_push_outputs` see the current step's metadata (keyed by session id, one step at a time per session)."""
    from petals.server.handler import TransformerConnectionHandler as Handler

    steps: dict[str, dict[str, Any]] = {}
    iterate, push = Handler._iterate_inference_steps, Handler._push_outputs

    async def iterate_steps(self: Any, first_request: Any, requests: Any, session_id: str | None, *args: Any
                            ) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
        """The handler's own step iterator, noting each step's metadata before the step is computed."""
        try:
            async for request, metadata in iterate(self, first_request, requests, session_id, *args):
                if session_id is not None:
                    steps[session_id] = metadata
                yield request, metadata
        finally:
            steps.pop(session_id, None)

    async def push_outputs(self: Any, request: Any, serialized_outputs: Any, metadata: dict[str, Any]) -> None:
        """Push with the metadata of the step just computed (it names the next servers), not the opening one."""
        await push(self, request, serialized_outputs, steps.get(metadata.get("session_id"), metadata))

    Handler._iterate_inference_steps = iterate_steps
    Handler._push_outputs = push_outputs


def main() -> None:
    """Patch, then run Petals' own server entry point with this process's arguments."""
    patch()
    from petals.cli import run_server

    sys.argv[0] = "petals.cli.run_server"
    run_server.main()


if __name__ == "__main__":
    main()
