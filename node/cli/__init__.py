"""The dsd-node command line: argparse adapters that parse, call one library function, print."""

from .main import main

__all__ = ["main"]
