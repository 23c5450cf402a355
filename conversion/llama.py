"""Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3) as :class:`SelectiveRopeFoXForCausalLM`.

SelectiveRopeFoX with ``use_forget_gate=False``, ``position_embedding="rope"`` and no FoX Pro option computes exactly
what these models compute (SPEC §4), so a source maps onto it weight for weight: :func:`fox_config_from_llama` maps
the config, :func:`fox_key_from_llama` the parameter names, and the source's own inverse frequencies become each
layer's ``rotary.temperature`` (:func:`llama_rope`). RoPE scaling types that only change the frequencies (``linear``,
``llama3``) are exact through the temperature; ``yarn`` also multiplies cos and sin by an attention factor ``s``,
which equals scaling the rotated q and k by ``s``: :func:`fold_attention_scaling` folds it into the q/k projections
(or into Qwen3's q/k norms, which come after them).
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ..configuration.fox import SelectiveRopeFoXConfig
from ..configuration.position_embedding import token_ids_in_vocabulary

ROTARY_EMBEDDINGS = {
    "llama": LlamaRotaryEmbedding,
    "mistral": MistralRotaryEmbedding,
    "qwen2": Qwen2RotaryEmbedding,
    "qwen3": Qwen3RotaryEmbedding,
}
LLAMA_FAMILY = tuple(ROTARY_EMBEDDINGS)
# Position-independent frequency rules only: `dynamic` rescales with the running length and `longrope` switches
# frequency sets at a length threshold, neither of which is a fixed temperature.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_KEY_RENAMES = [  # (source pattern, our name), applied in order to each parameter name
    (r"^model\.embed_tokens\.", "model.embeddings."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"model.layers.\1.attn."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"model.layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.layers.\1.mlp_norm."),
]


def check_llama_source(source: PreTrainedConfig) -> str:
    """The source's RoPE type; ``ValueError`` naming what is supported for anything else."""
    if source.model_type not in LLAMA_FAMILY:
        raise ValueError(f"unsupported source architecture {source.model_type!r}; supported: {list(LLAMA_FAMILY)}")
    rope_type = (source.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r} in the {source.model_type} source; supported: "
                         f"{list(SUPPORTED_ROPE_TYPES)}")
    unknown = set(getattr(source, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)} in the {source.model_type} source; supported: "
                         "'full_attention', 'sliding_attention'")
    return rope_type


def sliding_window(source: PreTrainedConfig) -> tuple[int, int] | None:
    """``(window, number of sliding layers)`` when the source attends within a sliding window shorter than its
    context (``max_position_embeddings``), else None.

    FoX attends to the whole context, so such a source converts with the window dropped: the converted model
    reproduces it on sequences up to ``window`` tokens and attends further beyond. Mistral and Qwen2/Qwen3 are treated
    alike: Mistral slides in every layer when ``sliding_window`` is set; Qwen2/Qwen3 (``use_sliding_window``) in the
    layers their ``layer_types`` mark ``sliding_attention``. A window as long as the context never takes effect.
    """
    window = getattr(source, "sliding_window", None)
    layer_types = getattr(source, "layer_types", None)
    layers = (sum(kind == "sliding_attention" for kind in layer_types) if layer_types
              else source.num_hidden_layers)
    if window is None or not layers or window >= source.max_position_embeddings:
        return None
    return window, layers


def llama_rope(source: PreTrainedConfig) -> tuple[torch.Tensor, float]:
    """The source's own inverse frequencies (float32) and attention scaling, from transformers' RoPE functions."""
    check_llama_source(source)
    rotary = ROTARY_EMBEDDINGS[source.model_type](source)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def fox_config_from_llama(source: PreTrainedConfig, **overrides) -> SelectiveRopeFoXConfig:
    """The SelectiveRopeFoX config that reproduces ``source`` (plain RoPE, no forget gate), with ``overrides``."""
    head_dim = getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads
    inv_freq, _ = llama_rope(source)
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
        **token_ids_in_vocabulary(dict(pad_token_id=source.pad_token_id, bos_token_id=source.bos_token_id,
                                       eos_token_id=source.eos_token_id), source.vocab_size),
        position_embedding="rope",
        use_forget_gate=False,
        temperature_type="rope",  # the checkpoint's temperature holds the source's own frequencies
        temperature_theta=float(source.rope_parameters["rope_theta"]),
        partial_rotary_factor=2 * inv_freq.numel() / head_dim,
    )
    return SelectiveRopeFoXConfig(**{**fields, **overrides})


def fox_key_from_llama(name: str) -> str:
    """Our parameter name for a Llama-family parameter name (``lm_head`` and ``model.norm`` keep theirs)."""
    for pattern, replacement in _KEY_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def fold_attention_scaling(name: str, tensor: torch.Tensor, scale: float, config: SelectiveRopeFoXConfig,
                           ) -> torch.Tensor:
    """``tensor`` (our parameter ``name``) with RoPE's attention scaling folded in: the rotary part of each q and k
    head is multiplied by ``scale``, at the last linear step before the rotation (the q/k norm when there is one)."""
    if scale == 1.0:
        return tensor
    targets = ("q_norm.weight", "k_norm.weight") if config.qk_norm else (
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
    if not name.endswith(targets):
        return tensor
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    factor = torch.ones(config.head_dim, dtype=torch.float64)
    factor[:rotary_dim] = scale
    if not name.endswith("norm.weight"):  # projection rows: (heads · head_dim, ...)
        factor = factor.repeat(tensor.shape[0] // config.head_dim)
    factor = factor.view(-1, *([1] * (tensor.dim() - 1)))
    return (tensor.double() * factor).to(tensor.dtype)
