"""Where a role computes: `--device` / `--dtype` names resolved to torch, and how much device memory is free.

`auto` picks the best accelerator torch can use (CUDA, then Apple MPS), else the CPU; dtype
`auto` picks bfloat16 on a CUDA GPU that supports it, float16 on other GPUs and float32 on the
CPU, where float32 is what stays bit-exact against transformers. A device that is not there is
a StoreError with one line saying why and what to use instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dtypes import DTYPES, dtype_name, torch_dtype
from .errors import StoreError
from .quant import QUANT_FORMATS, WeightFormatError, check_weights, compute_dtype, format_of_dtype

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class Placement:
    """A resolved device, compute dtype and span weight format (what `load_head`, `load_span` and `load_full`
    take; `weights` only spans: int8 | int4 pack their linears, `quant.py`)."""

    device: torch.device
    dtype: torch.dtype
    weights: str = ""  # "" = the dtype's float format

    def __post_init__(self) -> None:
        if not self.weights:
            object.__setattr__(self, "weights", format_of_dtype(self.dtype))

    @property
    def dtype_name(self) -> str:
        """The dtype as a store/wire name ("float32", "bfloat16", "float16")."""
        return dtype_name(self.dtype)

    @property
    def quantized(self) -> bool:
        return self.weights in QUANT_FORMATS

    def __str__(self) -> str:
        return f"{self.device} {self.dtype_name}" + (f" ({self.weights} weights)" if self.quantized else "")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """`auto` | `cpu` | `cuda` | `cuda:N` | `mps` (or a torch.device) -> a device torch can use now.

    None means `auto`. `cuda` is the current CUDA device. Anything unknown or absent is a StoreError.
    """
    if isinstance(name, torch.device):
        name = str(name)
    text = "auto" if name is None else str(name).strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "mps":
        if not _mps_available():
            raise StoreError("device 'mps': Apple MPS is not available here; use --device cpu or auto")
        return torch.device("mps")
    kind, _, index = text.partition(":")
    if kind == "cuda" and (not index or index.isdigit()):
        if not torch.cuda.is_available():
            raise StoreError(f"device {text!r}: {_no_cuda_reason()}; use --device cpu or auto")
        count = torch.cuda.device_count()
        n = int(index) if index else torch.cuda.current_device()
        if n >= count:
            raise StoreError(f"device {text!r}: only {count} CUDA device(s) here (cuda:0 to cuda:{count - 1})")
        return torch.device("cuda", n)
    raise StoreError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")


def auto_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a CUDA GPU with bf16 support, float16 on other GPUs, float32 on the CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        return torch.float32
    return torch.float16


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` | `float32` | `bfloat16` | `float16` (or a torch dtype) -> the compute dtype on `device`.

    None means `auto`. bfloat16 on a CUDA GPU without bf16 support is a StoreError.
    """
    if isinstance(name, torch.dtype):
        name = dtype_name(name)
    text = "auto" if name is None else str(name).strip().lower()
    if text == "auto":
        return auto_dtype(device)
    if text not in DTYPES:
        raise StoreError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    dtype = torch_dtype(text)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise StoreError(f"dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16 support; use --dtype float16")
    return dtype


def resolve_placement(device: str | torch.device | None = "auto", dtype: str | torch.dtype | None = "auto",
                      weights: str | None = "auto") -> Placement:
    """The options at once: the device first, then the dtype on it, then the spans' weight format (`--weights`:
    auto = the dtype's; a float format sets the dtype; int8 | int4 compute in bfloat16, on the CPU). A `--dtype`
    that contradicts `--weights` is a StoreError naming both."""
    dev = resolve_device(device)
    if weights in (None, "auto"):
        return Placement(dev, resolve_dtype(dtype, dev))
    try:
        want = compute_dtype(check_weights(weights, dev))
    except WeightFormatError as exc:
        raise StoreError(str(exc)) from None
    if dtype not in (None, "auto") and resolve_dtype(dtype, dev) != want:
        raise StoreError(f"--weights {weights} computes in {dtype_name(want)}, not --dtype {dtype}: leave --dtype out")
    return Placement(dev, want, weights)


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can still get on `device`, when torch (or the OS, for the CPU) can tell; else None."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        mps = getattr(torch, "mps", None)
        if mps is not None and hasattr(mps, "recommended_max_memory"):
            return max(0, int(mps.recommended_max_memory()) - int(mps.current_allocated_memory()))
        return None
    try:  # Linux: MemAvailable counts reclaimable page cache, which the free-page count leaves out
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Hand the pages the C allocator holds free back to the OS (glibc's `malloc_trim(0)`, every arena); whether it
    could. A span loaded in a worker thread (as a peer loads) leaves its temporaries in that thread's arena, which
    glibc keeps: an 8B model's 8-layer q4k span, 1.0 GB of weights, left a peer 0.45 GB more."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
