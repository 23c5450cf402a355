"""Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3) as :class:`SelectiveRopeFoXForCausalLM`.

SelectiveRopeFoX with ``use_forget_gate=False``, ``position_embedding="rope"`` and no FoX Pro option computes exactly
what these models compute (SPEC §4), so a source maps onto it weight for weight: :func:`fox_config_from_llama` maps
the config, :func:`fox_key_from_llama` the parameter names, and the source's own inverse frequencies become each
layer's ``rotary.temperature`` (:func:`llama_inverse_frequencies`).
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..configuration.fox import SelectiveRopeFoXConfig

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default",)

_KEY_RENAMES = [  # (source pattern, our name), applied in order to each parameter name
    (r"^model\.embed_tokens\.", "model.embeddings."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"model.layers.\1.attn."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"model.layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.layers.\1.mlp_norm."),
]


def _check_source(source: PreTrainedConfig) -> str:
    if source.model_type not in LLAMA_FAMILY:
        raise ValueError(f"unsupported source architecture {source.model_type!r}; supported: {list(LLAMA_FAMILY)}")
    rope_type = (source.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    return rope_type


def fox_config_from_llama(source: PreTrainedConfig, **overrides) -> SelectiveRopeFoXConfig:
    """The SelectiveRopeFoX config that reproduces ``source`` (plain RoPE, no forget gate), with ``overrides``."""
    _check_source(source)
    head_dim = getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads
    qkv_bias = getattr(source, "attention_bias", source.model_type == "qwen2")  # Qwen2: q/k/v biases, none on o
    fields = dict(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=source.hidden_act,
        rms_norm_eps=source.rms_norm_eps,
        attention_bias=qkv_bias,
        attention_output_bias=qkv_bias and source.model_type != "qwen2",
        mlp_bias=getattr(source, "mlp_bias", False),
        qk_norm=source.model_type == "qwen3",
        tie_word_embeddings=source.tie_word_embeddings,
        initializer_range=source.initializer_range,
        pad_token_id=source.pad_token_id,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        position_embedding="rope",
        use_forget_gate=False,
        temperature_type="rope",
        temperature_theta=float(source.rope_parameters["rope_theta"]),
        partial_rotary_factor=float(getattr(source, "partial_rotary_factor", 1.0) or 1.0),
    )
    return SelectiveRopeFoXConfig(**{**fields, **overrides})


def fox_key_from_llama(name: str) -> str:
    """Our parameter name for a Llama-family parameter name (``lm_head`` and ``model.norm`` keep theirs)."""
    for pattern, replacement in _KEY_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def llama_inverse_frequencies(source: PreTrainedConfig) -> torch.Tensor:
    """The source's own RoPE inverse frequencies (float32), computed by transformers' RoPE functions."""
    _check_source(source)
    inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(source)  # the same rule for all four
    return inv_freq.float()
