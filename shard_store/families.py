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
    """Where a family's decoder layer, RMSNorm and rotary classes live, how its HF keys are named, and the
    quirks that live outside the decoder layer (the head's ends, masks, rotary per attention kind)."""

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
    scaled_embedding: bool = False  # Gemma: embeddings are multiplied by sqrt(hidden_size) (in the weights' dtype)
    rope_per_layer_type: bool = False  # Gemma 3: sliding layers rotate with their own (local) rope base

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

    def rotate(
        self, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each attention kind in `kinds`: one table, or one per kind (Gemma 3's local base)."""
        if self.rope_per_layer_type:
            return {kind: rotary(hidden, position_ids, kind) for kind in kinds}
        shared = rotary(hidden, position_ids)
        return dict.fromkeys(kinds, shared)

    def attn_implementation(self, config: PretrainedConfig | dict[str, Any]) -> str:
        """The attention kernel: eager where attention logits are soft-capped (sdpa cannot), else sdpa."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        return "eager" if get("attn_logit_softcapping") else "sdpa"

    def layer_kinds(self, config: PretrainedConfig) -> list[str]:
        """Each layer's attention kind, as the family's own model masks it: `config.layer_types` where the
        config has them, else every layer sliding when `sliding_window` is set (Mistral, Phi-3, Mixtral,
        Qwen3-MoE mask all layers alike), else every layer full."""
        n = int(config.num_hidden_layers)
        kinds = getattr(config, "layer_types", None)
        if kinds:
            return list(kinds)[:n]
        return ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * n

    def embed_scale(self, config: PretrainedConfig) -> float | None:
        """What the embedding output is multiplied by (Gemma's sqrt(hidden_size)), or None."""
        return float(config.hidden_size) ** 0.5 if self.scaled_embedding else None

    @staticmethod
    def logit_softcap(config: PretrainedConfig) -> float | None:
        """The final logits' soft cap c (logits = c * tanh(logits / c), Gemma 2), or None."""
        cap = getattr(config, "final_logit_softcapping", None)
        return float(cap) if cap else None

    def check_config(self, config: PretrainedConfig) -> None:
        """Reject configs this loader cannot run exactly: unknown attention kinds, bidirectional attention."""
        for i, kind in enumerate(self.layer_kinds(config)):
            if kind not in self.layer_types:
                raise StoreError(f"{self.family}: layer {i} has unsupported attention type {kind!r}")
        if getattr(config, "use_bidirectional_attention", False):
            raise StoreError(f"{self.family}: bidirectional attention (an encoder) cannot generate token by token")

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


def _family(family: str, prefix: str, package: str | None = None, **quirks: Any) -> FamilyAdapter:
    """An adapter whose classes follow transformers' naming (<Prefix>DecoderLayer, <Prefix>RMSNorm,
    <Prefix>RotaryEmbedding in transformers.models.<package>.modeling_<package>)."""
    package = package or family
    return FamilyAdapter(
        family=family,
        module=f"transformers.models.{package}.modeling_{package}",
        decoder_layer=f"{prefix}DecoderLayer",
        norm=f"{prefix}RMSNorm",
        rotary=f"{prefix}RotaryEmbedding",
        **quirks,
    )


_BOTH = ("full_attention", "sliding_attention")

FAMILIES: dict[str, FamilyAdapter] = {
    "llama": _family("llama", "Llama"),  # Llama 3's rope scaling (rope_type llama3) lives in its rotary class
    "qwen2": _family("qwen2", "Qwen2", layer_types=_BOTH),
    "mistral": _family("mistral", "Mistral", layer_types=_BOTH),
    "qwen3": _family("qwen3", "Qwen3", layer_types=_BOTH),
    "gemma2": _family("gemma2", "Gemma2", layer_types=_BOTH, scaled_embedding=True),
    "gemma3_text": _family(
        "gemma3_text", "Gemma3", package="gemma3", layer_types=_BOTH,
        scaled_embedding=True, rope_per_layer_type=True,
    ),
    "phi3": _family("phi3", "Phi3", layer_types=_BOTH),
    "mixtral": _family("mixtral", "Mixtral", layer_types=_BOTH),
    "qwen3_moe": _family("qwen3_moe", "Qwen3Moe", layer_types=_BOTH),
}


def adapter_for(family: str) -> FamilyAdapter:
    """The adapter of a family (config.model_type); an unsupported one is a StoreError naming it."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise StoreError(
            f"unsupported model family {family!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def config_from_dict(data: dict[str, Any], attn_implementation: str | None = None) -> PretrainedConfig:
    """Rebuild a transformers config from its stored dict, with the attention kernel set (default: the
    family's, see FamilyAdapter.attn_implementation)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    adapter = adapter_for(str(model_type))
    attn_implementation = attn_implementation or adapter.attn_implementation(data)
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(data))
    except Exception as exc:  # transformers raises many kinds on a bad config
        raise StoreError(f"manifest: cannot rebuild the {model_type} config: {exc}") from exc
    config._attn_implementation = attn_implementation
    return config
