"""One small adapter per model family: which transformers classes to reuse and how HF keys split.

Adding a family means adding one FamilyAdapter entry whose classes come from transformers itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import StoreError

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import and the CLI starts often
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class FamilyAdapter:
    """Where a family's decoder layer, RMSNorm and rotary classes live and how its HF keys are named."""

    family: str
    module: str  # transformers.models.<x>.modeling_<x>
    decoder_layer: str
    norm: str
    rotary: str
    layer_prefix: str = "model.layers."
    embed_key: str = "model.embed_tokens.weight"
    norm_key: str = "model.norm.weight"
    lm_head_key: str = "lm_head.weight"
    layer_types: tuple[str, ...] = ("full_attention",)

    def _cls(self, name: str) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), name)

    def new_decoder_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        """An uninitialised decoder layer (absolute index `index`) from transformers' own class."""
        return self._cls(self.decoder_layer)(config, index)

    def new_norm(self, config: PretrainedConfig) -> nn.Module:
        """The family's final RMSNorm."""
        return self._cls(self.norm)(config.hidden_size, eps=config.rms_norm_eps)

    def new_rotary(self, config: PretrainedConfig) -> nn.Module:
        """The family's rotary embedding (computes inv_freq on CPU in float32)."""
        with torch.device("cpu"):
            return self._cls(self.rotary)(config=config)

    def split_key(self, key: str) -> tuple[str, int | None, str]:
        """Classify an HF state-dict key: ("layer", index, local key) / ("embed"|"norm"|"lm_head", None, key)."""
        if key.startswith(self.layer_prefix):
            rest = key[len(self.layer_prefix) :]
            index, _, local = rest.partition(".")
            if index.isdigit() and local:
                return "layer", int(index), local
        if key == self.embed_key:
            return "embed", None, key
        if key == self.norm_key:
            return "norm", None, key
        if key == self.lm_head_key:
            return "lm_head", None, key
        raise StoreError(f"{self.family}: unexpected weight {key!r} (not a layer, embedding, norm or lm_head)")

    def check_layer_types(self, config: PretrainedConfig) -> None:
        """Reject configs whose attention layer types this loader cannot mask correctly."""
        for i, kind in enumerate(getattr(config, "layer_types", None) or []):
            if kind not in self.layer_types:
                raise StoreError(f"{self.family}: layer {i} has unsupported attention type {kind!r}")


FAMILIES: dict[str, FamilyAdapter] = {
    "llama": FamilyAdapter(
        family="llama",
        module="transformers.models.llama.modeling_llama",
        decoder_layer="LlamaDecoderLayer",
        norm="LlamaRMSNorm",
        rotary="LlamaRotaryEmbedding",
    ),
    "qwen2": FamilyAdapter(
        family="qwen2",
        module="transformers.models.qwen2.modeling_qwen2",
        decoder_layer="Qwen2DecoderLayer",
        norm="Qwen2RMSNorm",
        rotary="Qwen2RotaryEmbedding",
        layer_types=("full_attention", "sliding_attention"),
    ),
}


def adapter_for(family: str) -> FamilyAdapter:
    """The adapter of a family (config.model_type); an unsupported one is a StoreError naming it."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise StoreError(
            f"unsupported model family {family!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def config_from_dict(data: dict[str, Any], attn_implementation: str = "sdpa") -> PretrainedConfig:
    """Rebuild a transformers config from its stored dict, with the attention kernel set."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    adapter_for(str(model_type))
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(data))
    except Exception as exc:  # transformers raises many kinds on a bad config
        raise StoreError(f"manifest: cannot rebuild the {model_type} config: {exc}") from exc
    config._attn_implementation = attn_implementation
    return config
