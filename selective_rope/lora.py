"""PEFT defaults: what LoRA adapts in our models when the user names no ``target_modules``.

PEFT picks LoRA's target modules from ``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``
keyed by ``config.model_type``; unknown model types must name ``target_modules``. :func:`register_lora_defaults`
(called by ``import selective_rope``) adds our model types, so ``get_peft_model(model, LoraConfig(r=8))``
works as it does for Llama.

What is adapted, per block (every family uses these names; a name that a configuration does not build, such as
FoX's ``g_proj`` without ``use_output_gate``, is simply absent):

* the mixer's main projections: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and the output gate ``g_proj``
  (GLA and Gated DeltaNet always have it, width ``hidden -> value width``; FoX with ``use_output_gate``);
* the SwiGLU MLP: ``gate_proj``, ``up_proj``, ``down_proj``.

What is deliberately *not* adapted:

* the Selective RoPE module (``rotary.*``: ``phase_proj``, ``phase_gate_proj``, ``phase_conv``, ``phase_bias``,
  ``temperature``). Most of it is not ``nn.Linear`` (per-head einsum weights, 1-D parameters), its outputs are a
  handful of phase values per head (a rank-r update of a map onto ``Hk`` or ``Hk * R/2`` outputs is barely low-rank),
  and it is kept in float32 and is tiny (a few thousand parameters per layer). To learn the phases during LoRA
  fine-tuning, e.g. after retrofitting Selective RoPE onto a RoPE checkpoint, train the module in full:
  ``LoraConfig(r=8, modules_to_save=["rotary"])``.
* the decay, forget and write-strength projections: GLA's low-rank forget gate ``gk_proj.{0,1}``, Gated DeltaNet's
  ``a_proj``/``b_proj`` (one output per value head) and ``A_log``/``dt_bias`` (1-D), FoX's forget gate ``f_proj``
  and key/value shift gates (one output per head). They map onto one value per head: LoRA there is not a low-rank
  update of anything, and perturbing a converted model's "no forgetting" gate is a poor default. Add them to
  ``target_modules`` or ``modules_to_save`` explicitly when wanted.
* embeddings and the LM head (as PEFT does for Llama).

The hybrid (``selective_rope_hybrid``) adapts every projection of both layer kinds: the attention layers' ``q_proj``
(which also carries the output gate), ``k_proj``, ``v_proj``, ``o_proj``; the Gated DeltaNet layers' ``q_proj``,
``k_proj``, ``v_proj``, ``g_proj``, ``o_proj`` and ``a_proj`` / ``b_proj``; the dense MLPs and each MoE block's shared
expert (``gate_proj``, ``up_proj``, ``down_proj``). The routed experts are stacked 3-D parameters
(``mlp.experts.gate_up_proj`` / ``down_proj``), not ``nn.Linear`` modules: LoRA leaves them (and the routers,
``mlp.gate``, and ``shared_expert_gate``) frozen; train them in full with ``modules_to_save=["experts"]`` if wanted.

PEFT's own default for Llama is ``q_proj`` and ``v_proj`` only. We adapt every main linear map instead (as QLoRA
recommends and ``target_modules="all-linear"`` would, minus the small gates above): for these models fine-tuning
often has to adapt to a new position embedding (retrofitted checkpoints), which q/v-only adapters do poorly.

Remote code (a saved model loaded with ``trust_remote_code=True`` where this package is not installed) does not
run this registration: name ``target_modules`` there (the list above).
"""

from __future__ import annotations

from .families import FAMILIES, MIXER_TARGETS, MLP_TARGETS

__all__ = ["LORA_TARGET_MODULES", "MIXER_TARGETS", "MLP_TARGETS", "register_lora_defaults"]

#: ``model_type -> LoRA target modules`` registered with PEFT (each family's ``lora_targets``).
LORA_TARGET_MODULES: dict[str, list[str]] = {family.model_type: family.lora_targets for family in FAMILIES.values()}


def register_lora_defaults() -> bool:
    """Register :data:`LORA_TARGET_MODULES` with PEFT (entries already present are left alone).

    Returns False when PEFT cannot be imported (it is a dependency, but importing ``selective_rope`` must not fail
    without it). Importing PEFT after transformers costs about 0.1-0.3 s.
    """
    try:
        from peft.utils import constants
    except Exception:  # a missing or broken peft must never break `import selective_rope`
        return False
    for model_type, targets in LORA_TARGET_MODULES.items():
        constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(model_type, list(targets))
    return True
