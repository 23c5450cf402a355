"""Configuration of SelectiveRopeGatedDeltaNet (field names follow flash-linear-attention's ``GatedDeltaNetConfig``)."""

from __future__ import annotations

import math

from .position_embedding import SelectiveRopeConfigBase, _one_of, _require

OUTPUT_GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


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
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 2048
    num_hidden_layers: int = 21
    # fla's default is 6 heads of 256; Selective RoPE splits hidden_size into one chunk per head, and 2048 does not
    # split into 6, so the default here is 4 heads of 256 (key width 1024, value width 2048).
    num_heads: int = 4
    num_v_heads: int | None = None
    head_dim: int = 256
    expand_v: float = 2.0
    use_short_conv: bool = True
    conv_size: int = 4
    allow_neg_eigval: bool = False
    use_gate: bool = True
    output_gate_activation: str = "swish"
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
        if self.num_v_heads is None:
            self.num_v_heads = self.num_heads
        super().__post_init__(**kwargs)
        self.validate_gated_deltanet()
        self.validate_position_embedding(head_dim=self.head_dim, num_key_heads=self.num_heads)

    @property
    def head_v_dim(self) -> int:
        return round(self.head_dim * self.expand_v)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def validate_gated_deltanet(self) -> None:
        _require(self.num_heads >= 1, "num_heads", self.num_heads, "must be >= 1")
        _require(self.num_v_heads >= 1 and self.num_v_heads % self.num_heads == 0, "num_v_heads", self.num_v_heads,
                 f"must be a positive multiple of num_heads ({self.num_heads})")
        _require(self.head_dim >= 1, "head_dim", self.head_dim, "must be >= 1")
        width = self.head_dim * self.expand_v
        _require(self.expand_v > 0 and math.isclose(width, round(width)), "expand_v", self.expand_v,
                 f"head_dim * expand_v = {width} must be a positive integer (the value head size)")
        _require(self.conv_size >= 1 or not self.use_short_conv, "conv_size", self.conv_size, "must be >= 1")
        _one_of("output_gate_activation", self.output_gate_activation, OUTPUT_GATE_ACTIVATIONS)
        _require(self.hidden_act in ("swish", "silu"), "hidden_act", self.hidden_act,
                 "expected 'swish' or 'silu' (the SwiGLU MLP)")
