"""flash-linear-attention checkpoints (``gla``, ``gated_deltanet``, ``forgetting_transformer``) as our families.

fla's models are NoPE. Our GLA and Gated DeltaNet mixers use fla's parameter names and layouts, so their weights map
one to one (GLA's output norm is ``g_norm`` here, ``g_norm_swish_gate`` there); fla's Forgetting Transformer maps
onto SelectiveRopeFoX (q/k/v/o, ``f_proj``, optional output gate ``g_proj``). The source config is read as plain
JSON: importing fla would re-register transformers' mamba classes, and nothing here needs its code.

Options with no counterpart here are refused by name rather than approximated.
"""

from __future__ import annotations

import re

from selective_rope.families import FAMILIES

from ..configuration.fox import SelectiveRopeFoXConfig
from ..configuration.gated_deltanet import SelectiveRopeGatedDeltaNetConfig
from ..configuration.gla import SelectiveRopeGLAConfig
from ..configuration.position_embedding import fla_mlp_width, token_ids_in_vocabulary

# gla, gated_deltanet, forgetting_transformer
FLA_MODEL_TYPES = tuple(family.fla_model_type for family in FAMILIES.values() if family.fla_model_type)
_TOKENS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "initializer_range")


def _check_source(source: dict, field: str, ok, allowed: str) -> None:
    """Refuse a source checkpoint whose config field ``field`` fails ``ok`` (an option we cannot convert)."""
    value = source.get(field)
    if not ok(value):
        raise ValueError(f"unsupported {source['model_type']} source: {field}={value!r} ({allowed})")


def _copy(source: dict, names) -> dict:
    """The fields ``names`` that ``source`` has; token ids that name no row of its vocabulary become None."""
    fields = {name: source[name] for name in names if name in source}
    ids = {name: value for name, value in fields.items() if name.endswith("_token_id")}
    if not ids or source.get("vocab_size") is None:
        return fields
    return {**fields, **token_ids_in_vocabulary(ids, source["vocab_size"])}


def fla_config(source: dict, **overrides):
    """Our config reproducing the fla config ``source`` (a ``config.json`` dict), NoPE, with ``overrides``."""
    kind = source.get("model_type")
    if kind not in FLA_MODEL_TYPES:
        raise ValueError(f"unsupported flash-linear-attention model_type {kind!r}; supported: {list(FLA_MODEL_TYPES)}")
    _check_source(source, "attn", lambda v: v is None, "hybrid softmax-attention layers are not supported")
    common = dict(_copy(source, _TOKENS), position_embedding="nope", hidden_size=source["hidden_size"],
                  num_hidden_layers=source["num_hidden_layers"])

    if kind == "gla":
        for field, ok, allowed in [
            ("feature_map", lambda v: v is None, "feature maps are not supported"),
            ("use_gk", lambda v: v in (None, True), "the key-wise forget gate must be on"),
            ("use_gv", lambda v: not v, "value-wise gates are not supported"),
            ("elementwise_affine", lambda v: v in (None, True), "the output norm must have a weight"),
            ("hidden_act", lambda v: v in (None, "swish", "silu"), "fla uses it as the output-gate activation; "
                                                                   "ours is swish"),
        ]:
            _check_source(source, field, ok, allowed)
        fields = _copy(source, ("num_heads", "num_kv_heads", "expand_k", "expand_v", "use_short_conv", "conv_size",
                                "use_output_gate", "clamp_min", "hidden_ratio", "intermediate_size", "hidden_act",
                                "norm_eps"))
        return SelectiveRopeGLAConfig(**{**common, **fields, **overrides})

    if kind == "gated_deltanet":
        fields = _copy(source, ("num_heads", "num_v_heads", "head_dim", "expand_v", "use_short_conv", "conv_size",
                                "allow_neg_eigval", "use_gate", "output_gate_activation", "hidden_ratio",
                                "intermediate_size", "hidden_act", "norm_eps"))
        return SelectiveRopeGatedDeltaNetConfig(**{**common, **fields, **overrides})

    _check_source(source, "window_size", lambda v: v is None, "sliding windows are not supported")
    _check_source(source, "qk_norm", lambda v: not v, "fla's q/k GroupNorm (per head and channel, eps 1e-5) has no "
                                                      "counterpart in SelectiveRopeFoX's Qwen3-style q/k norm")
    _check_source(source, "elementwise_affine", lambda v: v in (None, True), "norms must have weights")
    hidden, heads = source["hidden_size"], source["num_heads"]
    fields = dict(
        num_attention_heads=heads,
        num_key_value_heads=source.get("num_kv_heads") or heads,
        head_dim=hidden // heads,
        intermediate_size=fla_mlp_width(hidden, source.get("hidden_ratio", 4), source.get("intermediate_size")),
        hidden_act=source.get("hidden_act", "swish"),
        rms_norm_eps=source.get("norm_eps", 1e-6),
        attention_bias=bool(source.get("qkv_bias", False)),
        attention_output_bias=False,
        use_forget_gate=True,
        use_output_gate=bool(source.get("use_output_gate", False)),
    )
    return SelectiveRopeFoXConfig(**{**common, **fields, **overrides})


def fla_key(model_type: str, name: str) -> str:
    """Our parameter name for an fla parameter name."""
    if model_type == "gla":
        return re.sub(r"\.attn\.g_norm_swish_gate\.", ".attn.g_norm.", name)
    return name
