"""The `dsd-node` command line: one parser, one module per subcommand group."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

# Each module defines `register(subparsers)` and owns one group of subcommands.
COMMAND_MODULES: tuple[str, ...] = (
    "cmd_store",  # convert, store inspect, store verify
    "cmd_models",  # models prepare
    "cmd_daemon",  # start, route
    "cmd_testnet",  # testnet up/down/status
    "cmd_generate",  # generate
    "cmd_workers",  # workers (federated mode)
    "cmd_demo",  # demo: the main job end to end
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsd-node",
        description="Peer-to-peer LLM inference with decentralized speculative decoding.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(f"dsd.node.{name}") is not None:
            importlib.import_module(f"dsd.node.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
