"""What serving a span costs in device memory: weights in the compute dtype, the KV budget, activations.

The numbers are upper bounds a peer can refuse on before it loads anything: weights are the stored
files rescaled to the compute dtype, the KV cache is the peer's whole token budget at its dtype
(block peers cap every session's cache at its max_len, so the budget is never exceeded), and the
activations are one window of `window` tokens against `max_len` cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .manifest import EMBED_FILE, HEAD_FILE, layer_file
from .quant import bytes_per_weight

if TYPE_CHECKING:
    from .store import Store

GIB = 2**30


@dataclass(frozen=True)
class SpanMemory:
    """Bytes a span of `layers` layers needs on its device."""

    layers: int
    weights: int
    kv: int
    kv_tokens: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    def describe(self) -> str:
        """E.g. `1.20 GiB weights + 448.0 MiB KV cache (32768 tokens) + 50.0 MiB activations = 1.69 GiB`."""
        return (f"{human_bytes(self.weights)} weights + {human_bytes(self.kv)} KV cache ({self.kv_tokens} tokens) "
                f"+ {human_bytes(self.activations)} activations = {human_bytes(self.total)}")


def human_bytes(n: float) -> str:
    """GiB with two decimals from 1 GiB on, MiB with one below."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _elem(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _dims(store: Store) -> tuple[int, int, int, int, int]:
    """(hidden, intermediate, attention heads, KV heads, head dim) from the stored config."""
    c = store.manifest.config
    hidden = int(c.get("hidden_size", store.manifest.hidden_size))
    heads = int(c.get("num_attention_heads", 1))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    return hidden, int(c.get("intermediate_size", 4 * hidden)), heads, kv_heads, head_dim


def kv_bytes_per_token(store: Store, layers: int, dtype: torch.dtype) -> int:
    """Keys and values of one position over `layers` layers in `dtype`."""
    _, _, _, kv_heads, head_dim = _dims(store)
    return 2 * layers * kv_heads * head_dim * _elem(dtype)


def activation_bytes(store: Store, dtype: torch.dtype, *, window: int, max_len: int) -> int:
    """Peak scratch of one layer's forward over a window of `window` tokens attending to `max_len` positions
    (layers run one after another, so this does not grow with the span)."""
    hidden, inter, heads, kv_heads, head_dim = _dims(store)
    elem = _elem(dtype)
    per_token = 4 * hidden + 3 * inter + (heads + 2 * kv_heads) * head_dim
    scores = heads * window * max_len * max(elem, 4) + window * max_len * elem  # attention weights + the mask
    return window * per_token * elem + scores


def _weight_scale(store: Store, dtype: torch.dtype, weights: str | None) -> float:
    """Held bytes of a layer per stored byte: the compute dtype's, or the weight format's (`quant.bytes_per_weight`);
    a quantized store holds its files' bytes."""
    if store.manifest.weights:
        return 1.0
    return (bytes_per_weight(weights) if weights else _elem(dtype)) / _elem(store.dtype)


def span_memory(
    store: Store, start: int, end: int, dtype: torch.dtype, *, kv_tokens: int = 0, window: int = 0, max_len: int = 0,
    with_head: bool = False, weights: str | None = None,
) -> SpanMemory:
    """What layers [start, end) (plus the head's embeddings and lm_head when `with_head`, in `dtype`) need in `dtype`,
    their weights held in `weights` (default the dtype's float format)."""
    layers_bytes = sum(int(store.manifest.files[f]["size"]) for f in store.span_files(start, end))
    head_bytes = sum(int(store.manifest.files[f]["size"]) for f in ([EMBED_FILE, HEAD_FILE] if with_head else []))
    weights_held = int(layers_bytes * _weight_scale(store, dtype, weights)) + head_bytes * _elem(dtype) // _elem(store.dtype)
    layers = end - start
    return SpanMemory(
        layers=layers,
        weights=weights_held,
        kv=kv_tokens * kv_bytes_per_token(store, layers, dtype),
        kv_tokens=kv_tokens,
        activations=activation_bytes(store, dtype, window=window, max_len=max_len) if window else 0,
    )


def layers_that_fit(
    store: Store, budget_bytes: int, dtype: torch.dtype, *, kv_tokens: int = 0, window: int = 0, max_len: int = 0,
    weights: str | None = None,
) -> int:
    """The most layers (0 to all) whose `span_memory` fits in `budget_bytes`, counting the largest layers first."""
    sizes = sorted((int(store.manifest.files[layer_file(i)]["size"]) for i in range(store.num_layers)), reverse=True)
    scale = _weight_scale(store, dtype, weights)
    kv_per_layer = kv_bytes_per_token(store, 1, dtype) * kv_tokens
    used = activation_bytes(store, dtype, window=window, max_len=max_len) if window else 0
    fit = 0
    for size in sizes:
        used += int(size * scale) + kv_per_layer
        if used > budget_bytes:
            break
        fit += 1
    return fit
