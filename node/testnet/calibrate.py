"""Measure t0 — one peer's compute for one decoding step — so the emulated WAN can be set to t1 = ratio·t0."""

from __future__ import annotations

import statistics
import time

import torch

from dsd.shard_store import Store


def measure_t0(
    store: Store, layers: int, *, threads: int = 1, prefill: int = 32, steps: int = 7,
    device: torch.device | None = None, dtype: torch.dtype | None = None, weights: str | None = None,
) -> float:
    """Median seconds of a 1-token decode step through `layers` layers after a short prefill, on `device`
    in `dtype` (default the CPU, the store's dtype), its output copied back to the CPU as a peer does.

    Uses the same thread count, device and dtype as the testnet's peers so the number describes them.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        span = store.load_span(0, max(1, min(layers, store.num_layers)), device=device, dtype=dtype, weights=weights)
        cache = span.new_cache()
        hidden = int(store.manifest.hidden_size)
        gen = torch.Generator().manual_seed(0)
        times = []
        with torch.inference_mode():
            span(torch.randn(1, prefill, hidden, generator=gen), 0, cache)
            for _ in range(steps):
                x = torch.randn(1, 1, hidden, generator=gen)
                t = time.perf_counter()
                span(x, cache.length, cache).to("cpu")  # waits for the device
                times.append(time.perf_counter() - t)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(old)
