"""The dsd-node command line: argparse adapters that parse, call one library function, print."""

from .main import build_parser, main, run

__all__ = ["build_parser", "main", "run"]
