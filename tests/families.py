"""The model families the shared model-level suite runs on. A new family adds one entry here."""

from __future__ import annotations

from dataclasses import dataclass, field

from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM, SelectiveRopeGLAModel


@dataclass
class Family:
    name: str
    config_class: type
    model_class: type
    lm_class: type
    # A tiny model exercising the family's options (GQA, short convolutions, ...).
    tiny: dict = field(default_factory=dict)


FAMILIES = {
    "gla": Family(
        "gla",
        SelectiveRopeGLAConfig,
        SelectiveRopeGLAModel,
        SelectiveRopeGLAForCausalLM,
        tiny=dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2, expand_k=1.0,
                  expand_v=1.0, use_short_conv=True, conv_size=3, intermediate_size=48, initializer_range=0.2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2),
    ),
}
