"""The position-embedding options shared by every selective-rope family (SPEC §2).

One definition, inherited by the GLA, Gated DeltaNet and FoX configs. Values are checked when the config is
constructed; an invalid value raises a ``ValueError`` that names the field, the value and what is allowed.
"""

from __future__ import annotations

import math

from transformers import PreTrainedConfig

POSITION_EMBEDDINGS = ("selective_rope", "rope", "nope")
PHASE_GATE_TYPES = ("head", "low_rank", "channel")
PHASE_PROJECTIONS = ("low_rank", "full_rank", "scalar")
PHASE_CONV_ACTIVATIONS = (None, "silu")
TEMPERATURE_TYPES = ("rope", "rfa", "gaussian", "laplace", "uniform")
SAMPLED_TEMPERATURE_TYPES = ("gaussian", "laplace", "uniform")
BACKENDS = ("auto", "torch", "triton")


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"`{field}`={value!r} is invalid: {allowed}.")


def _one_of(field: str, value, choices: tuple) -> None:
    _require(value in choices, field, value, f"expected one of {list(choices)}")


class SelectiveRopeConfigBase(PreTrainedConfig):
    """Base config holding the Selective RoPE fields; the family configs inherit from it.

    Args:
        position_embedding: ``"selective_rope"`` (input-dependent rotation), ``"rope"`` (fixed RoPE with
            inverse frequencies ``temperature``) or ``"nope"`` (no rotation).
        phase_gate: multiply the phase increment by a sigmoid gate computed from the input.
        phase_gate_type: ``"head"`` (one gate per key head), ``"low_rank"`` (rank-16, then one per head),
            ``"channel"`` (rank-16, then one per head and frequency).
        phase_bias: add a learned positive bias ``exp(b)`` (``b`` starts at 0) to the phase increment.
        phase_proj: ``"low_rank"``, ``"full_rank"`` (per-head block-diagonal, weight-normalised) or
            ``"scalar"`` (one value per head shared by all frequencies).
        phase_proj_rank: rank of the ``"low_rank"`` projection.
        phase_conv_size: kernel size of the causal depthwise convolution on the phase increment; 0 disables it.
        phase_conv_activation: ``None`` or ``"silu"``.
        temperature_type: ``"rope"``, ``"rfa"`` (tan schedule), or sampled ``"gaussian"``/``"laplace"``/``"uniform"``.
        temperature_theta: ``rope``: base (>= 1); ``rfa``: angle bound in (0, 1); sampled types: scale (> 0).
        temperature_max: overall scale of the temperature schedule.
        temperature_trainable: learn the temperature.
        temperature_seed: seed of the sampled temperature types.
        partial_rotary_factor: fraction of each head's q/k dims that rotate (the rotary part must be even).
        backend: ``"auto"`` (Triton kernels and flash-linear-attention on CUDA, PyTorch elsewhere), ``"torch"``
            (PyTorch everywhere) or ``"triton"`` (as auto on CUDA; on CPU our Triton rotary kernels under
            ``TRITON_INTERPRET=1``). The environment variable ``SELECTIVE_ROPE_BACKEND``, when set, overrides it.
    """

    position_embedding: str = "selective_rope"
    phase_gate: bool = True
    phase_gate_type: str = "head"
    phase_bias: bool = False
    phase_proj: str = "low_rank"
    phase_proj_rank: int = 32
    phase_conv_size: int = 4
    phase_conv_activation: str | None = None
    temperature_type: str = "rope"
    temperature_theta: float = 500000.0
    temperature_max: float = 1.0
    temperature_trainable: bool = False
    temperature_seed: int = 0
    partial_rotary_factor: float = 1.0
    backend: str = "auto"

    def validate_position_embedding(self, head_dim: int, num_key_heads: int) -> None:
        """Check every Selective RoPE field; ``head_dim`` and ``num_key_heads`` come from the family config."""
        _one_of("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        _one_of("phase_gate_type", self.phase_gate_type, PHASE_GATE_TYPES)
        _one_of("phase_proj", self.phase_proj, PHASE_PROJECTIONS)
        _one_of("phase_conv_activation", self.phase_conv_activation, PHASE_CONV_ACTIVATIONS)
        _one_of("temperature_type", self.temperature_type, TEMPERATURE_TYPES)
        _one_of("backend", self.backend, BACKENDS)
        _require(isinstance(self.phase_proj_rank, int) and self.phase_proj_rank >= 1,
                 "phase_proj_rank", self.phase_proj_rank, "must be an integer >= 1")
        _require(isinstance(self.phase_conv_size, int) and self.phase_conv_size >= 0,
                 "phase_conv_size", self.phase_conv_size, "must be an integer >= 0 (0 disables the convolution)")
        _require(isinstance(self.temperature_seed, int), "temperature_seed", self.temperature_seed,
                 "must be an integer")
        _require(math.isfinite(self.temperature_max) and self.temperature_max > 0,
                 "temperature_max", self.temperature_max, "must be a finite number > 0")

        theta, kind = self.temperature_theta, self.temperature_type
        if kind == "rope":
            _require(theta >= 1, "temperature_theta", theta, "the RoPE base must be >= 1 for temperature_type='rope'")
        elif kind == "rfa":
            _require(0 < theta < 1, "temperature_theta", theta,
                     "the angle bound must be in (0, 1) for temperature_type='rfa' (e.g. 0.999)")
        else:
            _require(math.isfinite(theta) and theta > 0, "temperature_theta", theta,
                     f"the frequency scale must be > 0 for temperature_type={kind!r}")

        factor = self.partial_rotary_factor
        _require(0 < factor <= 1, "partial_rotary_factor", factor, "must be in (0, 1]")
        rotary_dim = head_dim * factor
        _require(rotary_dim == int(rotary_dim) and int(rotary_dim) % 2 == 0 and rotary_dim >= 2,
                 "partial_rotary_factor", factor,
                 f"head_dim * partial_rotary_factor = {rotary_dim} must be an even integer >= 2 (head_dim={head_dim})")
        _require(self.hidden_size % num_key_heads == 0, "hidden_size", self.hidden_size,
                 f"must be divisible by the number of key heads ({num_key_heads}): Selective RoPE splits the "
                 "input into one chunk per key head")
