"""How a converted model's new parameters start, so that it computes exactly what its source computes.

Selective RoPE's phase increment is ``c = (conv(P(u)) + exp(b)) · sigmoid(G(u))`` (SPEC §3). Starting values:

- ``P``'s output factor is zero (``up`` for ``low_rank`` and ``dense_low_rank``, ``scale`` for ``full_rank``, the
  weight for ``scalar``), so ``P(u) = 0`` and the convolution (learned or the fixed difference) sees zeros, while the
  other factor is random: the first gradient step moves it (two zero factors would be a saddle point that gradient
  descent never leaves);
- the gate's last linear map is zero with zero bias, so ``sigmoid(G(u)) = 1/2`` for every input, with gradients;
- RoPE sources: ``b = 0`` without a gate, ``b = ln 2`` with one (``exp(ln 2) = 2`` exactly in float32), so
  ``c = 1`` per token: the phase counts tokens and ``τ`` holds the source's inverse frequencies — exactly RoPE.
  NoPE sources: no bias, ``c = 0``: no rotation;
- a FoX forget gate added to a Llama-family source: zero weight, bias ``forget_gate_bias`` (16 gives
  ``log f ≈ -1e-7`` per token: "no forgetting" within the probe's tolerance, yet not frozen: Adam normalises the
  small gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..configuration.position_embedding import (
    PHASE_CONV_TYPES,
    PHASE_GATE_TYPES,
    PHASE_PROJECTIONS,
    _one_of,
    _require,
)
from ..modeling.rotary import PhaseConvolution, SelectiveRotaryEmbedding

# float32(ln 2), whose float32 exp is exactly 2.0 (checked in the tests), so 2 · sigmoid(0) = 1 exactly.
LN2 = math.log(2.0)


@dataclass
class RetrofitOptions:
    """Which Selective RoPE parts a converted model switches on, and how the new parameters start.

    Args:
        selective: switch on Selective RoPE; ``False`` keeps the source's position embedding (a plain port).
        phase_gate, phase_gate_type, phase_gate_rank, phase_proj, phase_proj_rank, phase_conv_type,
            phase_conv_size: the config fields of the same names (SPEC §2). ``phase_bias`` is not a choice: a RoPE
            source needs it (it is RoPE's +1 per token), a NoPE source cannot have it (``exp(b) > 0``).
        forget_gate: give a Llama-family source the FoX forget gate (starting at "no forgetting").
        forget_gate_bias: its starting bias.
        seed: seed of the random starting factors.
    """

    selective: bool = True
    phase_gate: bool = True
    phase_gate_type: str = "head"
    phase_gate_rank: int = 16
    phase_proj: str = "low_rank"
    phase_proj_rank: int = 32
    phase_conv_type: str = "learned"
    phase_conv_size: int = 4
    forget_gate: bool = True
    forget_gate_bias: float = 16.0
    seed: int = 0

    def __post_init__(self):  # the same checks and messages as the config fields they become
        _one_of("phase_gate_type", self.phase_gate_type, PHASE_GATE_TYPES)
        _one_of("phase_proj", self.phase_proj, PHASE_PROJECTIONS)
        _one_of("phase_conv_type", self.phase_conv_type, PHASE_CONV_TYPES)
        _require(math.isfinite(self.forget_gate_bias), "forget_gate_bias", self.forget_gate_bias, "must be finite")

    def config_overrides(self, source_rotates: bool) -> dict:
        """Config fields for a source that rotates (RoPE) or not (NoPE)."""
        if not self.selective:
            return {"position_embedding": "rope" if source_rotates else "nope"}
        return dict(position_embedding="selective_rope", phase_bias=source_rotates, phase_gate=self.phase_gate,
                    phase_gate_type=self.phase_gate_type, phase_gate_rank=self.phase_gate_rank,
                    phase_proj=self.phase_proj, phase_proj_rank=self.phase_proj_rank,
                    phase_conv_type=self.phase_conv_type, phase_conv_size=self.phase_conv_size)


@torch.no_grad()
def starting_parameters(model: nn.Module, options: RetrofitOptions,
                        temperature: torch.Tensor | dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Identity-preserving values of every Selective RoPE parameter and FoX forget gate of ``model``.

    ``model`` may live on the meta device; only these small modules are materialised (on the CPU). ``temperature``
    (e.g. a source's inverse frequencies) replaces the configured schedule: of every rotary module, or of those a
    dict names (rotary module name -> temperature). The caller uses these values for the
    parameters its source does not provide.
    """
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(options.seed)
    try:
        values = {}
        for name, module in model.named_modules():
            if isinstance(module, SelectiveRotaryEmbedding) and module.position_embedding != "nope":
                module.to_empty(device="cpu")
                _start_rotary(module, temperature.get(name) if isinstance(temperature, dict) else temperature)
                values.update(_detached(module, name))
            elif name.endswith(".f_proj") and isinstance(module, nn.Linear):
                module.to_empty(device="cpu")
                nn.init.zeros_(module.weight)
                nn.init.constant_(module.bias, options.forget_gate_bias)
                values.update(_detached(module, name))
        return values
    finally:
        torch.random.set_rng_state(generator_state)


def _detached(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict(prefix=prefix + ".").items()}


def _start_rotary(rotary: SelectiveRotaryEmbedding, temperature: torch.Tensor | None) -> None:
    start = rotary.initial_temperature() if temperature is None else temperature.float()
    if start.shape != rotary.temperature.shape:
        raise ValueError(f"the source has {start.numel()} RoPE frequencies but the model rotates "
                         f"{rotary.temperature.numel()} pairs per head")
    rotary.temperature.copy_(start)
    if rotary.position_embedding == "rope":
        return
    projection = rotary.phase_proj
    projection.init_custom_parameters()
    if projection.kind in ("low_rank", "dense_low_rank"):
        projection.up.zero_()
    elif projection.kind == "full_rank":
        projection.scale.zero_()
    else:
        projection.weight.zero_()
    if isinstance(rotary.phase_conv, PhaseConvolution):  # the fixed difference has nothing to start
        rotary.phase_conv.init_custom_parameters()
    gate = rotary.phase_gate_proj
    if gate is not None:
        layers = list(gate) if isinstance(gate, nn.Sequential) else [gate]
        for layer in layers:
            layer.reset_parameters()
        layers[-1].weight.zero_()
        layers[-1].bias.zero_()
    if rotary.phase_bias is not None:
        rotary.phase_bias.fill_(LN2 if gate is not None else 0.0)
