"""`python -m dsd.node.cli`: the dsd-node command line (how the testnet starts its daemons)."""

from .main import run

run()
