"""Configuration of SelectiveRopeGLA (field names follow flash-linear-attention's ``GLAConfig``)."""

from __future__ import annotations

import math

from .position_embedding import SelectiveRopeConfigBase, _require


class SelectiveRopeGLAConfig(SelectiveRopeConfigBase):
    """Gated Linear Attention with Selective RoPE.

    Model fields (as in flash-linear-attention's ``GLAConfig``):
        hidden_size, num_hidden_layers, num_heads (query heads), num_kv_heads (key/value heads, GQA; defaults to
        num_heads), expand_k / expand_v (key and value width = hidden_size * expand), use_short_conv and conv_size
        (causal depthwise SiLU convolutions on q, k, v), use_output_gate (swish gate after the per-head RMS norm),
        gate_logit_normalizer (``gk = logsigmoid(W x + b) / gate_logit_normalizer``), gate_low_rank_dim, clamp_min
        (optional lower clamp on ``gk``), hidden_ratio / intermediate_size (SwiGLU MLP width), hidden_act,
        norm_eps, vocab_size, tie_word_embeddings, initializer_range.
    The Selective RoPE fields are documented in :class:`SelectiveRopeConfigBase`.
    """

    model_type = "selective_rope_gla"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_heads: int = 4
    num_kv_heads: int | None = None
    expand_k: float = 0.5
    expand_v: float = 1.0
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_gate: bool = True
    gate_logit_normalizer: float = 16.0
    gate_low_rank_dim: int = 16
    clamp_min: float | None = None
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    hidden_act: str = "swish"
    norm_eps: float = 1e-6
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        super().__post_init__(**kwargs)
        self.validate_gla()
        self.validate_position_embedding(head_dim=self.head_k_dim, num_key_heads=self.num_kv_heads)

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

    def validate_gla(self) -> None:
        _require(self.num_heads >= 1 and self.num_kv_heads >= 1, "num_kv_heads", self.num_kv_heads,
                 "num_heads and num_kv_heads must be >= 1")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        for name, expand in (("expand_k", self.expand_k), ("expand_v", self.expand_v)):
            width = self.hidden_size * expand
            _require(expand > 0 and math.isclose(width, round(width)) and round(width) % self.num_heads == 0,
                     name, expand, f"hidden_size * {name} = {width} must be a positive integer divisible by "
                     f"num_heads ({self.num_heads})")
        _require(self.conv_size >= 1 or not self.use_short_conv, "conv_size", self.conv_size, "must be >= 1")
        _require(self.gate_logit_normalizer > 0, "gate_logit_normalizer", self.gate_logit_normalizer, "must be > 0")
        _require(self.hidden_act in ("swish", "silu"), "hidden_act", self.hidden_act,
                 "expected 'swish' or 'silu' (the SwiGLU MLP and output gate)")
