"""Model store: checkpoint import, per-layer-span weights, span/head/full loading."""
