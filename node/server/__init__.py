"""Serving heads: the session ledger (limits, admission, KV budget) and the block server."""
