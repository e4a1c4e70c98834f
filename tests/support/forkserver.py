"""A fork server for the tests' `cli()`: `dsd-node` commands in their own processes, without their imports.

A `dsd-node generate` spends 5-9 s of CPU importing torch, transformers and libp2p before it does
anything, and the suite runs dozens of commands. This server imports them once and forks a child per
command: the child is a real, separate `dsd-node` process (its own pid, files, sockets and exit code;
it starts from the state a fresh interpreter has after those imports, since the server runs nothing
else), and leaves through `dsd.node.cli.run`. Its output goes to files the caller reads.

Protocol on the server's stdin/stdout, one JSON object a line: the caller sends
{"argv", "cwd", "env", "stdout", "stderr", "daemon"} and optionally "netns" (run the child inside that network namespace); the server answers {"pid"} at once and, for a
command (not a daemon), {"pid", "returncode"} when the child has ended (killed children included).
A daemon (`dsd-node start`, `serve`) runs in a session of its own, appending to its log; the server
reaps it whenever it has ended, and its caller stops it like any daemon.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

# What `dsd-node` commands load; imported before the first fork. Nothing here starts a thread.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "libp2p",
    "dsd.node.cli.main",
    "dsd.node.peer.host",
    "dsd.node.peer.loading",
    "dsd.node.head.engine",
    "dsd.node.route.backend",
    "dsd.shard_store.store",
)


def _child(request: dict) -> None:
    """In the forked child: take the request's directory and environment, then run the program as
    `dsd.node.testnet.processes` runs a forked daemon (its files, its session if a daemon); never returns."""
    from dsd.node.cli.main import run
    from dsd.node.testnet.processes import run_in_child

    def program(argv: list[str]) -> None:  # inside run_in_child's guard: any failure ends only this child
        if request.get("netns"):  # a machine of a NAT testbed (dsd.node.testnet.nat_testbed)
            from dsd.node.testnet.nat_testbed import enter_netns

            enter_netns(request["netns"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        run(argv)

    run_in_child(program, request["argv"], request["stdout"], request["stderr"], daemon=request["daemon"])


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """Preload, then run each requested command in a forked child, one at a time, until stdin closes."""
    from dsd.node.testnet.processes import reap_children

    for name in PRELOAD:
        importlib.import_module(name)
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _reply({"pid": pid})
        if not request["daemon"]:
            _, status = os.waitpid(pid, 0)
            _reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
        reap_children()  # ended daemons


if __name__ == "__main__":
    serve()
