"""Configuration of SelectiveRopeHybrid: Gated DeltaNet and attention layers stacked by ``layer_types``, with dense or
sparse (mixture-of-experts) MLPs. Field names follow transformers' ``Qwen3NextConfig``, so Qwen3-Next and Qwen3.5
checkpoints map onto it field by field.

Each layer's mixer is built from a config of the family it comes from (:meth:`SelectiveRopeHybridConfig.layer_config`:
a ``SelectiveRopeGatedDeltaNetConfig`` for ``"linear_attention"`` layers, a ``SelectiveRopeFoXConfig`` for
``"full_attention"`` layers), so the mixers are the families' own and every rule of those configs applies.

Every field is type- and range-checked (see :mod:`.position_embedding`); no postponed annotations here, so the
checks stay on.
"""

from typing import Literal

from huggingface_hub.dataclasses import validated_field

from .fox import SelectiveRopeFoXConfig
from .gated_deltanet import SelectiveRopeGatedDeltaNetConfig
from .position_embedding import (
    InvalidConfigError,
    Number,
    SelectiveRopeConfigBase,
    _require,
    at_least,
    interval,
    layer_count,
    positive,
    strict_config,
    weight_std,
)
from .tensor_parallel import (
    attention_mixer_plan,
    base_model_plan,
    gated_deltanet_mixer_plan,
    merge_plans,
    mlp_plan,
    sparse_moe_plan,
)

LAYER_TYPES = ("linear_attention", "full_attention")  # transformers' names (Qwen3-Next, Qwen3.5)
# The Selective RoPE fields a layer type may set for itself (every field of SelectiveRopeConfigBase but `backend`).
POSITION_FIELDS = tuple(name for name in SelectiveRopeConfigBase.__annotations__ if name != "backend")


@strict_config
class SelectiveRopeHybridConfig(SelectiveRopeConfigBase):
    """Gated DeltaNet (``"linear_attention"``) and softmax attention (``"full_attention"``) layers with Selective
    RoPE, as in Qwen3-Next and Qwen3.5.

    Model fields (as in transformers' ``Qwen3NextConfig``):
        vocab_size, hidden_size, num_hidden_layers, layer_types (one of ``"linear_attention"`` /
        ``"full_attention"`` per layer; default: every fourth layer is attention, as Qwen3-Next), hidden_act,
        rms_norm_eps (every norm), initializer_range, tie_word_embeddings.
        Attention layers: num_attention_heads, num_key_value_heads, head_dim, attention_bias. Their q/k norms and the
            block and final norms are zero-centred (``x̂ · (1 + w)``), and the output gate is carried in ``q_proj``
            (SelectiveRopeFoX's ``output_gate_in_q_proj``).
        Gated DeltaNet layers: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
            linear_value_head_dim, linear_conv_kernel_dim (one causal SiLU convolution per q, k, v).
        MLPs: intermediate_size (the dense SwiGLU MLP); with ``num_experts > 0`` a layer ``i`` not in
            ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0`` has a sparse MoE block instead: a softmax
            top-``num_experts_per_tok`` router (``norm_topk_prob`` renormalises the chosen weights), ``num_experts``
            SwiGLU experts of width ``moe_intermediate_size`` and a shared expert of width
            ``shared_expert_intermediate_size`` behind a sigmoid gate. ``output_router_logits`` returns the router
            logits and adds ``router_aux_loss_coef`` times the load-balancing loss to the training loss.
    Additions:
        use_forget_gate: give the attention layers FoX's forget gate (off for a port of a source).
        layer_type_position_embedding: per layer type, Selective RoPE fields that differ from the shared ones, e.g.
            ``{"full_attention": {"partial_rotary_factor": 0.25, "phase_bias": True}}``; the shared fields
            (:class:`SelectiveRopeConfigBase`) apply to every field a layer type does not set.
    """

    model_type = "selective_rope_hybrid"
    attribute_map = {"norm_eps": "rms_norm_eps"}  # the name the shared model reads

    vocab_size: int = validated_field(at_least(1), default=151936)
    hidden_size: int = validated_field(at_least(1), default=2048)
    num_hidden_layers: int = validated_field(layer_count, default=48)
    layer_types: list[str] | None = None
    intermediate_size: int = validated_field(at_least(1), default=5632)
    hidden_act: Literal["silu", "swish"] = "silu"
    rms_norm_eps: Number = validated_field(positive, default=1e-6)
    num_attention_heads: int = validated_field(at_least(1), default=16)
    num_key_value_heads: int = validated_field(at_least(1), default=2)
    head_dim: int = validated_field(at_least(1), default=256)
    attention_bias: bool = False
    use_forget_gate: bool = False
    linear_num_key_heads: int = validated_field(at_least(1), default=16)
    linear_num_value_heads: int = validated_field(at_least(1), default=32)
    linear_key_head_dim: int = validated_field(at_least(1), default=128)
    linear_value_head_dim: int = validated_field(at_least(1), default=128)
    linear_conv_kernel_dim: int = validated_field(at_least(1), default=4)
    num_experts: int = validated_field(at_least(0), default=0)
    num_experts_per_tok: int = validated_field(at_least(1), default=1)
    moe_intermediate_size: int = validated_field(at_least(1), default=512)
    shared_expert_intermediate_size: int = validated_field(at_least(1), default=512)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = validated_field(at_least(1), default=1)
    mlp_only_layers: list[int] | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: Number = validated_field(interval(), default=0.001)
    layer_type_position_embedding: dict | None = None
    initializer_range: Number = validated_field(weight_std, default=0.02)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        if self.layer_type_position_embedding is None:
            self.layer_type_position_embedding = {}
        super().__post_init__(**kwargs)

    # -- what the shared model reads ---------------------------------------------------------------------------------
    @property
    def mlp_width(self) -> int:
        return self.intermediate_size

    @property
    def mixer_width(self) -> int:
        """The narrower of the two mixers' projection widths (the size estimate is a lower bound): an attention
        layer's q_proj (queries and output gate), k_proj and v_proj; a Gated DeltaNet layer's q, k and v."""
        attention = self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        linear = (2 * self.linear_key_head_dim * self.linear_num_key_heads
                  + self.linear_value_head_dim * self.linear_num_value_heads)
        return min(attention, linear)

    def estimated_parameters(self) -> int:
        """The shared lower bound plus the routed experts (three ``hidden x moe_intermediate_size`` matrices each)."""
        sparse_layers = sum(map(self.is_sparse_layer, range(self.num_hidden_layers)))
        experts = sparse_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
        return super().estimated_parameters() + experts

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan of the base model (``configuration/tensor_parallel.py``): the mixer plans
        of the layer types present and the MLP rules of the MLP kinds present (dense, sparse MoE), by pattern."""
        mixers = {"linear_attention": gated_deltanet_mixer_plan, "full_attention": attention_mixer_plan}
        kinds = sorted(set(self.layer_types))
        sparse = [self.is_sparse_layer(i) for i in range(self.num_hidden_layers)]
        mlps = ([mlp_plan()] if not all(sparse) else []) + ([sparse_moe_plan()] if any(sparse) else [])
        return base_model_plan(merge_plans(*(mixers[kind](self.layer_config(kind)) for kind in kinds)),
                               merge_plans(*mlps))

    @property
    def tensor_parallel_heads(self) -> dict[str, int]:
        """The head counts tensor parallelism splits, of the layer types present (each must divide by the number of
        ranks; query heads then split in whole GQA groups, linear value heads behind their key head)."""
        heads = {}
        if "full_attention" in self.layer_types:
            heads |= {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads}
        if "linear_attention" in self.layer_types:
            heads |= {"linear_num_key_heads": self.linear_num_key_heads,
                      "linear_num_value_heads": self.linear_num_value_heads}
        return heads

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has a sparse MoE block (Qwen3-Next's rule) rather than the dense MLP."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def layer_config(self, layer_type: str) -> SelectiveRopeFoXConfig | SelectiveRopeGatedDeltaNetConfig:
        """The config of the family whose mixer runs the layers of ``layer_type``, with that type's Selective RoPE
        fields."""
        _require(layer_type in LAYER_TYPES, "layer_type", layer_type, f"expected one of {list(LAYER_TYPES)}")
        position = {name: getattr(self, name) for name in POSITION_FIELDS}
        position.update(self.layer_type_position_embedding.get(layer_type, {}))
        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, hidden_act=self.hidden_act,
                      num_hidden_layers=self.num_hidden_layers, intermediate_size=self.intermediate_size,
                      initializer_range=self.initializer_range, backend=self.backend, **position)
        try:
            if layer_type == "full_attention":
                return SelectiveRopeFoXConfig(
                    **common, num_attention_heads=self.num_attention_heads,
                    num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                    rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias,
                    use_forget_gate=self.use_forget_gate, qk_norm=True, qk_norm_zero_centred=True,
                    use_output_gate=True, output_gate_in_q_proj=True)
            expand_v = self.linear_value_head_dim / self.linear_key_head_dim
            return SelectiveRopeGatedDeltaNetConfig(
                **common, num_heads=self.linear_num_key_heads, num_v_heads=self.linear_num_value_heads,
                head_dim=self.linear_key_head_dim, expand_v=int(expand_v) if expand_v.is_integer() else expand_v,
                use_short_conv=True, conv_size=self.linear_conv_kernel_dim, use_gate=True,
                output_gate_activation="silu", norm_eps=self.rms_norm_eps)
        except ValueError as error:  # name the layer type: the field names are the family's
            raise InvalidConfigError(f"the {layer_type} layers' config is invalid: {error}") from error

    # -- rules between fields ----------------------------------------------------------------------------------------
    def validate_hybrid(self) -> None:
        types = self.layer_types
        _require(len(types) == self.num_hidden_layers, "layer_types", types,
                 f"expected one entry per layer ({self.num_hidden_layers}, num_hidden_layers)")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        _require(not unknown, "layer_types", unknown, f"expected entries among {list(LAYER_TYPES)}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        _require(not outside, "mlp_only_layers", outside, f"layer indices must be in [0, {self.num_hidden_layers})")
        if self.num_experts:
            _require(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok", self.num_experts_per_tok,
                     f"must be at most num_experts ({self.num_experts})")
        per_type = self.layer_type_position_embedding
        unknown = sorted(set(per_type) - set(LAYER_TYPES))
        _require(not unknown, "layer_type_position_embedding", unknown,
                 f"keys must be layer types among {list(LAYER_TYPES)}")
        for layer_type, fields in per_type.items():
            _require(isinstance(fields, dict), f"layer_type_position_embedding[{layer_type!r}]", fields,
                     "expected a dict of Selective RoPE fields")
            unknown = sorted(set(fields) - set(POSITION_FIELDS))
            _require(not unknown, f"layer_type_position_embedding[{layer_type!r}]", unknown,
                     f"keys must be Selective RoPE fields among {list(POSITION_FIELDS)}")
        for layer_type in set(types):  # builds (and so checks) each layer type's config
            self.layer_config(layer_type)

    def validate_position_embedding(self) -> None:
        """Checked per layer type by ``validate_hybrid`` (head sizes differ between the two kinds of layers)."""
