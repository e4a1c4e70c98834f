"""The one process every role runs: host (identity + shaper + libp2p + dispatch) and the daemon."""
