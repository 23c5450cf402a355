"""The model families the shared model-level suite runs on: every family of the package's registry
(:mod:`selective_rope.families`) with a tiny config exercising its options. A new family adds its entry there and its
tiny config here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from selective_rope.families import FAMILIES as REGISTRY


@dataclass
class Family:
    name: str
    config_class: type
    model_class: type
    lm_class: type
    # A tiny model exercising the family's options (GQA, short convolutions, ...).
    tiny: dict = field(default_factory=dict)
    # The family's other option sets the model-level suite (test_models.py) also runs: the settings `tiny` does not
    # reach (fla's defaults among them), so every option of the family is exercised there.
    variants: dict = field(default_factory=dict)

    def with_options(self, name: str, options: dict) -> Family:
        """The same family with more config fields, named ``family-name``."""
        return replace(self, name=f"{self.name}-{name}", tiny={**self.tiny, **options})


TOKENS = dict(vocab_size=61, pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY = {
    "gla": dict(**TOKENS, hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2, expand_k=1.0,
                expand_v=1.0, use_short_conv=True, conv_size=3, intermediate_size=48, initializer_range=0.2),
    # Grouped value heads (2 query/key heads, 4 value heads), β in (0, 2).
    "gated_deltanet": dict(**TOKENS, hidden_size=32, num_hidden_layers=2, num_heads=2, num_v_heads=4, head_dim=8,
                           expand_v=1.5, use_short_conv=True, conv_size=3, allow_neg_eigval=True, intermediate_size=48,
                           initializer_range=0.2),
    # GQA, explicit head_dim, biases and every FoX Pro option.
    "fox": dict(**TOKENS, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, attention_bias=True, mlp_bias=True, qk_norm=True,
                use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True,
                initializer_range=0.2),
    # A Gated DeltaNet layer with a dense MLP, then an attention layer with a sparse MoE block (GQA, partial rotation,
    # grouped value heads); Selective RoPE settings per layer type.
    "hybrid": dict(**TOKENS, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
                   intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=24, decoder_sparse_step=2, initializer_range=0.2,
                   layer_type_position_embedding={"full_attention": {"partial_rotary_factor": 0.5},
                                                  "linear_attention": {"temperature_max": 0.5}}),
}
# Each family's other option sets the model-level suite also runs (Family.variants): the settings TINY does not reach.
VARIANTS = {
    # fla's default (no short convolutions) without the output gate; a clamp that binds (gk is about -0.04 here).
    "gla": {"plain": dict(use_short_conv=False, use_output_gate=False), "clamped": dict(clamp_min=-0.04)},
    "gated_deltanet": {"plain": dict(use_short_conv=False, use_gate=False),
                       "sigmoid_gate": dict(output_gate_activation="sigmoid")},
}
missing = sorted(set(REGISTRY) - set(TINY))
assert not missing, f"families without a tiny test config in tests/families.py: {missing}"

FAMILIES = {
    name: Family(name, spec.config_class, spec.model_class, spec.lm_class, tiny=TINY[name],
                 variants=VARIANTS.get(name, {}))
    for name, spec in REGISTRY.items()
}

# Selective RoPE options the model-level suite (test_models.py) also runs on every family, besides the defaults: those
# of the paper's official code (issue 24): the dense low-rank projection, the fixed-difference convolution, a gate of
# another rank and the "swish" name.
OPTION_VARIANTS = {
    "official": dict(phase_proj="dense_low_rank", phase_proj_rank=6, phase_conv_type="difference",
                     phase_gate_type="low_rank", phase_gate_rank=5, phase_conv_activation="swish", phase_bias=True),
}
