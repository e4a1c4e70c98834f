"""Content-addressed shard transfer over `/dsd/shard/1`: serve a store's files by sha256, fetch a span's files.

`serve` answers manifest and file-range requests from a verified store; `fetch` finds the peers
announcing a model, checks the manifest against its trust root (its sha256), and fetches only
the files a span (and the head) needs from several peers at once, verifying each file before
it is renamed into the local store (`local`). `plan` is the pure bookkeeping of who fetches what.
"""
