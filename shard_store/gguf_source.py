"""A GGUF source of `convert`: refuse, before the slow load, a file that transformers' GGUF loader would
load into an unsupported family, or into a model that computes something other than what the file states.

transformers builds a GGUF's config through a per-architecture table of metadata keys
(`GGUF_CONFIG_MAPPING`) and names its tensors through gguf's `TensorNameMap`: a key outside the table is
ignored and its config field keeps the config class's default, a tensor outside the map is dropped, and a
weight the file lacks is initialised at random. Each check below compares what the file states (or, for a
key llama.cpp's converter never writes, what llama.cpp assumes in its place) with what transformers' config
will run, so a store converted from a GGUF computes what llama.cpp would compute from the same file.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import StoreError

if TYPE_CHECKING:  # transformers and torch are imported lazily: the CLI starts often
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# The GGUF architectures transformers loads into a supported family. llama.cpp writes Mistral and Mixtral
# as "llama"; transformers reads a "llama" file as mistral only when general.name is exactly "mistral".
CONVERTIBLE_ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3": "gemma3_text",
}
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")
_BLOCK = re.compile(r"^blk\.\d+\.")
_LAYER = re.compile(r"\.layers\.\d+\.")
# Keys that change what a model computes and that transformers reads for none of our architectures.
_UNREAD_KEYS = ("attention.scale", "embedding_scale", "logit_scale", "residual_scale", "attn_output_scale")
# llama.cpp computes Gemma's attention scale from head_dim, except for the 27B sizes (told apart by depth),
# where it uses hidden_size / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# What a tensor transformers drops carried, for messages.
_DROPPED_MEANING = {
    "rope_freqs.weight": "Llama 3 rope scaling (rope_type llama3)",
    "rope_factors_long.weight": "LongRoPE scaling", "rope_factors_short.weight": "LongRoPE scaling",
}
_UNSET = object()


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file says before any tensor is read: architecture, metadata, tensor names."""

    file: str
    architecture: str
    meta: dict[str, Any]  # the general.* and <architecture>.* keys (not the tokenizer's long arrays)
    tensors: tuple[str, ...]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `<architecture>.<key>`, or `default` when the file does not state it."""
        return self.meta.get(f"{self.architecture}.{key}", default)


def read_header(path: Path) -> GgufHeader:
    """Read a GGUF's architecture, metadata and tensor names with gguf's reader (no tensor data is read)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = str(reader.fields["general.architecture"].contents())
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise StoreError(f"{path.name} is not a readable GGUF file: {exc}") from exc
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith((f"{arch}.", "general."))}
    return GgufHeader(
        file=path.name,
        architecture=arch,
        meta=meta,
        tensors=tuple(t.name for t in reader.tensors),
    )


def load_gguf_model(folder: Path, gguf_file: str, dtype: torch.dtype) -> PreTrainedModel:
    """Check the GGUF (see `check_gguf`), then load it through transformers in `dtype`."""
    from transformers import AutoModelForCausalLM

    config = check_gguf(folder / gguf_file)
    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, config=config, dtype=dtype)
    except Exception as exc:  # transformers raises many kinds on a file it cannot load
        raise StoreError(f"cannot load model from {gguf_file}: {exc}") from exc


def check_gguf(path: Path) -> PretrainedConfig:
    """The config transformers builds for the GGUF at `path`, once every check passed; else a StoreError
    naming the architecture or family and each field or tensor that would not survive the load."""
    header = read_header(path)
    _refuse_llama_experts(header)
    config = _transformers_config(path, header)
    problems = _config_problems(header, config) + _tensor_problems(header, config)
    if problems:
        raise StoreError(
            f"{config.model_type}: the {header.architecture!r} GGUF {header.file} would not convert exactly "
            f"through transformers' GGUF loader: " + "; ".join(problems)
        )
    return config


def _supported_families() -> str:
    """Our families, for messages."""
    from .families import FAMILIES

    return ", ".join(sorted(FAMILIES))


def _refuse_llama_experts(header: GgufHeader) -> None:
    """A "llama" GGUF with experts is a Mixtral as llama.cpp writes it; transformers' llama GGUF path maps no
    expert tensor (it would drop them and leave each layer's MLP random), so refuse it."""
    if header.architecture != "llama":
        return
    count = int(header.get("expert_count", 0) or 0)
    experts = sorted({_BLOCK.sub("blk.*.", t) for t in header.tensors if _EXPERT_TENSOR.match(t)})
    if count > 0 or experts:
        raise StoreError(
            f"llama: the GGUF {header.file} is a mixture of experts (llama.expert_count={count}, expert "
            f"tensors {', '.join(experts) or 'none'}), which transformers' llama GGUF loader cannot map: it has "
            "no mapping for ffn_*_exps tensors. Convert the model (e.g. a Mixtral) from its Hugging Face folder."
        )


def _transformers_config(path: Path, header: GgufHeader) -> PretrainedConfig:
    """The config transformers reads from the GGUF's metadata; a StoreError when transformers cannot read
    the architecture or reads it into a family we do not support."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from .families import FAMILIES

    arch = header.architecture
    convertible = ", ".join(f"{a} -> {f}" for a, f in sorted(CONVERTIBLE_ARCHITECTURES.items()))
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises ValueError for an unknown architecture, others on bad files
        loadable = sorted({*GGUF_SUPPORTED_ARCHITECTURES, *_config_architectures()} - {"general", "tokenizer"})
        raise StoreError(
            f"transformers cannot load the GGUF architecture {arch!r} of {header.file} ({exc}); its GGUF loader "
            f"maps {', '.join(loadable)}; supported families: {_supported_families()} "
            f"(GGUF architectures that convert: {convertible})"
        ) from exc
    if config.model_type not in FAMILIES:
        raise StoreError(
            f"the GGUF architecture {arch!r} of {header.file} loads in transformers as {config.model_type!r}, "
            f"not a supported family ({_supported_families()}); GGUF architectures that convert: {convertible}"
        )
    return config


def _config_architectures() -> list[str]:
    """The architectures transformers' newer GGUF path rebuilds configs for (absent in older releases)."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:
        return []
    return list(GGUF_CONFIG_ARCHS)


def _head_dim(config: PretrainedConfig) -> int:
    """The per-head width transformers' attention computes with."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rope(config: PretrainedConfig, kind: str = "full_attention") -> dict[str, Any]:
    """The rope parameters of one attention kind (Gemma 3 keeps one dict per kind)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    return dict(params[kind]) if kind in params else params


def _rotary_dims(config: PretrainedConfig) -> int:
    """How many of a head's dimensions rotate (Phi-3's partial rotary)."""
    factor = _rope(config).get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    return int(_head_dim(config) * float(factor))


def _layer_kinds(config: PretrainedConfig) -> list[str]:
    """Each layer's attention kind as the store runs it."""
    from .families import adapter_for

    return adapter_for(config.model_type).layer_kinds(config)


def _window(config: PretrainedConfig) -> int | None:
    """The sliding window transformers' config runs with, or None when no layer slides."""
    return getattr(config, "sliding_window", None) if "sliding_attention" in _layer_kinds(config) else None


def _pattern(header: GgufHeader, layers: int) -> list[str]:
    """The attention kind of each layer as the file says: its sliding_window_pattern (a flag per layer, or
    llama.cpp's period n: layer i slides unless i % n == n - 1), else llama.cpp's assumption per architecture:
    Gemma 2 alternates (even layers slide), Gemma 3 makes every sixth layer global, the others slide on all.
    transformers' Gemma configs default to the same two patterns, so those files need no key."""
    stated = header.get("attention.sliding_window_pattern")
    if isinstance(stated, list):
        return ["sliding_attention" if flag else "full_attention" for flag in stated]
    period = stated if isinstance(stated, int) else {"gemma2": 2, "gemma3": 6}.get(header.architecture, 0)
    slides = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in slides]


def _same(want: Any, actual: Any) -> bool:
    """Equal, floats to float32 precision (the file stores them as f32)."""
    if isinstance(want, float) and isinstance(actual, (int, float)):
        return abs(want - actual) <= 1e-6 * max(abs(want), 1.0)
    return bool(want == actual)


def _config_problems(header: GgufHeader, config: PretrainedConfig) -> list[str]:
    """Each field where transformers' config differs from what the file states or llama.cpp assumes."""
    from transformers.integrations import GGUF_CONFIG_MAPPING

    arch = header.architecture
    table = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    mapping = GGUF_CONFIG_MAPPING.get(table, {})
    problems: list[str] = []

    def compare(field: str, actual: Any, key: str | None, assumed: Any, want: Any = _UNSET) -> None:
        """Record a problem when `actual` differs from the file's `key` (or llama.cpp's `assumed` value)."""
        stated = header.get(key) if key else None
        want = want if want is not _UNSET else (assumed if stated is None else stated)
        if _same(want, actual):
            return
        if key is None:
            told = f"no GGUF key carries it and llama.cpp uses {want!r}"
            read = "transformers keeps its config default"
        else:
            told = (
                f"the file states {arch}.{key}={stated!r}"
                if stated is not None
                else f"the file has no {arch}.{key}, for which llama.cpp assumes {want!r}"
            )
            into = f"reads {key} into {mapping[key]}" if mapping.get(key) else f"does not read {key}"
            read = f"its {table} GGUF mapping {into}"
        problems.append(f"{field}: {told}, but transformers' config has {actual!r} ({read})")

    per_head = config.hidden_size // config.num_attention_heads
    head_dim = int(header.get("attention.key_length") or per_head)
    rope = _rope(config)
    compare("head_dim", _head_dim(config), "attention.key_length", per_head)
    compare("head_dim", _head_dim(config), "attention.value_length", head_dim)
    rotary = "rotary dims (head_dim x partial_rotary_factor)"
    compare(rotary, _rotary_dims(config), "rope.dimension_count", head_dim)
    # llama.cpp's Gemma2Model writes no rope base: llama.cpp and transformers' Gemma2Config both take 10000
    compare("rope_theta", float(rope["rope_theta"]), "rope.freq_base", 10000.0)
    scaling = rope.get("rope_type", "default")
    compare("rope_type", "none" if scaling == "default" else scaling, "rope.scaling.type", "none")
    window = _window(config)
    stated_window = header.get("attention.sliding_window") or None  # 0 means none
    compare("sliding_window", window, "attention.sliding_window", None, want=stated_window)
    if window and stated_window:
        kinds = _layer_kinds(config)
        compare("layer_types", kinds, "attention.sliding_window_pattern", None, want=_pattern(header, len(kinds)))
        local = float(_rope(config, "sliding_attention").get("rope_theta", rope["rope_theta"]))
        # llama.cpp hard-codes Gemma 3's local rope base at 10000, as transformers' Gemma3TextConfig defaults it
        assumed = 10000.0 if arch == "gemma3" else float(header.get("rope.freq_base", 10000.0))
        compare("rope_parameters.sliding_attention.rope_theta", local, "rope.freq_base_swa", assumed)
    # llama.cpp's Gemma 2 soft caps are 50 and 30 when the file has none, as in transformers' Gemma2Config
    softcaps = (50.0, 30.0) if arch == "gemma2" else (0.0, 0.0)
    for key, assumed_cap in zip(("attn_logit_softcapping", "final_logit_softcapping"), softcaps, strict=True):
        compare(key, float(getattr(config, key, None) or 0.0), key, assumed_cap)
    if arch in _GEMMA_27B_LAYERS:  # transformers' Gemma configs keep query_pre_attn_scalar at 256
        deep = int(header.get("block_count", 0)) == _GEMMA_27B_LAYERS[arch]
        compare("query_pre_attn_scalar", config.query_pre_attn_scalar, None, per_head if deep else head_dim)
    if arch == "qwen3moe":
        moe_size = getattr(config, "moe_intermediate_size", None)
        compare("moe_intermediate_size", moe_size, "expert_feed_forward_length", moe_size)
        # llama.cpp runs every Qwen3-MoE layer as experts and renormalises the top-k weights; transformers'
        # GGUF loader defaults norm_topk_prob to True, and Qwen3MoeConfig has no dense layer by default
        compare("norm_topk_prob", bool(getattr(config, "norm_topk_prob", True)), None, True)
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        only = getattr(config, "mlp_only_layers", None) or []
        dense = [i for i in range(config.num_hidden_layers) if i in only or (i + 1) % step]
        compare("mlp_only_layers", dense, None, [])
    problems.extend(
        f"{key}: the file states {arch}.{key}={header.get(key)!r}, which transformers' GGUF loader does not read"
        for key in _UNREAD_KEYS
        if header.get(key) is not None
    )
    return problems


def _tensor_problems(header: GgufHeader, config: PretrainedConfig) -> list[str]:
    """GGUF tensors transformers' name map drops, and model weights no GGUF tensor fills (left random)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config={})
    try:
        to_hf = get_gguf_hf_weights_map(model, processor)
    except NotImplementedError as exc:  # e.g. a "llama" file named "mistral": gguf-py has no mistral
        return [f"transformers cannot map the tensors of a {config.model_type} model: {exc}"]
    experts = getattr(processor, "GGUF_MOE_WEIGHTS_PATTERN", None)
    dropped: set[str] = set()
    filled: set[str] = set()
    for name in header.tensors:
        moe = experts.fullmatch(name) if experts is not None else None
        target = to_hf.get(name) or (to_hf.get(moe["name"]) if moe else None)
        if target is None:
            dropped.add(_BLOCK.sub("blk.*.", name))
        else:
            filled.add(target)
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = {_LAYER.sub(".layers.*.", k) for k in model.state_dict() if k not in filled and k not in skip}
    problems = []
    if dropped:
        names = ", ".join(f"{n} ({_DROPPED_MEANING[n]})" if n in _DROPPED_MEANING else n for n in sorted(dropped))
        problems.append(f"tensors {names}: transformers' {header.architecture} GGUF mapping drops them")
    if missing:
        problems.append(
            f"weights {', '.join(sorted(missing))}: no tensor of the file fills them "
            "(transformers would leave them random)"
        )
    return problems
