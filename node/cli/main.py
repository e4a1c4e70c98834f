"""The `dsd-node` command line: one parser, one module per subcommand group.

Import policy: the command modules import only light modules at the top (argparse,
the protocol, settings dataclasses); each command imports the libraries it runs
(torch, transformers, libp2p) when it is called, so `dsd-node --help` and argument
errors answer without loading them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from . import daemon, demo, generate, models, serve, store, testnet, workers

# Each module defines `register(subparsers)` and owns one group of subcommands.
COMMAND_MODULES = (
    store,  # convert, store inspect, store verify
    models,  # models prepare
    daemon,  # start, route
    testnet,  # testnet up/down/status
    generate,  # generate (over a route, or --federated)
    serve,  # serve: the head as an OpenAI-compatible HTTP service
    workers,  # workers (federated mode)
    demo,  # demo: the main job end to end
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsd-node",
        description="Peer-to-peer LLM inference with decentralized speculative decoding.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    # The program itself, for a command that starts copies of it (`testnet up` forks its daemons into it).
    parser.set_defaults(program=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


def run(argv: list[str] | None = None) -> None:
    """The `dsd-node` program: `main`, then leave at once with its exit code.

    When a command returns, its work is done: files written, sessions ended, records withdrawn.
    Finalizing an interpreter that holds torch, transformers and libp2p would only delay the exit
    by one to three seconds, which every `testnet down` (waiting for its daemons) and every
    scripted `generate` would wait for; so flush what is buffered and skip it (os._exit).
    An exception out of `main` takes the normal way out, with its traceback."""
    code = main(argv)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
