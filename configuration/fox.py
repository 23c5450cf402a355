"""Configuration of SelectiveRopeFoX (field names follow transformers' ``LlamaConfig``, so Llama-family checkpoints
map onto it field by field).

Every field is type- and range-checked (see :mod:`.position_embedding`); no postponed annotations here, so the
checks stay on.
"""

from typing import Literal

from huggingface_hub.dataclasses import validated_field

from .position_embedding import (
    Number,
    SelectiveRopeConfigBase,
    _require,
    at_least,
    layer_count,
    positive,
    strict_config,
    weight_std,
)
from .tensor_parallel import attention_mixer_plan, base_model_plan


@strict_config
class SelectiveRopeFoXConfig(SelectiveRopeConfigBase):
    """Forgetting Transformer (softmax attention with a forget gate) with Selective RoPE: a superset of Llama.

    Model fields (as in transformers' ``LlamaConfig``):
        vocab_size, hidden_size, intermediate_size (SwiGLU MLP width), num_hidden_layers, num_attention_heads,
        num_key_value_heads (GQA; defaults to num_attention_heads), head_dim (defaults to hidden_size //
        num_attention_heads), hidden_act, rms_norm_eps, attention_bias (bias on q, k, v and o projections),
        mlp_bias, tie_word_embeddings, initializer_range.
    Additions:
        attention_output_bias: bias on the output projection; ``None`` follows ``attention_bias`` (Qwen2 has biases on
            q, k, v only: ``attention_bias=True, attention_output_bias=False``).
        use_forget_gate: the FoX forget gate, ``log f_t = logsigmoid(W_f x_t + b_f)`` per query head, added to the
            attention scores as ``Σ_{s=τ+1..t} log f_s``. ``False`` gives plain softmax attention.
        FoX "Pro" options: qk_norm (per-head RMS norm of q and k, weights of size head_dim as in Qwen3, applied before
            the rotation), use_output_gate (``o * sigmoid(W_g x)``), use_output_norm (per-head RMS norm of the
            attention output), use_k_shift / use_v_shift (data-dependent token shift
            ``k'_t = α_t k_{t-1} + (1 - α_t) k_t`` with ``α_t = sigmoid(W x_t)`` per key/value head).
        output_gate_in_q_proj: the output gate's projection is carried in ``q_proj``, which then emits ``2 ·
            head_dim`` per head (the query, then that head's gate: Qwen3-Next's and Qwen3.5's layout); needs
            ``use_output_gate``.
        qk_norm_zero_centred: the q/k norms scale by ``1 + w`` (``w`` starting at 0, Qwen3-Next's and Qwen3.5's
            layout) instead of ``w``; needs ``qk_norm``.
    The Selective RoPE fields are documented in :class:`SelectiveRopeConfigBase`; the phases are per key/value head.
    """

    model_type = "selective_rope_fox"
    attribute_map = {"norm_eps": "rms_norm_eps"}  # the name the other families and the shared model use

    vocab_size: int = validated_field(at_least(1), default=32000)
    hidden_size: int = validated_field(at_least(1), default=4096)
    intermediate_size: int = validated_field(at_least(1), default=11008)
    num_hidden_layers: int = validated_field(layer_count, default=32)
    num_attention_heads: int = validated_field(at_least(1), default=32)
    num_key_value_heads: int | None = validated_field(at_least(1), default=None)
    head_dim: int | None = validated_field(at_least(1), default=None)
    hidden_act: Literal["silu", "swish"] = "silu"
    rms_norm_eps: Number = validated_field(positive, default=1e-6)
    attention_bias: bool = False
    attention_output_bias: bool | None = None
    mlp_bias: bool = False
    use_forget_gate: bool = True
    qk_norm: bool = False
    use_output_gate: bool = False
    output_gate_in_q_proj: bool = False
    qk_norm_zero_centred: bool = False
    use_output_norm: bool = False
    use_k_shift: bool = False
    use_v_shift: bool = False
    initializer_range: Number = validated_field(weight_std, default=0.02)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            _require(self.hidden_size >= self.num_attention_heads, "hidden_size", self.hidden_size,
                     f"head_dim defaults to hidden_size // num_attention_heads ({self.num_attention_heads}), which "
                     "must be >= 1; pass head_dim or more hidden units")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        super().__post_init__(**kwargs)

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size

    @property
    def mlp_has_bias(self) -> bool:
        return self.mlp_bias

    @property
    def rotary_head_dim(self) -> int:
        return self.head_dim

    @property
    def mixer_width(self) -> int:
        return self.head_dim * (self.num_attention_heads + 2 * self.num_key_value_heads)

    @property
    def num_phase_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan of the base model (``configuration/tensor_parallel.py``)."""
        return base_model_plan(attention_mixer_plan(self))

    @property
    def tensor_parallel_heads(self) -> dict[str, int]:
        """The head counts tensor parallelism splits (each must divide by the number of ranks)."""
        return {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads}

    def validate_fox(self) -> None:
        _require(not self.output_gate_in_q_proj or self.use_output_gate, "output_gate_in_q_proj",
                 self.output_gate_in_q_proj, "the output gate's projection needs use_output_gate=True")
        _require(not self.qk_norm_zero_centred or self.qk_norm, "qk_norm_zero_centred", self.qk_norm_zero_centred,
                 "zero-centred q/k norms need qk_norm=True")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 self.num_key_value_heads, f"num_attention_heads ({self.num_attention_heads}) must be a multiple of it")
