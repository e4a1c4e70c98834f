"""`python -m dsd.node.cli`: the dsd-node command line (how the testnet starts its daemons)."""

import sys

from .main import main

sys.exit(main())
