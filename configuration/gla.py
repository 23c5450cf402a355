"""Configuration of SelectiveRopeGLA (field names follow flash-linear-attention's ``GLAConfig``).

Every field is type- and range-checked (see :mod:`.position_embedding`); no postponed annotations here, so the
checks stay on.
"""

import math
from typing import Literal

from huggingface_hub.dataclasses import validated_field

from .position_embedding import (
    Number,
    SelectiveRopeConfigBase,
    _require,
    at_least,
    expansion,
    fla_mlp_width,
    interval,
    layer_count,
    positive,
    strict_config,
    weight_std,
)
from .tensor_parallel import base_model_plan, gla_mixer_plan


@strict_config
class SelectiveRopeGLAConfig(SelectiveRopeConfigBase):
    """Gated Linear Attention with Selective RoPE.

    Model fields (as in flash-linear-attention's ``GLAConfig``):
        hidden_size, num_hidden_layers, num_heads (query heads), num_kv_heads (key/value heads, GQA; defaults to
        num_heads), expand_k / expand_v (key and value width = hidden_size * expand), use_short_conv and conv_size
        (causal depthwise SiLU convolutions on q, k, v), use_output_gate (swish gate after the per-head RMS norm),
        gate_logit_normalizer (``gk = logsigmoid(W x + b) / gate_logit_normalizer``), gate_low_rank_dim, clamp_min
        (optional lower clamp on ``gk``, <= 0), hidden_ratio / intermediate_size (SwiGLU MLP width), hidden_act,
        norm_eps, vocab_size, tie_word_embeddings, initializer_range.
    The Selective RoPE fields are documented in :class:`SelectiveRopeConfigBase`.
    """

    model_type = "selective_rope_gla"

    vocab_size: int = validated_field(at_least(1), default=32000)
    hidden_size: int = validated_field(at_least(1), default=2048)
    num_hidden_layers: int = validated_field(layer_count, default=24)
    num_heads: int = validated_field(at_least(1), default=4)
    num_kv_heads: int | None = validated_field(at_least(1), default=None)
    expand_k: Number = validated_field(expansion, default=0.5)
    expand_v: Number = validated_field(expansion, default=1.0)
    use_short_conv: bool = False
    conv_size: int = validated_field(at_least(1), default=4)
    use_output_gate: bool = True
    gate_logit_normalizer: Number = validated_field(positive, default=16.0)
    gate_low_rank_dim: int = validated_field(at_least(1), default=16)
    # gk = logsigmoid(...) is a log decay (<= 0): a positive clamp would make every decay a growth.
    clamp_min: Number | None = validated_field(interval(high=0), default=None)
    hidden_ratio: int | None = validated_field(at_least(1), default=4)
    intermediate_size: int | None = validated_field(at_least(1), default=None)
    hidden_act: Literal["swish", "silu"] = "swish"
    norm_eps: Number = validated_field(positive, default=1e-6)
    initializer_range: Number = validated_field(weight_std, default=0.02)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        super().__post_init__(**kwargs)

    @property
    def key_dim(self) -> int:
        return round(self.hidden_size * self.expand_k)

    @property
    def value_dim(self) -> int:
        return round(self.hidden_size * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads

    @property
    def mlp_width(self) -> int:
        return fla_mlp_width(self.hidden_size, self.hidden_ratio, self.intermediate_size)

    @property
    def rotary_head_dim(self) -> int:
        return self.head_k_dim

    @property
    def mixer_width(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def num_phase_heads(self) -> int:
        return self.num_kv_heads

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan of the base model (``configuration/tensor_parallel.py``)."""
        return base_model_plan(gla_mixer_plan(self))

    @property
    def tensor_parallel_heads(self) -> dict[str, int]:
        """The head counts tensor parallelism splits (each must divide by the number of ranks)."""
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads}

    def validate_gla(self) -> None:
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        for name, expand in (("expand_k", self.expand_k), ("expand_v", self.expand_v)):
            width = self.hidden_size * expand
            _require(math.isclose(width, round(width)) and round(width) % self.num_heads == 0 and round(width) > 0,
                     name, expand, f"hidden_size * {name} = {width} must be a positive integer divisible by "
                     f"num_heads ({self.num_heads})")
