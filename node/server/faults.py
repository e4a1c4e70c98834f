"""Faulty block peers: a peer that returns wrong hidden states on purpose, for tests and demos only.

A `Fault` is chosen with `dsd-node start --faulty MODE` (hidden) or `testnet up --faulty INDEX:MODE`.
Every lie keeps the honest shape and dtype, so a receiver cannot tell it by its form:

- `noise`: the honest rows plus Gaussian noise of std 0.5 x each row's RMS (relative L2 ~0.5 per row); `noise:S`
  with std S x the RMS instead (relative L2 ~S: `noise:0.04` hides below a tolerance sized for bfloat16);
- `skip-layer`: what the span computes without its last layer (a 1-layer span: its input);
- `identity`: the input rows unchanged;
- `stale`: the session's previous window's rows (trimmed, or the last one repeated); its first window is honest;
- `int4`: every Linear weight of the span fake-quantized to 4 bits at load (`replace_linear_weights` with `int4_weight`), so all windows use them;
- `intermittent:F`: `noise` on a share F of the windows, drawn independently per window.

The KV cache always takes the honest step (`FaultySession.step` runs it first), so commits, kept paths of
token trees and truncations stay exactly as on an honest peer; only the rows sent down the ring lie.
Torch is imported only where a lie needs it: `parse_fault` is light enough for `--help` and `testnet status`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from dsd.shard_store import SpanModule

MODES = ("noise", "noise:S", "skip-layer", "identity", "stale", "int4", "intermittent:F")
NOISE_SCALE = 0.5  # std of the noise, relative to each row's RMS
INT4_GROUP = 32  # input columns sharing one absmax scale
INT4_LEVELS = 7  # symmetric 4-bit: integers -7..7


@dataclass(frozen=True)
class Fault:
    """How a faulty peer lies: a mode of `MODES`, for `intermittent` the share of windows that lie, and the std of
    the noise relative to each row's RMS."""

    mode: str
    share: float = 1.0
    scale: float = NOISE_SCALE

    def __str__(self) -> str:
        if self.mode == "intermittent":
            return f"intermittent:{self.share:g}"
        return f"noise:{self.scale:g}" if self.mode == "noise" and self.scale != NOISE_SCALE else self.mode

    def prepare(self, span: SpanModule) -> None:
        """Change the loaded span once, before it serves (`int4` quantizes its weights; other modes leave it)."""
        if self.mode == "int4":
            replace_linear_weights(span, int4_weight)

    def session(self, seed: int | None = None) -> FaultySession:
        """A session's lying state (its previous rows, its random draws; `seed` for reproducible tests)."""
        return FaultySession(self, np.random.default_rng(seed))


def parse_fault(text: str) -> Fault:
    """A `--faulty` value as a Fault; ValueError naming the allowed modes when it is none of them."""
    allowed = ", ".join(MODES)
    mode, sep, arg = text.strip().partition(":")
    bounds = {"intermittent": ("F", "a share 0 < F <= 1", 1.0), "noise": ("S", "a relative noise 0 < S <= 10", 10.0)}
    if mode in bounds and sep:
        name, need, top = bounds[mode]
        try:
            value = float(arg)
        except ValueError:
            value = float("nan")
        if not 0.0 < value <= top:
            raise ValueError(f"{mode}:{name} needs {need}, got {text!r} (allowed modes: {allowed})")
        return Fault("intermittent", value) if mode == "intermittent" else Fault("noise", scale=value)
    if sep or mode not in MODES:
        raise ValueError(f"unknown fault {text!r}: allowed modes are {allowed}")
    return Fault(mode)


@dataclass
class FaultySession:
    """One session's lies: the honest step always runs on the cache, then the rows it returns are replaced."""

    fault: Fault
    rng: np.random.Generator
    previous: np.ndarray | None = None  # the last window's honest rows (`stale`)
    lies: int = 0  # windows answered with a lie so far

    def step(self, span: SpanModule, hidden: np.ndarray, honest: Callable[[], np.ndarray]) -> np.ndarray:
        """The rows to send for one window: `honest()` runs the real step (cache included), then the lie
        in the span's compute dtype, shaped like the honest rows."""
        mode = self.fault.mode
        if mode == "skip-layer":
            with last_layer_input(span) as seen:
                honest()
            return self._told(seen[-1][0].to("cpu").float().numpy())
        out = honest()
        if mode == "int4":  # the weights lie (quantized at load): every window does
            return self._told(out)
        previous, self.previous = self.previous, out
        if mode == "noise" or (mode == "intermittent" and self.rng.random() < self.fault.share):
            return self._told(in_dtype(add_noise(out, self.rng, self.fault.scale), span.dtype))
        if mode == "identity":
            return self._told(in_dtype(hidden, span.dtype))
        if mode == "stale" and previous is not None:
            return self._told(fit_rows(previous, out.shape[0]))
        return out

    def _told(self, rows: np.ndarray) -> np.ndarray:
        """Count a lie and return its rows as contiguous float32 (what the wire codec takes)."""
        self.lies += 1
        return np.ascontiguousarray(rows, dtype=np.float32)


def add_noise(rows: np.ndarray, rng: np.random.Generator, scale: float = NOISE_SCALE) -> np.ndarray:
    """`rows` plus Gaussian noise whose std is `scale` x each row's RMS."""
    rms = np.sqrt(np.mean(np.square(rows, dtype=np.float64), axis=-1, keepdims=True))
    return (rows + rng.standard_normal(rows.shape) * (scale * rms)).astype(np.float32)


def fit_rows(rows: np.ndarray, n: int) -> np.ndarray:
    """The first `n` of `rows`, or all of them followed by the last one repeated up to `n`."""
    if rows.shape[0] >= n:
        return rows[:n]
    return np.concatenate([rows, np.repeat(rows[-1:], n - rows.shape[0], axis=0)])


def in_dtype(rows: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Rows rounded to values of the compute dtype (as honest rows are), back as float32."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(dtype).float().numpy()


@contextlib.contextmanager
def last_layer_input(span: SpanModule) -> Iterator[list[torch.Tensor]]:
    """While open, record what the span's last layer receives: the output of the span without it (for a
    1-layer span, the span's input). A hook on the layer module, removed on exit (sub-spans share it)."""
    seen: list[torch.Tensor] = []

    def hook(_module: object, args: tuple, kwargs: dict) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    handle = span.layers[-1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def replace_linear_weights(span: SpanModule, fake: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Every Linear weight of the span replaced by `fake(weight)`, a new tensor (a store's mmap is never written);
    returns how many. The layer modules keep the new weights, so sub-spans sharing them compute with them too."""
    import torch
    from torch import nn

    count = 0
    with torch.no_grad():
        for module in span.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(fake(module.weight), requires_grad=False)
                count += 1
    return count


def int4_weight(weight: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """`weight` [out, in] rounded to 4-bit levels of a per-(row, group of columns) absmax scale, in its dtype."""
    import torch

    rows, cols = weight.shape
    w = torch.nn.functional.pad(weight.detach().float(), (0, -cols % group)).view(rows, -1, group)
    scale = w.abs().amax(dim=-1, keepdim=True) / INT4_LEVELS
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-INT4_LEVELS, INT4_LEVELS)
    return (q * scale).view(rows, -1)[:, :cols].to(weight.dtype).contiguous()
