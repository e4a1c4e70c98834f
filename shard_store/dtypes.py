"""Names of the weight dtypes a store may hold, and their torch counterparts."""

from __future__ import annotations

import torch

from .errors import StoreError
from .manifest import STORE_DTYPES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in STORE_DTYPES}


def torch_dtype(name: str) -> torch.dtype:
    """Map a store dtype name ("float32", "bfloat16", "float16") to torch; anything else is a StoreError."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise StoreError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The store name of a torch dtype (inverse of torch_dtype)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise StoreError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPES)}")
