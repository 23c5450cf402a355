"""The position-embedding options shared by every selective-rope family (SPEC §2), and how configs are validated.

Validation uses transformers' own mechanism, huggingface_hub's strict dataclasses (as ``LlamaConfig`` and
``Qwen3Config`` do), applied to each family config by :func:`strict_config`:

- a field's annotation is its type, checked on every assignment: ``"false"`` in a ``bool`` field is refused (never
  read as truthy), ``True`` in an ``int`` field too; number fields are ``int | float`` so that ``10000`` is a valid
  ``temperature_theta``;
- a field's range is a validator attached to it (``validated_field(at_least(1), default=...)``), also checked on
  every assignment;
- rules between fields are methods named ``validate_*`` (strict's class validators, taking only ``self``), run after
  construction and again by ``save_pretrained``.

Every error is an :class:`InvalidConfigError`, a ``ValueError`` (SPEC §2) naming the field, the value and what is
allowed. To add an option: one annotated field here (with a validator if its type does not say everything), and a line
in ``validate_position_embedding`` if it constrains other fields.

No ``from __future__ import annotations`` in this package's config modules: strict skips fields whose annotation is a
string, so postponed annotations would switch the type checks off.
"""

import math
import types
from typing import Literal, Union, get_args, get_origin

from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import (
    StrictDataclassClassValidationError,
    StrictDataclassError,
    StrictDataclassFieldValidationError,
)
from transformers import PreTrainedConfig

from ..kernels.backends import BACKENDS

Number = int | float

PositionEmbedding = Literal["selective_rope", "rope", "nope"]
PhaseGateType = Literal["head", "low_rank", "channel"]
PhaseProjection = Literal["low_rank", "full_rank", "scalar", "dense_low_rank"]
PhaseConvolutionType = Literal["learned", "difference"]
TemperatureType = Literal["rope", "rfa", "gaussian", "laplace", "uniform"]
Backend = Literal[BACKENDS]  # the same as Literal["auto", "torch", "triton"]

# Named sets of position-embedding fields, for :meth:`SelectiveRopeConfigBase.from_preset`.
PRESETS = {
    # The Selective RoPE of the paper's state-tracking runs (the official repository's configs/state_tracking): every
    # frequency's temperature is 1 (RoPE schedule with base 1), no phase gate, the phase bias, the phase convolution.
    # With it a 1-layer GLA extrapolates running parity (docs/synthetic.md, "The paper's setup").
    "state_tracking": dict(position_embedding="selective_rope", temperature_type="rope", temperature_theta=1.0,
                           phase_gate=False, phase_bias=True, phase_conv_size=4),
}

PHASE_GATE_TYPES = get_args(PhaseGateType)  # the converter's command-line choices
PHASE_PROJECTIONS = get_args(PhaseProjection)
PHASE_CONV_TYPES = get_args(PhaseConvolutionType)


class InvalidConfigError(StrictDataclassError, ValueError):
    """An invalid config value. A ``ValueError`` (SPEC §2), and the strict-dataclass error transformers' own configs
    raise, so code catching either catches it."""


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise InvalidConfigError(f"`{field}`={value!r} is invalid: {allowed}.")


def _one_of(field: str, value, choices: tuple) -> None:
    _require(value in choices, field, value, f"expected one of {list(choices)}")


# -- field validators: called with the value only, after its type was checked; ``None`` passes (optional fields) --
def interval(low: Number | None = None, high: Number | None = None, *, low_open: bool = False,
             high_open: bool = False):
    """A validator: the value is a finite number in the interval, e.g. ``interval(0, 1, low_open=True)``: (0, 1]."""
    if low is not None and high is not None:
        allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        allowed = f"{'>' if low_open else '>='} {low}"
    elif high is not None:
        allowed = f"{'<' if high_open else '<='} {high}"
    else:
        allowed = "(not inf or nan)"

    def check(value) -> None:
        if value is None:
            return
        ok = math.isfinite(value)
        if low is not None:
            ok = ok and (value > low if low_open else value >= low)
        if high is not None:
            ok = ok and (value < high if high_open else value <= high)
        if not ok:
            raise ValueError(f"must be a finite number {allowed}")

    return check


# Upper bounds on sizes. Past them a value is a typo, not a model: 10**12 layers hang the build, 10**12 wide layers
# fail deep in the allocator, 2**64 overflows torch's sizes. Each is orders of magnitude past any model trained so far.
MAX_SIZE = 2**31 - 1  # any one width, count of heads, rank or vocabulary (the int32 range)
MAX_LAYERS = 2**16  # decoder blocks (Python builds each: ~10**5 take minutes; deep models have a few hundred)
MAX_PARAMETERS = 2**42  # the model's parameters, estimated from the config before anything is allocated (~4.4e12)


def at_least(low: int, high: int = MAX_SIZE):
    """A validator for integer size fields: ``low <= value <= high`` (by default ``MAX_SIZE``)."""
    def check(value) -> None:
        if value is not None and not low <= value <= high:
            raise ValueError(f"must be an integer in [{low}, {high}]")

    return check


positive = interval(0, low_open=True)
expansion = interval(0, MAX_SIZE, low_open=True)  # a width factor (expand_k, expand_v)
layer_count = at_least(1, MAX_LAYERS)
# The std of the initial weights: above 1 the activations grow with every layer (non-finite logits at 1e12); models
# use ~0.02.
weight_std = interval(0, 1)


def token_ids_in_vocabulary(ids: dict, vocab_size: int) -> dict:
    """A source checkpoint's ``*_token_id`` fields with every id that names no row of its ``vocab_size`` vocabulary
    replaced by None: checkpoints store -1 for "no such token" (transformers only warns), which our configs refuse
    (``validate_token_ids``). A list keeps its ids that are rows (None if none is left)."""
    def kept(token):
        return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size

    result = {}
    for name, value in ids.items():
        if isinstance(value, list):
            value = [token for token in value if kept(token)] or None
        result[name] = value if value is None or isinstance(value, list) or kept(value) else None
    return result


def generator_seed(value) -> None:
    """A validator: a seed ``torch.Generator.manual_seed`` takes."""
    if value is not None and not -(2**63) <= value < 2**64:
        raise ValueError("must be an integer in [-2**63, 2**64) (the range torch.Generator.manual_seed takes)")


def fla_mlp_width(hidden_size: int, hidden_ratio: int | None, intermediate_size: int | None) -> int:
    """flash-linear-attention's MLP width: ``intermediate_size`` if given, else 2/3 · ratio · hidden rounded up to a
    multiple of 256 (GLA and Gated DeltaNet; the converters size fla checkpoints with it too)."""
    if intermediate_size is not None:
        return intermediate_size
    width = int(hidden_size * (hidden_ratio or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


def _describe(annotation) -> str:
    """``bool``, ``int or float``, ``one of 'a', 'b'``, ... for an error message."""
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(part) for part in get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def strict_config(cls: type[PreTrainedConfig]) -> type[PreTrainedConfig]:
    """Apply huggingface_hub's ``strict`` (type and range checks on every assignment, class validators after
    construction) and raise its errors as one-line :class:`InvalidConfigError` messages naming the field and value."""
    cls = strict(cls)
    strict_setattr, strict_validate = cls.__setattr__, cls.validate

    def __setattr__(self, name, value):
        # An alias (``attribute_map``, e.g. FoX's ``norm_eps``) is checked as the field it names: strict only knows
        # the field, and transformers would map the alias after strict's checks, so its value would go unchecked.
        field = self.attribute_map.get(name, name)
        try:
            strict_setattr(self, field, value)
        except StrictDataclassFieldValidationError as error:
            cause = error.__cause__
            if isinstance(cause, TypeError) and field in cls.__dataclass_fields__:
                allowed = f"expected {_describe(cls.__dataclass_fields__[field].type)}"
            else:
                allowed = str(cause)
            label = f"`{name}`" if field == name else f"`{name}` (`{field}`)"
            raise InvalidConfigError(f"{label}={value!r} is invalid: {allowed}.") from cause

    def validate(self) -> None:
        try:
            strict_validate(self)
        except StrictDataclassClassValidationError as error:
            raise InvalidConfigError(str(error.__cause__)) from error.__cause__

    validate.__is_defined_by_strict_decorator__ = True  # lets a subclass apply `strict` again
    cls.__setattr__, cls.validate = __setattr__, validate
    return cls


class SelectiveRopeConfigBase(PreTrainedConfig):
    """Base config holding the Selective RoPE fields; the family configs inherit from it.

    Args:
        position_embedding: ``"selective_rope"`` (input-dependent rotation), ``"rope"`` (fixed RoPE with
            inverse frequencies ``temperature``) or ``"nope"`` (no rotation).
        phase_gate: multiply the phase increment by a sigmoid gate computed from the input.
        phase_gate_type: ``"head"`` (one gate per key head), ``"low_rank"`` (rank ``phase_gate_rank``, then one per
            head), ``"channel"`` (rank ``phase_gate_rank``, then one per head and frequency).
        phase_gate_rank: the inner width of the ``"low_rank"`` and ``"channel"`` gates (>= 1; the official code's
            ``gate_low_rank_dim``, named apart from GLA's own ``gate_low_rank_dim``, the forget gate's rank).
        phase_bias: add a learned positive bias ``exp(b)`` (``b`` starts at 0) to the phase increment.
        phase_proj: ``"low_rank"`` (one low-rank map per key head, from its own input chunk), ``"full_rank"``
            (per-head block-diagonal, weight-normalised), ``"scalar"`` (one value per head shared by all
            frequencies) or ``"dense_low_rank"`` (one low-rank map from the whole input, every chunk, to every head's
            increments: the official code's ``phi_parametrization="low-rank"``).
        phase_proj_rank: the rank of the low-rank projections (>= 1): per key head for ``"low_rank"`` (``Hk`` maps of
            that rank), in total for ``"dense_low_rank"`` (one map of that rank shared by all heads; equal to
            ``"low_rank"`` only for one key head). Not read by ``"full_rank"`` and ``"scalar"``.
        phase_conv_type: ``"learned"`` (a causal depthwise convolution with trainable taps, ``phase_conv_size``
            wide) or ``"difference"`` (the fixed first difference ``a_t - a_{t-1}``, no trainable taps, so that
            ``θ_t`` follows ``P(u_t)`` itself rather than its running sum: the official ``skip_conv``;
            ``phase_conv_size`` is not read).
        phase_conv_size: kernel size of the learned convolution on the phase increment; 0 disables it.
        phase_conv_activation: ``None`` or ``"silu"`` (``"swish"`` is accepted as its other name, as in
            flash-linear-attention, and kept as given), applied after either convolution.
        temperature_type: the schedule of the temperature ``τ``, the per-pair rotation frequencies (RoPE's inverse
            frequencies; the name is the paper's, not a sampling temperature): ``"rope"``, ``"rfa"`` (tan schedule),
            or sampled ``"gaussian"``/``"laplace"``/``"uniform"``.
        temperature_theta: ``rope``: base (>= 1); ``rfa``: angle bound in (0, 1); sampled types: scale (> 0).
        temperature_max: a factor multiplying every frequency of the schedule (> 0; named after the official
            code's ``temp_max``, it is a scale, not a bound).
        temperature_trainable: learn the temperature (a parameter; otherwise a buffer, which stays fixed whatever turns
            gradients on: transformers' loading, PEFT's ``modules_to_save``).
        temperature_seed: seed of the sampled temperature types (in [-2**63, 2**64), as ``torch.Generator`` takes).
        partial_rotary_factor: fraction in (0, 1] of each head's q/k dims that rotate (the rotary part must be even).

    Kernels (not a position-embedding option: it selects who runs every op of the model, mixers included):
        backend: ``"auto"`` (Triton kernels and flash-linear-attention on CUDA, PyTorch elsewhere), ``"torch"``
            (PyTorch everywhere) or ``"triton"`` (as auto on CUDA; on CPU our Triton rotary kernels under
            ``TRITON_INTERPRET=1``). The environment variable ``SELECTIVE_ROPE_BACKEND``, when set, overrides it.

    Sizes are bounded (``MAX_SIZE`` per width, count or rank, ``MAX_LAYERS`` layers, and ``MAX_PARAMETERS`` for the
    model estimated from the config: :meth:`estimated_parameters`), ``initializer_range`` is in [0, 1], and every
    ``*_token_id`` is ``None`` or in ``[0, vocab_size)``: each refused at construction, before anything is allocated.

    Rules that only matter when rotating (the rotary part of a head, the input split per key head, the range of
    ``temperature_theta`` per type) are checked for ``"rope"`` and ``"selective_rope"`` only; a ``"nope"`` config only
    needs valid values.
    """

    # Output fields Trainer's evaluation leaves out: the cache, by its name from transformers 5.24 on and before.
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    position_embedding: PositionEmbedding = "selective_rope"
    phase_gate: bool = True
    phase_gate_type: PhaseGateType = "head"
    phase_gate_rank: int = validated_field(at_least(1), default=16)
    phase_bias: bool = False
    phase_proj: PhaseProjection = "low_rank"
    phase_proj_rank: int = validated_field(at_least(1), default=32)
    phase_conv_type: PhaseConvolutionType = "learned"
    phase_conv_size: int = validated_field(at_least(0), default=4)
    phase_conv_activation: Literal["silu", "swish"] | None = None
    temperature_type: TemperatureType = "rope"
    temperature_theta: Number = validated_field(interval(), default=500000.0)  # range per type: see below
    temperature_max: Number = validated_field(positive, default=1.0)
    temperature_trainable: bool = False
    temperature_seed: int = validated_field(generator_seed, default=0)
    partial_rotary_factor: Number = validated_field(interval(0, 1, low_open=True), default=1.0)

    # Kernels: who runs every op of the model (kernels/dispatch.py), not only the rotation.
    backend: Backend = "auto"

    @classmethod
    def from_preset(cls, preset: str, **kwargs):
        """A config with the position-embedding fields of a named preset (``PRESETS``), e.g.
        ``SelectiveRopeGLAConfig.from_preset("state_tracking", hidden_size=384, num_heads=12)``. ``kwargs`` are the
        other fields and win over the preset's; the config is built and validated as any other."""
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[preset], **kwargs})

    # -- what the shared model reads (each family defines them from its own fields) --------------------------------
    @property
    def rotary_head_dim(self) -> int:
        """The size of the q/k heads the rotation applies to (set by each family)."""
        raise NotImplementedError

    @property
    def mlp_width(self) -> int:
        """The inner width of the decoder block's SwiGLU MLP (set by each family)."""
        raise NotImplementedError

    @property
    def mlp_has_bias(self) -> bool:
        """Whether the MLP's projections have biases (only FoX's ``mlp_bias`` can say so)."""
        return False

    @property
    def num_phase_heads(self) -> int:
        """The number of key heads, each with its own phase (set by each family)."""
        raise NotImplementedError

    @property
    def tensor_parallel_heads(self) -> dict[str, int]:
        """The head counts tensor parallelism splits, by field name (set by each family with its
        ``base_model_tp_plan``: ``configuration/tensor_parallel.py``)."""
        raise NotImplementedError

    def mixer_width(self) -> int:
        """The widths of the mixer's query, key and value projections together (set by each family; read by the size
        estimate)."""
        raise NotImplementedError

    def estimated_parameters(self) -> int:
        """A lower bound on the model's parameter count, from the config alone: the embeddings (and an untied head),
        and per layer the mixer's q/k/v and the MLP's three projections. Exact Python integers: no overflow."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * self.hidden_size * (self.mixer_width + 3 * self.mlp_width)

    def validate_size(self) -> None:
        """The model's size, estimated before anything is allocated (strict runs it after the family's checks)."""
        estimate = self.estimated_parameters()
        _require(estimate <= MAX_PARAMETERS, "hidden_size", self.hidden_size,
                 f"with vocab_size={self.vocab_size}, num_hidden_layers={self.num_hidden_layers}, a mixer width of "
                 f"{self.mixer_width} and an MLP width of {self.mlp_width} the model would have at least "
                 f"{estimate:.3g} parameters; at most {MAX_PARAMETERS:.3g} (2**42) are allowed")

    def validate_token_ids(self) -> None:
        """Every ``*_token_id`` is ``None`` or a row of the embedding: ``pad_token_id=-1`` would silently make the
        last row the padding row (never trained), and an id >= vocab_size fails only when the model is built.
        (transformers' own check, of the same name, only warns, for checkpoints on the Hub that store -1.)"""
        for name, value in vars(self).items():
            if not name.endswith("_token_id") or value is None:
                continue
            for token in value if isinstance(value, list) else [value]:
                _require(isinstance(token, int) and not isinstance(token, bool) and 0 <= token < self.vocab_size,
                         name, value, f"must be None or a token id in [0, {self.vocab_size}) (vocab_size)")

    def validate_position_embedding(self) -> None:
        """The rules between fields that matter when rotating (strict runs it after the family's ``validate_*``
        checks, in name order, so the head sizes it reads are valid)."""
        if self.position_embedding == "nope":
            return
        theta, kind = self.temperature_theta, self.temperature_type
        if kind == "rope":
            _require(theta >= 1, "temperature_theta", theta, "the RoPE base must be >= 1 for temperature_type='rope'")
        elif kind == "rfa":
            _require(0 < theta < 1, "temperature_theta", theta,
                     "the angle bound must be in (0, 1) for temperature_type='rfa' (e.g. 0.999)")
        else:
            _require(theta > 0, "temperature_theta", theta, f"the frequency scale must be > 0 for "
                     f"temperature_type={kind!r}")

        head_dim, factor = self.rotary_head_dim, self.partial_rotary_factor
        rotary_dim = head_dim * factor
        _require(rotary_dim == int(rotary_dim) and int(rotary_dim) % 2 == 0 and rotary_dim >= 2,
                 "partial_rotary_factor", factor,
                 f"head_dim * partial_rotary_factor = {rotary_dim} must be an even integer >= 2 (head_dim={head_dim}; "
                 "position_embedding='nope' does not rotate and has no such rule)")
        if self.position_embedding == "selective_rope":
            _require(self.hidden_size % self.num_phase_heads == 0, "hidden_size", self.hidden_size,
                     f"must be divisible by the number of key heads ({self.num_phase_heads}): Selective RoPE splits "
                     "the input into one chunk per key head")
