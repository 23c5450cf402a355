"""Configuration of SelectiveRopeGatedDeltaNet (field names follow flash-linear-attention's ``GatedDeltaNetConfig``).

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
    layer_count,
    positive,
    strict_config,
    weight_std,
)
from .tensor_parallel import base_model_plan, gated_deltanet_mixer_plan


@strict_config
class SelectiveRopeGatedDeltaNetConfig(SelectiveRopeConfigBase):
    """Gated DeltaNet with Selective RoPE.

    Model fields (as in flash-linear-attention's ``GatedDeltaNetConfig``):
        hidden_size, num_hidden_layers, num_heads (query/key heads), num_v_heads (value heads; defaults to num_heads,
        may be a multiple of it: each query/key head then serves ``num_v_heads // num_heads`` value heads), head_dim
        (query/key head size), expand_v (value head size = head_dim * expand_v), use_short_conv and conv_size (causal
        depthwise SiLU convolutions on q, k, v), allow_neg_eigval (``β`` in (0, 2) instead of (0, 1)), use_gate and
        output_gate_activation (gated RMS norm on the output), hidden_ratio / intermediate_size (SwiGLU MLP width),
        hidden_act, norm_eps, vocab_size, tie_word_embeddings, initializer_range.
    The Selective RoPE fields are documented in :class:`SelectiveRopeConfigBase`; the phases are per query/key head.
    """

    model_type = "selective_rope_gated_deltanet"

    vocab_size: int = validated_field(at_least(1), default=32000)
    hidden_size: int = validated_field(at_least(1), default=2048)
    num_hidden_layers: int = validated_field(layer_count, default=21)
    # fla's default is 6 heads of 256; Selective RoPE splits hidden_size into one chunk per head, and 2048 does not
    # split into 6, so the default here is 4 heads of 256 (key width 1024, value width 2048).
    num_heads: int = validated_field(at_least(1), default=4)
    num_v_heads: int | None = validated_field(at_least(1), default=None)
    head_dim: int = validated_field(at_least(1), default=256)
    expand_v: Number = validated_field(expansion, default=2.0)
    use_short_conv: bool = True
    conv_size: int = validated_field(at_least(1), default=4)
    allow_neg_eigval: bool = False
    use_gate: bool = True
    output_gate_activation: Literal["swish", "silu", "sigmoid"] = "swish"
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
        if self.num_v_heads is None:
            self.num_v_heads = self.num_heads
        super().__post_init__(**kwargs)

    @property
    def head_v_dim(self) -> int:
        return round(self.head_dim * self.expand_v)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def mlp_width(self) -> int:
        return fla_mlp_width(self.hidden_size, self.hidden_ratio, self.intermediate_size)

    @property
    def rotary_head_dim(self) -> int:
        return self.head_dim

    @property
    def mixer_width(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def num_phase_heads(self) -> int:
        return self.num_heads

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan of the base model (``configuration/tensor_parallel.py``)."""
        return base_model_plan(gated_deltanet_mixer_plan(self))

    @property
    def tensor_parallel_heads(self) -> dict[str, int]:
        """The head counts tensor parallelism splits (each must divide by the number of ranks; the value heads then
        split in whole groups)."""
        return {"num_heads": self.num_heads, "num_v_heads": self.num_v_heads}

    def validate_gated_deltanet(self) -> None:
        _require(self.num_v_heads % self.num_heads == 0, "num_v_heads", self.num_v_heads,
                 f"must be a multiple of num_heads ({self.num_heads})")
        width = self.head_dim * self.expand_v
        _require(math.isclose(width, round(width)) and round(width) > 0, "expand_v", self.expand_v,
                 f"head_dim * expand_v = {width} must be a positive integer (the value head size)")
