"""The store manifest: what model a store holds and the size and sha256 of every file in it."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import StoreError
from .files import atomic_write_bytes, sha256_file

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
EMBED_FILE = "embed.safetensors"
HEAD_FILE = "head.safetensors"
LAYERS_DIR = "layers"
TOKENIZER_DIR = "tokenizer"
# The weight dtypes a store may hold, by name: here, without torch, so that reading a manifest or the
# command line's choices loads no torch (dsd.shard_store.dtypes maps them to torch dtypes).
STORE_DTYPES = ("float32", "bfloat16", "float16")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def layer_file(index: int) -> str:
    """Store-relative path of decoder layer `index`'s weight file."""
    return f"{LAYERS_DIR}/layer_{index:03d}.safetensors"


def check_relpath(relpath: str) -> str:
    """Reject file names that could escape the store directory (absolute, '..', backslashes)."""
    p = PurePosixPath(relpath)
    if not relpath or p.is_absolute() or ".." in p.parts or "\\" in relpath or relpath != str(p):
        raise StoreError(f"manifest: unsafe file path {relpath!r}")
    return relpath


def file_matches(store_dir: Path, relpath: str, entry: dict[str, Any]) -> bool:
    """True when the store's file exists with the manifest entry's size and sha256 (the one integrity check)."""
    path = store_dir / check_relpath(relpath)
    return path.is_file() and path.stat().st_size == entry["size"] and sha256_file(path) == entry["sha256"]


@dataclass
class Manifest:
    """Everything needed to trust and rebuild a stored model: identity, config, dtype, file hashes."""

    format_version: int
    model_id: str
    family: str
    config: dict[str, Any]
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    files: dict[str, dict[str, Any]]
    tokenizer_files: list[str] = field(default_factory=list)
    tied_embeddings: bool = False
    source: str = ""
    eos_token_ids: list[int] = field(default_factory=list)  # every id that ends generation (see writer)
    weights: str = ""  # "" a float store in `dtype`; int8 | int4 | q4k: its layers' linears held quantized (`quant.py`)

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of every file the manifest lists."""
        return sum(int(f["size"]) for f in self.files.values())

    def to_json(self) -> str:
        """Stable JSON text (sorted keys) for writing manifest.json; a float store's reads as before the field."""
        data = asdict(self)
        if not data["weights"]:
            del data["weights"]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def write(self, store_dir: str | Path) -> None:
        """Write manifest.json into store_dir atomically."""
        atomic_write_bytes(Path(store_dir) / MANIFEST_NAME, self.to_json().encode())

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Validate a decoded manifest; every problem is a StoreError naming the field."""
        if not isinstance(data, dict):
            raise StoreError("manifest: top level must be a JSON object")
        expected: dict[str, type | tuple[type, ...]] = {
            "format_version": int,
            "model_id": str,
            "family": str,
            "config": dict,
            "num_layers": int,
            "hidden_size": int,
            "vocab_size": int,
            "dtype": str,
            "files": dict,
        }
        for key, typ in expected.items():
            if key not in data:
                raise StoreError(f"manifest: missing field {key!r}")
            if not isinstance(data[key], typ) or isinstance(data[key], bool) and typ is int:
                raise StoreError(f"manifest: field {key!r} has the wrong type ({type(data[key]).__name__})")
        if data["format_version"] != FORMAT_VERSION:
            raise StoreError(
                f"manifest: format_version {data['format_version']} is not supported (expected {FORMAT_VERSION})"
            )
        if data["dtype"] not in STORE_DTYPES:
            raise StoreError(f"manifest: dtype {data['dtype']!r} is not one of {', '.join(STORE_DTYPES)}")
        for key in ("num_layers", "hidden_size", "vocab_size"):
            if data[key] <= 0:
                raise StoreError(f"manifest: field {key!r} must be positive, got {data[key]}")
        if data["config"].get("num_hidden_layers") != data["num_layers"]:
            raise StoreError("manifest: num_layers does not match config.num_hidden_layers")
        files: dict[str, dict[str, Any]] = {}
        for relpath, entry in data["files"].items():
            check_relpath(relpath)
            if not isinstance(entry, dict):
                raise StoreError(f"manifest: entry for {relpath} must be an object")
            sha, size = entry.get("sha256"), entry.get("size")
            if not isinstance(sha, str) or not _SHA256.match(sha):
                raise StoreError(f"manifest: bad sha256 for {relpath}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise StoreError(f"manifest: bad size for {relpath}")
            files[relpath] = {"sha256": sha, "size": size}
        tokenizer_files = data.get("tokenizer_files", [])
        if not isinstance(tokenizer_files, list) or not all(isinstance(t, str) for t in tokenizer_files):
            raise StoreError("manifest: tokenizer_files must be a list of paths")
        for relpath in tokenizer_files:
            if relpath not in files:
                raise StoreError(f"manifest: tokenizer file {relpath} is not listed in files")
        tied = data.get("tied_embeddings", False)
        if not isinstance(tied, bool):
            raise StoreError("manifest: tied_embeddings must be true or false")
        eos = data.get("eos_token_ids", [])
        if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise StoreError("manifest: eos_token_ids must be a list of token ids")
        weights = data.get("weights", "")
        if weights not in ("", "int8", "int4", "q4k"):
            raise StoreError(f"manifest: weights {weights!r} is not int8, int4 or q4k (or absent: a float store)")
        if weights and data["dtype"] != "bfloat16":
            raise StoreError(f"manifest: a store of {weights} weights computes in bfloat16, not {data['dtype']}")
        required = [EMBED_FILE, HEAD_FILE] + [layer_file(i) for i in range(data["num_layers"])]
        for relpath in required:
            if relpath not in files:
                raise StoreError(f"manifest: weight file {relpath} is not listed in files")
        return cls(
            format_version=data["format_version"],
            model_id=data["model_id"],
            family=data["family"],
            config=data["config"],
            num_layers=data["num_layers"],
            hidden_size=data["hidden_size"],
            vocab_size=data["vocab_size"],
            dtype=data["dtype"],
            files=files,
            tokenizer_files=list(tokenizer_files),
            tied_embeddings=tied,
            source=str(data.get("source", "")),
            eos_token_ids=sorted(set(eos)),
            weights=weights,
        )

    @classmethod
    def read(cls, store_dir: str | Path) -> Manifest:
        """Read and validate STORE/manifest.json."""
        path = Path(store_dir) / MANIFEST_NAME
        if not Path(store_dir).is_dir():
            raise StoreError(f"store directory {store_dir} does not exist")
        if not path.is_file():
            raise StoreError(f"{store_dir} is not a store: no {MANIFEST_NAME} (incomplete conversion?)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"manifest: cannot parse {MANIFEST_NAME}: {exc}") from None
        return cls.from_dict(data)
