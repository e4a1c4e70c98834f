"""Open a store and load exactly what a role needs: the head, one layer span, or the whole model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn

from .devices import release_freed_memory
from .dtypes import torch_dtype
from .errors import StoreError
from .families import FamilyAdapter, adapter_for, config_from_dict
from .manifest import EMBED_FILE, HEAD_FILE, TOKENIZER_DIR, Manifest, file_matches, layer_file
from .modules import HeadModule, SpanModule
from .quant import (
    COMPUTE_DTYPE,
    FLOAT_FORMATS,
    QUANT_FORMATS,
    check_weights,
    compute_dtype,
    float_tensors,
    format_of_dtype,
    int8_head,
    load_stored,
    quantize_linears,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


Device = torch.device | str | None
Dtype = torch.dtype | str | None


class Store:
    """A model store on disk. Every file read is size-checked against the manifest; with
    verify=True every file is also re-hashed when the store is opened.

    Weights are memory-mapped (safetensors), so loading is near-instant, pages are read on first
    use, and several peers on one machine serving the same store share the page cache.

    Every loader takes a `device` (default the CPU) and a compute `dtype` (default the store's):
    weights are cast and moved once at load, so a bfloat16 store can compute in float32 and a
    float32 store in bfloat16. On the CPU in the store's dtype nothing is copied (still mmap).
    """

    def __init__(self, path: str | Path, verify: bool = False) -> None:
        self.path = Path(path)
        self.manifest = Manifest.read(self.path)
        self.adapter: FamilyAdapter = adapter_for(self.manifest.family)
        if self.manifest.config.get("model_type") != self.manifest.family:
            raise StoreError(
                f"manifest: family {self.manifest.family!r} != config.model_type "
                f"{self.manifest.config.get('model_type')!r}"
            )
        self.dtype = torch_dtype(self.manifest.dtype)
        if verify:
            bad = self.verify()
            if bad:
                raise StoreError(f"store {self.path} failed verification: {', '.join(bad)}")

    @property
    def num_layers(self) -> int:
        """Number of decoder layers of the stored model."""
        return self.manifest.num_layers

    def config(self, attn_implementation: str | None = None) -> PretrainedConfig:
        """A fresh transformers config of the stored model (attention kernel: the family's unless given)."""
        config = config_from_dict(self.manifest.config, attn_implementation)
        self.adapter.check_config(config)
        return config

    # ---- integrity -------------------------------------------------------------------------
    def verify(self, progress: Callable[[str, int, int], None] | None = None, only: list[str] | None = None) -> list[str]:
        """Re-hash every listed file (or the listed files in `only`, e.g. a fetched span's); return the relpaths
        that are missing or whose size/sha256 differ."""
        relpaths = sorted(self.manifest.files) if only is None else list(only)
        bad: list[str] = []
        for done, relpath in enumerate(relpaths, start=1):
            if not file_matches(self.path, relpath, self.manifest.files[relpath]):
                bad.append(relpath)
            if progress is not None:
                progress(relpath, done, len(relpaths))
        return bad

    def _checked(self, relpath: str) -> Path:
        """Path of a listed file after checking it exists and has the manifest's size."""
        entry = self.manifest.files.get(relpath)
        if entry is None:
            raise StoreError(f"store {self.path}: {relpath} is not listed in the manifest")
        path = self.path / relpath
        if not path.is_file():
            raise StoreError(f"store {self.path}: missing file {relpath}")
        size = path.stat().st_size
        if size != entry["size"]:
            raise StoreError(f"store {self.path}: {relpath} has size {size}, manifest says {entry['size']}")
        return path

    def _read(self, relpath: str, expected: set[str]) -> dict[str, torch.Tensor]:
        """Load one weight file, checking its keys and dtype against what the loader expects."""
        path = self._checked(relpath)
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise StoreError(f"store {self.path}: cannot read {relpath}: {exc}") from exc
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise StoreError(f"store {self.path}: {relpath} has wrong tensors (missing {missing}, unexpected {extra})")
        for key, tensor in tensors.items():
            if tensor.dtype != self.dtype and not self._packed(key, tensor):
                raise StoreError(f"store {self.path}: {relpath}:{key} is {tensor.dtype}, manifest says {self.dtype}")
        return tensors

    def _packed(self, key: str, tensor: torch.Tensor) -> bool:
        """A quantized store's integer tensor (int8 `.qweight`, 4-bit `.q4`), of the dtype its format stores."""
        int8, int4 = (".qweight", torch.int8), (".q4", torch.uint8)
        wants = {"int8": (int8,), "int4": (int4,), "q4k": (int4, int8)}.get(self.manifest.weights, ())
        return any(key.endswith(suffix) and tensor.dtype == dtype for suffix, dtype in wants)

    def span_files(self, start: int, end: int) -> list[str]:
        """Relpaths of the weight files a span [start, end) reads."""
        self._check_span(start, end)
        return [layer_file(i) for i in range(start, end)]

    def span_nbytes(self, start: int, end: int) -> int:
        """Bytes on disk of the span's weights (about what it holds in memory)."""
        return sum(self.manifest.files[f]["size"] for f in self.span_files(start, end))

    def _check_span(self, start: int, end: int) -> None:
        for v in (start, end):
            if isinstance(v, bool) or not isinstance(v, int):
                raise StoreError(f"span bounds must be ints, got {start!r}, {end!r}")
        if not 0 <= start < end <= self.num_layers:
            raise StoreError(f"span [{start}, {end}) is not inside the model's layers [0, {self.num_layers})")

    # ---- loading ---------------------------------------------------------------------------
    def _placement(self, device: Device, dtype: Dtype) -> tuple[torch.device, torch.dtype]:
        """The loaders' (device, dtype): the CPU and the store's dtype unless given."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dtype is None:
            return dev, self.dtype
        return dev, torch_dtype(dtype) if isinstance(dtype, str) else dtype

    def _read_to(
        self, relpath: str, expected: set[str], device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """`_read`, then cast and move every tensor (a no-op without a copy when nothing changes)."""
        return {k: v.to(device=device, dtype=dtype) for k, v in self._read(relpath, expected).items()}

    def _assign(self, module: nn.Module, tensors: dict[str, torch.Tensor], relpath: str) -> None:
        """Load file tensors into a meta-initialised module without copying."""
        try:
            module.load_state_dict(tensors, strict=True, assign=True)
        except RuntimeError as exc:
            raise StoreError(f"store {self.path}: {relpath} does not fit the model: {exc}") from exc

    def load_head(self, *, device: Device = None, dtype: Dtype = None, weights: str | None = None) -> HeadModule:
        """Embeddings, final norm and lm_head on `device` in `dtype`; reads embed.safetensors and head.safetensors only.
        The head of a quantized route (`weights` int8 | int4 | q4k, by default a quantized store's own), computing
        in bf16 on the CPU, holds its embeddings and lm_head as int8 rows (`quant.int8_head`): its logits are
        row-invariant, as the route's rows are, at a quarter of fp32's bytes."""
        dev, dt = self._placement(device, dtype)
        config = self.config()
        head_keys = {"norm.weight"} if self.manifest.tied_embeddings else {"norm.weight", "lm_head.weight"}
        embed_t = self._read_to(EMBED_FILE, {"embed_tokens.weight"}, dev, dt)
        head_t = self._read_to(HEAD_FILE, head_keys, dev, dt)
        with torch.device("meta"):
            embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dt)
            norm = self.adapter.new_norm(config).to(dt)
            lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dt)
        self._assign(embed, {"weight": embed_t["embed_tokens.weight"]}, EMBED_FILE)
        self._assign(norm, {"weight": head_t["norm.weight"]}, HEAD_FILE)
        tied = bool(self.manifest.tied_embeddings)
        if tied:
            lm_head.weight = embed.weight
        else:
            self._assign(lm_head, {"weight": head_t["lm_head.weight"]}, HEAD_FILE)
        fmt = weights or self.manifest.weights
        if fmt in QUANT_FORMATS and dt == COMPUTE_DTYPE and dev.type == "cpu":
            embed, lm_head = int8_head(embed, lm_head, tied)
            # a copy: the norm's view would keep head.safetensors mapped, its lm_head pages read while quantizing
            # resident (an 8B model's: 1 GB)
            norm.weight.data = norm.weight.data.clone()
            release_freed_memory()  # the float32 rows quantized
        return HeadModule(embed, norm, lm_head, config, self.adapter)

    def _layer(self, config: PretrainedConfig, index: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """Build decoder layer `index` on the meta device and assign its stored weights (cast, moved)."""
        relpath = layer_file(index)
        with torch.device("meta"):
            layer = self.adapter.new_decoder_layer(config, index).to(dtype)
        expected = set(layer.state_dict())
        self._assign(layer, self._read_to(relpath, expected, device, dtype), relpath)
        return layer

    def load_span(self, start: int, end: int, *, device: Device = None, dtype: Dtype = None,
                  weights: str | None = None) -> SpanModule:
        """Decoder layers [start, end) only, on `device` in `dtype`: reads and holds just those layers' files.
        `weights` int8 | int4 packs every linear as it is read (from float32, one layer at a time: `quant.py`) and
        computes in bf16; a float format is its dtype (`dtype`, if also given, must agree)."""
        self._check_span(start, end)
        dev, dt = self._placement(device, dtype)
        config = self.config()
        held = self.manifest.weights
        if held:
            return self._load_quantized_span(start, end, config, dev, weights)
        if weights is None:
            return SpanModule(self.adapter, config, start, end, [self._layer(config, i, dev, dt) for i in range(start, end)])
        check_weights(weights, dev)
        if dtype is not None and dt != compute_dtype(weights):
            raise StoreError(f"--weights {weights} computes in {compute_dtype(weights)}, not the {dt} asked for")
        if weights in FLOAT_FORMATS:
            dt = FLOAT_FORMATS[weights]
            return SpanModule(self.adapter, config, start, end, [self._layer(config, i, dev, dt) for i in range(start, end)])
        layers = []
        for i in range(start, end):
            layer = self._layer(config, i, dev, torch.float32)
            quantize_linears(layer, weights)
            layers.append(layer)
        release_freed_memory()  # the float layers packed from
        return SpanModule(self.adapter, config, start, end, layers, weights)

    def _load_quantized_span(self, start: int, end: int, config: PretrainedConfig, device: torch.device,
                             weights: str | None) -> SpanModule:
        """A span of a quantized store, as it holds it (`quant.load_stored`): the format asked must be its own."""
        held = self.manifest.weights
        if weights not in (None, held):
            raise StoreError(f"store {self.path} holds {held} weights: serve it with --weights {held} (or auto), or "
                             f"serve --weights {weights} from a float store")
        check_weights(held, device)
        layers = []
        for i in range(start, end):
            with torch.device("meta"):
                layer = self.adapter.new_decoder_layer(config, i)
            layers.append(self._stored_layer(layer, i))
        release_freed_memory()  # the packing's temporaries: a worker thread's arena would keep them
        return SpanModule(self.adapter, config, start, end, layers, held)

    def _stored_layer(self, layer: nn.Module, index: int) -> nn.Module:
        """Fill decoder layer `index`, built on the meta device, from a quantized store's file as it holds it."""
        relpath = layer_file(index)
        path = self._checked(relpath)
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise StoreError(f"store {self.path}: cannot read {relpath}: {exc}") from exc
        left = load_stored(layer, tensors)
        if left:
            raise StoreError(f"store {self.path}: {relpath} does not fit the model as {self.manifest.weights} "
                             f"weights: {left}")
        return layer

    def load_full(self, *, device: Device = None, dtype: Dtype = None, dequantize: bool = False) -> PreTrainedModel:
        """The whole model as a transformers causal LM (eval) on `device` in `dtype`, e.g. for a local draft model.
        A quantized store's model holds its layers as its spans do (packed linears, bf16, the CPU only: a draft
        drafts on the same kernels the route's peers run), its embeddings and lm_head in the store's bf16; with
        `dequantize`, as the float model its packed values and scales stand for (`quant.float_tensors`), in `dtype`:
        for a draft that quantizes itself again (int8)."""
        from transformers import AutoModelForCausalLM

        held = "" if dequantize else self.manifest.weights
        dev, dt = self._placement(device, dtype)
        if held:
            try:
                check_weights(held, dev)
            except ValueError as exc:
                raise StoreError(f"store {self.path}: {exc}") from None
            if dt != self.dtype:
                raise StoreError(f"store {self.path} holds {held} layers, which compute in {self.manifest.dtype}, "
                                 f"not {dt}: load it without a dtype")
        config = self.config()
        config.dtype = dt
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dt)
        a = self.adapter
        state: dict[str, torch.Tensor] = {}
        state[a.embed_key] = self._read_to(EMBED_FILE, {"embed_tokens.weight"}, dev, dt)["embed_tokens.weight"]
        head_keys = {"norm.weight"} if self.manifest.tied_embeddings else {"norm.weight", "lm_head.weight"}
        head_t = self._read_to(HEAD_FILE, head_keys, dev, dt)
        state[a.norm_key] = head_t["norm.weight"]
        state[a.lm_head_key] = head_t.get("lm_head.weight", state[a.embed_key])
        for i in range(self.num_layers):
            prefix = f"{a.layer_prefix}{i}."
            if held:
                self._stored_layer(model.get_submodule(prefix[:-1]), i)
                continue
            expected = {k[len(prefix) :] for k in model.state_dict() if k.startswith(prefix)}
            layer = self._floats(layer_file(i), expected, dt) if self.manifest.weights else None
            for key, tensor in (layer or self._read_to(layer_file(i), expected, dev, dt)).items():
                state[prefix + key] = tensor.to(dev)
        if held:  # the layers are filled already: assign the ends alone
            try:
                unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
            except RuntimeError as exc:
                raise StoreError(f"store {self.path}: the head's files do not fit the model: {exc}") from exc
            if unexpected:
                raise StoreError(f"store {self.path}: the head's files hold tensors the model lacks: {unexpected}")
        else:
            self._assign(model, state, "the weight files")
        if self.manifest.tied_embeddings:
            model.lm_head.weight = model.get_input_embeddings().weight
        _rebuild_meta_buffers(model, config)
        model.to(dev)  # the rebuilt rotary buffers (weights are there already)
        model.eval()
        return model

    def _floats(self, relpath: str, expected: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A quantized store's layer file as the float tensors it stands for (`quant.float_tensors`), keys checked."""
        try:
            tensors = float_tensors(load_file(str(self._checked(relpath))), dtype)
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise StoreError(f"store {self.path}: cannot read {relpath}: {exc}") from exc
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise StoreError(f"store {self.path}: {relpath} has wrong tensors (missing {missing}, unexpected {extra})")
        return tensors

    def load_tokenizer(self) -> Any:
        """The stored tokenizer, or None when the model was converted without one."""
        if not self.manifest.tokenizer_files:
            return None
        from transformers import AutoTokenizer

        for relpath in self.manifest.tokenizer_files:
            self._checked(relpath)
        try:
            return AutoTokenizer.from_pretrained(str(self.path / TOKENIZER_DIR))
        except Exception as exc:  # tokenizer loaders raise many kinds
            raise StoreError(f"store {self.path}: cannot load the tokenizer: {exc}") from exc

    def summary(self) -> dict[str, Any]:
        """Manifest summary for `store inspect` and `models prepare` (JSON-safe)."""
        m = self.manifest
        layer_bytes = [m.files[layer_file(i)]["size"] for i in range(m.num_layers)]
        return {
            "path": str(self.path),
            "model_id": m.model_id,
            "family": m.family,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "vocab_size": m.vocab_size,
            "dtype": m.dtype,
            "weights": m.weights or format_of_dtype(self.dtype),
            "files": len(m.files),
            "total_bytes": m.total_bytes,
            "head_bytes": m.files[EMBED_FILE]["size"] + m.files[HEAD_FILE]["size"],
            "layer_bytes": sum(layer_bytes),
            "tokenizer": bool(m.tokenizer_files),
            "tied_embeddings": m.tied_embeddings,
            "source": m.source,
            "format_version": m.format_version,
        }


def _rebuild_meta_buffers(model: PreTrainedModel, config: PretrainedConfig) -> None:
    """Recreate the non-persistent buffers still on the meta device: rotary modules are rebuilt from the
    config (inv_freq on CPU in float32); any other (Gemma's embedding scale) is materialised on the CPU
    and refilled by the model's own weight initialisation, which is what sets it in transformers (the
    module's loaded tensors are marked initialised first, so it leaves them alone)."""
    for name, module in list(model.named_modules()):
        meta = [(key, buf) for key, buf in module.named_buffers(recurse=False) if buf.is_meta]
        if not meta:
            continue
        if "RotaryEmbedding" in type(module).__name__:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device("cpu"):
                setattr(parent, attr, type(module)(config=config))
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor._is_hf_initialized = True  # loaded: transformers' initialisers leave such tensors alone
        for key, buf in meta:
            module.register_buffer(key, torch.empty(buf.shape, dtype=buf.dtype), persistent=False)
        model._init_weights(module)
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:
        raise StoreError(f"model still has unloaded tensors after loading: {leftovers[:5]}")
