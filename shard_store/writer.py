"""Import a checkpoint into a store: one safetensors file per decoder layer plus embed and head files.

The store is written into a staging directory next to `out` and renamed into place at the end,
manifest last, so an interrupted conversion never looks like a finished store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from .dtypes import torch_dtype
from .errors import StoreError
from .families import adapter_for
from .files import atomic_write, sha256_file
from .gguf_source import load_gguf_model
from .manifest import (
    EMBED_FILE,
    FORMAT_VERSION,
    HEAD_FILE,
    MANIFEST_NAME,
    TOKENIZER_DIR,
    Manifest,
    layer_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""progress(what, done, total): called after each file is written."""

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Save tensors (cloned, so none share storage) to a safetensors file atomically."""
    clean = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(clean, str(tmp), metadata={"format": "pt"}))


def _stored_config(model: PreTrainedModel, dtype: str) -> dict[str, Any]:
    """The transformers config as a JSON-safe dict, with the store's dtype recorded."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["dtype"] = dtype
    config.pop("_name_or_path", None)
    return config


# Special tokens that end a generation whatever the config says (llama.cpp marks the same texts as
# end-of-generation): a GGUF carries no generation_config.json, whose eos list often names them.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<|eom_id|>")


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, (list, tuple)) else [value]
    return {int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def tokenizer_end_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's eos and its special end-of-text tokens (`END_OF_TEXT_TOKENS`)."""
    if tokenizer is None:
        return set()
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    special |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return ids | {vocab[t] for t in END_OF_TEXT_TOKENS if t in special and t in vocab}


def eos_token_ids(model: PreTrainedModel, tokenizer: Any = None) -> list[int]:
    """Every id that ends generation: the generation config's eos list, the config's, the tokenizer's eos,
    and the tokenizer's special end-of-text tokens (for GGUF sources, which ship no generation config)."""
    ids = _ids(getattr(model.config, "eos_token_id", None)) | tokenizer_end_ids(tokenizer)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        ids |= _ids(getattr(generation, "eos_token_id", None))
    vocab_size = int(model.config.vocab_size)
    return sorted(i for i in ids if i < vocab_size)


def write_store(
    model: PreTrainedModel,
    out: str | Path,
    *,
    model_id: str,
    tokenizer: Any = None,
    dtype: str = "float32",
    source: str = "",
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Split an in-memory causal LM into a store at `out` and return its manifest.

    `out` must not exist, or be empty, or (with overwrite=True) be an existing store.
    """
    target = torch_dtype(dtype)
    family = str(getattr(model.config, "model_type", ""))
    adapter = adapter_for(family)
    adapter.check_config(model.config)
    num_layers = int(model.config.num_hidden_layers)
    out = Path(out)
    _check_out(out, overwrite)

    groups: dict[str, dict[str, torch.Tensor]] = {EMBED_FILE: {}, HEAD_FILE: {}}
    groups.update({layer_file(i): {} for i in range(num_layers)})
    state = model.state_dict()
    for key, tensor in state.items():
        kind, index, local = adapter.split_key(key)
        if kind == "layer":
            if index is None or index >= num_layers:
                raise StoreError(f"{family}: weight {key!r} names layer {index} but the model has {num_layers}")
            groups[layer_file(index)][local] = tensor
        elif kind == "embed":
            groups[EMBED_FILE]["embed_tokens.weight"] = tensor
        elif kind == "norm":
            groups[HEAD_FILE]["norm.weight"] = tensor
        else:
            groups[HEAD_FILE]["lm_head.weight"] = tensor
    if "embed_tokens.weight" not in groups[EMBED_FILE] or "norm.weight" not in groups[HEAD_FILE]:
        raise StoreError(f"{family}: model has no embedding or final norm weights")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    lm_head = groups[HEAD_FILE].get("lm_head.weight")
    if tied:
        if lm_head is not None and not torch.equal(lm_head, groups[EMBED_FILE]["embed_tokens.weight"]):
            raise StoreError(f"{family}: config says tie_word_embeddings but lm_head differs from the embedding")
        groups[HEAD_FILE].pop("lm_head.weight", None)  # the head reads it from embed.safetensors
    elif lm_head is None:
        raise StoreError(f"{family}: untied model has no lm_head weight")
    for name, tensors in groups.items():
        if not tensors:
            raise StoreError(f"{family}: no weights for {name}")

    with _staging(out) as staging:
        files: dict[str, dict[str, Any]] = {}
        total = len(groups)
        for done, (relpath, tensors) in enumerate(groups.items(), start=1):
            path = staging / relpath
            _save_tensors(path, {k: v.to(target) for k, v in tensors.items()})
            files[relpath] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            if progress is not None:
                progress("weights", done, total)
        tokenizer_files: list[str] = []
        if tokenizer is not None:
            tok_dir = staging / TOKENIZER_DIR
            tokenizer.save_pretrained(str(tok_dir))
            for path in sorted(p for p in tok_dir.rglob("*") if p.is_file()):
                relpath = path.relative_to(staging).as_posix()
                files[relpath] = {"sha256": sha256_file(path), "size": path.stat().st_size}
                tokenizer_files.append(relpath)
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            model_id=model_id,
            family=family,
            config=_stored_config(model, dtype),
            num_layers=num_layers,
            hidden_size=int(model.config.hidden_size),
            vocab_size=int(model.config.vocab_size),
            dtype=dtype,
            files=files,
            tokenizer_files=tokenizer_files,
            tied_embeddings=tied,
            source=source,
            eos_token_ids=eos_token_ids(model, tokenizer),
        )
        _write_manifest(manifest, staging)
    return manifest


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A staging directory beside `out`, renamed into place when the block ends well (manifest last: written
    inside it); on any failure it is removed, so an interrupted write never looks like a finished store."""
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out) if any(out.iterdir()) else out.rmdir()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _write_manifest(manifest: Manifest, staging: Path) -> None:
    Manifest.from_dict(json.loads(manifest.to_json()))  # what we write must read back
    manifest.write(staging)


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything that is not an empty directory or (with overwrite) a store."""
    if not out.exists():
        return
    if not out.is_dir():
        raise StoreError(f"output {out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not (out / MANIFEST_NAME).is_file():
        raise StoreError(f"output {out} exists, is not empty and is not a store; choose another --out")
    if not overwrite:
        raise StoreError(f"output {out} already holds a store (pass overwrite=True to replace it)")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_MARKERS)


def _gguf_has_tokenizer(path: Path) -> bool:
    from gguf import GGUFReader

    return "tokenizer.ggml.model" in GGUFReader(str(path)).fields


def convert(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    model_id: str | None = None,
    gguf_file: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    weights: str | None = None,
) -> Manifest:
    """Convert an HF model folder or a GGUF file (a .gguf path, or a folder + gguf_file) into a store.

    The tokenizer is copied when the source has one; a model without a tokenizer converts fine. `weights` int8 |
    int4 | q4k writes a quantized store (`quantize_store`; q4k: a GGUF's own 4-bit blocks, `gguf_quant.py`) through
    a float32 store written and removed beside `out`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = torch_dtype(dtype)
    src = Path(src)
    if not src.exists():
        raise StoreError(f"source {src} does not exist")
    if src.is_file():
        if src.suffix != ".gguf":
            raise StoreError(f"source {src} is a file but not a .gguf; give an HF model folder or a GGUF file")
        if gguf_file is not None and gguf_file != src.name:
            raise StoreError(f"gguf_file {gguf_file!r} given together with the GGUF file {src.name}")
        folder, gguf_file = src.parent, src.name
    else:
        folder = src
        if gguf_file is not None and not (folder / gguf_file).is_file():
            raise StoreError(f"GGUF file {gguf_file} not found in {folder}")
        if gguf_file is None and not (folder / "config.json").is_file():
            raise StoreError(f"{folder} is not a Hugging Face model folder: no config.json")
    _check_out(Path(out), overwrite)
    if weights is not None:
        return _convert_quantized(folder, gguf_file, Path(out), weights, model_id=model_id, overwrite=overwrite,
                                  progress=progress)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    started = time.perf_counter()
    if gguf_file:  # refused before the slow load when transformers would not reproduce the file's model
        model = load_gguf_model(folder, gguf_file, target)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=target)
        except (OSError, ValueError, KeyError) as exc:
            raise StoreError(f"cannot load model from {src}: {exc}") from exc
    model.eval()
    tokenizer = None
    wants_tokenizer = _gguf_has_tokenizer(folder / gguf_file) if gguf_file else _has_tokenizer(folder)
    if wants_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        except Exception as exc:  # tokenizer loaders raise many kinds
            raise StoreError(f"cannot load the tokenizer of {src}: {exc}") from exc
    if model_id is None:
        model_id = Path(gguf_file).stem if gguf_file else folder.resolve().name
    log.info("loaded %s in %.1fs", src.name, time.perf_counter() - started)
    manifest = write_store(
        model,
        out,
        model_id=model_id,
        tokenizer=tokenizer,
        dtype=dtype,
        source=gguf_file or folder.resolve().name,
        overwrite=overwrite,
        progress=progress,
    )
    log.info("converted %s in %.1fs", src.name, time.perf_counter() - started)
    return manifest


def _convert_quantized(folder: Path, gguf_file: str | None, out: Path, weights: str, *, model_id: str | None,
                       overwrite: bool, progress: Progress | None) -> Manifest:
    """`convert` into a quantized store: a float32 store beside `out` (removed after), then `quantize_store`; for
    q4k the GGUF's layer types are checked before the load and its 4-bit blocks taken as they are."""
    from .gguf_quant import packed_layers, plan_q4k
    from .gguf_source import check_gguf
    from .quant import QUANT_FORMATS, check_weights
    from .store import Store

    check_weights(weights)
    if weights not in QUANT_FORMATS:
        raise StoreError(f"convert --weights takes {', '.join(QUANT_FORMATS)} (a float store: --dtype), not {weights!r}")
    if weights == "q4k" and not gguf_file:
        raise StoreError("--weights q4k takes a GGUF's own 4-bit tensors: give a .gguf file (an HF folder: int4)")
    plan = plan_q4k(folder / gguf_file, check_gguf(folder / gguf_file)) if weights == "q4k" else None
    floats = out.parent / f".{out.name}.float32-{os.getpid()}"
    try:
        src = folder / gguf_file if gguf_file else folder
        convert(src, floats, dtype="float32", model_id=model_id, overwrite=True, progress=progress)
        packed = None
        if plan is not None:
            assert gguf_file is not None
            model = Store(floats).load_full()
            packed = packed_layers(folder / gguf_file, model, plan)
            del model
            log.info("q4k: %s", ", ".join(f"{n} {kind} linears" for kind, n in plan.counts().items()))
        return quantize_store(floats, out, weights, overwrite=overwrite, progress=progress, packed=packed)
    finally:
        if floats.exists():
            shutil.rmtree(floats)


def quantize_store(src: str | Path, out: str | Path, weights: str, *, overwrite: bool = False,
                   progress: Progress | None = None,
                   packed: dict[int, dict[str, dict[str, torch.Tensor]]] | None = None) -> Manifest:
    """A float store's copy at `out` holding its layers' linears in `weights` (int8 | int4, `quant.stored_tensors`),
    the rest of each layer and the head's files (embeddings, final norm, lm_head) in bfloat16, the tokenizer as it
    is; every file hashed into the manifest like any store's, so peers fetch and verify the quantized bytes. q4k takes
    `packed` (`gguf_quant.packed_layers`): per layer, what the GGUF gave of each linear."""
    from .quant import QUANT_FORMATS, check_weights, stored_tensors
    from .store import Store

    check_weights(weights)
    if weights not in QUANT_FORMATS:
        raise StoreError(f"a quantized store holds int8 or int4 weights, not {weights!r}")
    source = Store(src)
    if source.manifest.weights:
        raise StoreError(f"store {src} already holds {source.manifest.weights} weights: quantize a float store")
    out = Path(out)
    _check_out(out, overwrite)
    m = source.manifest
    with _staging(out) as staging:
        files: dict[str, dict[str, Any]] = {}
        config = source.config()
        total = m.num_layers + 2
        for i in range(m.num_layers):
            path = staging / layer_file(i)
            layer = source._layer(config, i, torch.device("cpu"), torch.float32)
            given = None if packed is None else packed.get(i, {})
            _save_tensors(path, stored_tensors(layer, weights, given))
            files[layer_file(i)] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            if progress is not None:
                progress("weights", i + 1, total)
        for done, relpath in enumerate((EMBED_FILE, HEAD_FILE), start=m.num_layers + 1):
            path = staging / relpath
            keys = {"embed_tokens.weight"} if relpath == EMBED_FILE else (
                {"norm.weight"} if m.tied_embeddings else {"norm.weight", "lm_head.weight"})
            tensors = source._read(relpath, keys)
            _save_tensors(path, {k: v.to(torch.bfloat16) for k, v in tensors.items()})
            files[relpath] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            if progress is not None:
                progress("weights", done, total)
        for relpath in m.tokenizer_files:
            (staging / relpath).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source.path / relpath, staging / relpath)
            files[relpath] = dict(m.files[relpath])
        manifest = Manifest(
            format_version=FORMAT_VERSION, model_id=m.model_id, family=m.family, config={**m.config, "dtype": "bfloat16"},
            num_layers=m.num_layers, hidden_size=m.hidden_size, vocab_size=m.vocab_size, dtype="bfloat16",
            files=files, tokenizer_files=list(m.tokenizer_files), tied_embeddings=m.tied_embeddings,
            source=f"{m.source} ({weights} weights)".strip(), eos_token_ids=list(m.eos_token_ids), weights=weights,
        )
        _write_manifest(manifest, staging)
    return manifest

