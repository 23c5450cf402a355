"""The model families, listed once.

Everything that handles "each family" reads this registry: the Auto registration (``import selective_rope``), PEFT's
LoRA defaults (:mod:`selective_rope.lora`), the demo, the command line, the converter, the benchmarks, the examples
and the tests' shared model suite (``tests/families.py`` adds a tiny config per family). A new family is one entry in
:data:`FAMILIES` (plus its tiny test config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .configuration import (
    SelectiveRopeFoXConfig,
    SelectiveRopeGatedDeltaNetConfig,
    SelectiveRopeGLAConfig,
    SelectiveRopeHybridConfig,
)
from .modeling import (
    SelectiveRopeFoXForCausalLM,
    SelectiveRopeFoXModel,
    SelectiveRopeGatedDeltaNetForCausalLM,
    SelectiveRopeGatedDeltaNetModel,
    SelectiveRopeGLAForCausalLM,
    SelectiveRopeGLAModel,
    SelectiveRopeHybridForCausalLM,
    SelectiveRopeHybridModel,
)

# The module names LoRA adapts by default in every family (why these: selective_rope/lora.py).
MIXER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
# The hybrid: every projection of both layer kinds (attention: q, k, v, o; Gated DeltaNet: q, k, v, o, the output
# gate g and the decay / write-strength projections a, b) and the dense MLPs and shared experts; not the routed
# experts (stacked 3-D parameters, not Linear modules) nor the routers (see selective_rope/lora.py).
HYBRID_TARGETS = [*MIXER_TARGETS, "a_proj", "b_proj", *MLP_TARGETS]


@dataclass(frozen=True)
class Family:
    """One model family: its classes and the few facts that differ between families.

    Args:
        name: the short name used by the command line, the demo, the benchmarks and the tests (``"gla"``).
        title: the name people read (``"GLA"``).
        config_class, model_class, lm_class: the config, the base model and the causal LM.
        heads: ``(hidden_size, num_heads) -> config fields`` for ``num_heads`` query heads of ``hidden_size //
            num_heads`` channels (no grouping), short convolutions on where the family has them; value (and GLA's
            key) widths keep the family's defaults.
        square: the fields that make every key and value head ``hidden_size // num_heads`` wide too (the layout of
            the demo and the synthetic tasks).
        fla_model_type: the ``model_type`` of flash-linear-attention's counterpart (converted onto this family), if
            any.
        official_model_type: the ``model_type`` of the paper's own code that converts onto this family, if any.
        lora_targets: the modules LoRA adapts when ``target_modules`` is not given.
    """

    name: str
    title: str
    config_class: type
    model_class: type
    lm_class: type
    heads: Callable[[int, int], dict]
    square: dict
    fla_model_type: str | None
    official_model_type: str | None
    lora_targets: list[str] = field(default_factory=lambda: MIXER_TARGETS + MLP_TARGETS)

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    def head_layout(self, hidden_size: int, num_heads: int, square: bool = False) -> dict:
        """Config fields for ``num_heads`` heads over ``hidden_size`` (see ``heads`` and ``square``)."""
        return {**self.heads(hidden_size, num_heads), **(self.square if square else {})}


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("gla", "GLA", SelectiveRopeGLAConfig, SelectiveRopeGLAModel, SelectiveRopeGLAForCausalLM,
               heads=lambda hidden, heads: dict(num_heads=heads, use_short_conv=True),
               square=dict(expand_k=1.0, expand_v=1.0),
               fla_model_type="gla", official_model_type="gla"),
        Family("gated_deltanet", "Gated DeltaNet", SelectiveRopeGatedDeltaNetConfig, SelectiveRopeGatedDeltaNetModel,
               SelectiveRopeGatedDeltaNetForCausalLM,
               heads=lambda hidden, heads: dict(num_heads=heads, head_dim=hidden // heads, use_short_conv=True),
               square=dict(expand_v=1.0),
               fla_model_type="gated_deltanet", official_model_type="gated_deltanet"),
        Family("fox", "FoX", SelectiveRopeFoXConfig, SelectiveRopeFoXModel, SelectiveRopeFoXForCausalLM,
               heads=lambda hidden, heads: dict(num_attention_heads=heads, num_key_value_heads=heads),
               square={},
               fla_model_type="forgetting_transformer", official_model_type="transformer"),
        # One attention layer after each Gated DeltaNet layer (every head square: the demo's layout).
        Family("hybrid", "Hybrid", SelectiveRopeHybridConfig, SelectiveRopeHybridModel, SelectiveRopeHybridForCausalLM,
               heads=lambda hidden, heads: dict(
                   num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                   linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=hidden // heads,
                   linear_value_head_dim=hidden // heads),
               square={},
               fla_model_type=None, official_model_type=None, lora_targets=HYBRID_TARGETS),
    )
}
FAMILY_NAMES = tuple(FAMILIES)


def get_family(name: str) -> Family:
    """The family called ``name``; a ``ValueError`` naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {list(FAMILIES)}")
    return FAMILIES[name]


def family_of_model_type(model_type: str) -> Family:
    """The family whose config has ``model_type`` (``"selective_rope_gla"`` -> GLA)."""
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    raise ValueError(f"unknown model_type {model_type!r}; expected one of "
                     f"{[family.model_type for family in FAMILIES.values()]}")
