"""Checkpoints of the paper's own code (github.com/timurcarstensen/selective-rope) as our families.

Its models are flash-linear-attention's, with fla's model types and parameter names, plus a ``position_embedding``
dict in ``config.json`` (``{"type": "selective_rope" | "rope" | "nope", ...}``) and, for Selective RoPE, a ``rotary``
module in every layer. That dict is how its checkpoints are told from fla's (which have none), since the model types
collide: ``gla`` -> SelectiveRopeGLA, ``gated_deltanet`` -> SelectiveRopeGatedDeltaNet, ``transformer`` (plain
softmax attention) -> SelectiveRopeFoX without forget gate (``use_forget_gate=False``: the official attention has
none, so it is carried over as it is, not given one).

A Selective RoPE source is ported, option for option and tensor for tensor (nothing to retrofit); a RoPE or NoPE
source is retrofitted like any other (:mod:`.retrofit`). The options (keys of ``position_embedding``):

    temp_type, temp_theta, temp_max, temp_grad   temperature_type ("rope"/"rfa"), _theta, _max, _trainable; the
                                                 temperature tensor itself is carried over
    phi_parametrization="low-rank"               phase_proj="dense_low_rank"; phi_proj_rank -> phase_proj_rank (a
                                                 total rank across heads)
    phi_parametrization="full-rank"              phase_proj="full_rank" (its per-head scale repeated per frequency)
    skip_conv=true                               phase_conv_type="difference" (d_conv and conv_act are not read)
    d_conv, conv_act (None, "silu", "swish")     phase_conv_size, phase_conv_activation
    use_bias                                     phase_bias
    use_gate, gate_parametrization               phase_gate, phase_gate_type: "standard" -> "head",
                                                 "low-rank" -> "low_rank", "gla" -> "channel"
    gate_low_rank_dim                            phase_gate_rank
    use_triton, fuse_gate                        how it ran, not what it computes: not read (see below)

and the tensors of each layer's ``attn.rotary`` (``H`` heads, ``R`` frequency pairs, ``r`` the projection's rank):

    phi_proj.0.weight (r, D), phi_proj.1.weight (H·R, r)   phase_proj.down, phase_proj.up
    phi_proj.weight (H, D/H, R), phi_proj.scalar (H,)      phase_proj.weight (H, R, D/H), phase_proj.scale (H, R)
    phi_conv1d.weight (H·R, 1, K)                          phase_conv.weight
    phi_bias (1, 1, H, R), temperature (1, 1, 1, R)        phase_bias (H, R), temperature (R,)
    phase_gate_proj.*                                      phase_gate_proj.* (same names and shapes)

Where the official code departs from its own math, the converted model computes the intended math (the card says
so): (1) a batch given an attention mask is unpadded into one packed row whose phase runs on from one sequence into
the next (GLA, Gated DeltaNet), and padding tokens advance the phase (softmax attention); here each row has its own
phase and padding adds nothing; packed sequences (``cu_seqlens``) likewise restart here; (2) in cached decoding the
``skip_conv`` difference restarts at every call, and the Triton decode step (``use_triton``) applies the phase gate
before the convolution where training applies it after; here decoding continues exactly what a full forward computes,
in training's order; (3) the phase accumulates in the model's dtype there (bf16 for bf16 models), in float64 here.
The official code normalises each input chunk as ``x / sqrt(|x|² + 1e-6)``, ours as ``x / |x|``: a relative
difference of ``5e-7 / |x|²``, far below the probe's tolerance for the RMS-normalised inputs both see.

Options the official layers cannot run (Selective RoPE with grouped key heads, whose phases it would not match to
the heads) or that have no counterpart here are refused by name, before anything is written. So are RoPE GLA sources:
with a decay per key channel, GLA's output depends on absolute rotations, and the official RoPE rotates token ``t``
by ``t·τ`` where every phase here counts from 1 (``θ_t = t + 1``, SPEC §3); for Gated DeltaNet and softmax attention
only differences of rotations matter, and their RoPE sources convert exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selective_rope.families import FAMILIES

from ..configuration.fox import SelectiveRopeFoXConfig
from ..configuration.position_embedding import fla_mlp_width
from .fla import _check_source, _copy, fla_config, fla_key

# gla, gated_deltanet, transformer
OFFICIAL_MODEL_TYPES = tuple(family.official_model_type for family in FAMILIES.values() if family.official_model_type)
_TOKENS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "initializer_range")
# Every argument of the official SelectiveRoPE a config can set (the layer sets the head sizes itself).
_SELECTIVE_KEYS = {"type", "skip_conv", "dtype", "d_conv", "temp_type", "temp_theta", "temp_max", "temp_grad",
                   "phi_proj_rank", "phi_parametrization", "conv_act", "use_gate", "gate_parametrization",
                   "gate_low_rank_dim", "use_bias", "use_triton", "fuse_gate"}
_GATE_TYPES = {"standard": "head", "low-rank": "low_rank", "gla": "channel"}
_PROJECTIONS = {"low-rank": "dense_low_rank", "full-rank": "full_rank"}
L2_EPS = 1e-6  # fla's l2_norm, which the official module applies to each input chunk
QK_NORM_EPS = 1e-5  # fla's RMSNorm default, the official attention's q/k norms


def is_official(raw: dict) -> bool:
    """Whether a ``config.json`` dict comes from the paper's code (its ``position_embedding`` is a dict)."""
    return raw.get("model_type") in OFFICIAL_MODEL_TYPES and isinstance(raw.get("position_embedding"), dict)


def position_type(raw: dict) -> str:
    """``"selective_rope"``, ``"rope"`` or ``"nope"``; ``ValueError`` for anything else."""
    kind = raw["position_embedding"].get("type") or "nope"
    if kind not in ("selective_rope", "rope", "nope"):
        raise ValueError(f"unsupported official {raw['model_type']} source: position_embedding.type={kind!r} "
                         "(expected 'selective_rope', 'rope' or 'nope')")
    return kind


def _refuse(model_type: str, key: str, value, allowed: str) -> None:
    raise ValueError(f"unsupported official {model_type} source: position_embedding.{key}={value!r} ({allowed})")


def selective_fields(model_type: str, options: dict) -> dict:
    """Our Selective RoPE config fields for the official ``position_embedding`` dict of a Selective RoPE source."""
    unknown = sorted(set(options) - _SELECTIVE_KEYS)
    if unknown:
        _refuse(model_type, unknown[0], options[unknown[0]], "the official SelectiveRoPE takes no such argument")
    get = options.get
    if get("dtype") is not None:
        _refuse(model_type, "dtype", get("dtype"), "only the model's own dtype is supported")
    temp_type = get("temp_type", "rope")
    if temp_type not in ("rope", "rfa"):
        _refuse(model_type, "temp_type", temp_type, "expected 'rope' or 'rfa'")
    projection = get("phi_parametrization", "low-rank")
    if projection not in _PROJECTIONS:
        _refuse(model_type, "phi_parametrization", projection, "expected 'low-rank' or 'full-rank'")
    gate_type = get("gate_parametrization", "standard")
    if gate_type not in _GATE_TYPES:
        _refuse(model_type, "gate_parametrization", gate_type, f"expected one of {list(_GATE_TYPES)}")
    activation = get("conv_act")
    if activation not in (None, "silu", "swish"):
        _refuse(model_type, "conv_act", activation, "expected None, 'silu' or 'swish'")
    skip_conv = bool(get("skip_conv", False))
    return dict(
        position_embedding="selective_rope",
        temperature_type=temp_type,
        temperature_theta=get("temp_theta", 500000),
        temperature_max=get("temp_max", 1.0),
        temperature_trainable=bool(get("temp_grad", False)),
        phase_proj=_PROJECTIONS[projection],
        phase_proj_rank=get("phi_proj_rank", 16),
        phase_conv_type="difference" if skip_conv else "learned",
        phase_conv_size=4 if skip_conv else get("d_conv", 4),
        phase_conv_activation=None if skip_conv else activation,
        phase_bias=bool(get("use_bias", False)),
        phase_gate=bool(get("use_gate", False)),
        phase_gate_type=_GATE_TYPES[gate_type],
        phase_gate_rank=get("gate_low_rank_dim", 16),
        partial_rotary_factor=1.0,
    )


def official_config(raw: dict, **overrides):
    """Our config reproducing the official ``config.json`` dict ``raw`` (its own position embedding unless
    ``overrides`` say otherwise), or a ``ValueError`` naming what has no counterpart."""
    model_type, kind = raw["model_type"], position_type(raw)
    options = raw["position_embedding"]
    heads = raw.get("num_heads")
    if kind == "selective_rope" and (raw.get("num_kv_heads") or heads) != heads:
        raise ValueError(f"unsupported official {model_type} source: num_kv_heads={raw.get('num_kv_heads')!r} with "
                         f"num_heads={heads!r} (the official Selective RoPE has one phase per query head and cannot "
                         "rotate fewer key heads)")
    position = selective_fields(model_type, options) if kind == "selective_rope" else {"position_embedding": kind}
    if kind == "rope":
        position["temperature_theta"] = options.get("theta", 500000)
    fields = {**position, **overrides}
    source = {name: value for name, value in raw.items() if name != "position_embedding"}

    if model_type == "gla":
        if kind == "rope":  # see the module docstring
            raise ValueError("unsupported official gla source: position_embedding.type='rope' (the official RoPE "
                             "starts at position 0, ours at 1, and GLA's per-channel decay makes the output depend on "
                             "that; Selective RoPE and NoPE GLA sources are supported)")
        for name in ("norm_q", "norm_k"):  # an L2 norm of q or k has no counterpart in our GLA
            _check_source(source, name, lambda v: not v, "L2-normalised q/k are not supported")
        # fla's GLA always divides by 16; the official model passes its config's value on
        fields.setdefault("gate_logit_normalizer", source.get("gate_logit_normalizer", 16))
        return fla_config(source, **fields)
    if model_type == "gated_deltanet":
        return fla_config(source, **fields)

    _check_source(source, "window_size", lambda v: v is None, "sliding windows are not supported")
    if source.get("qk_norm"):
        # The official attention normalises q and k before RoPE but after Selective RoPE (where the score then
        # depends on more than the phase difference), with fla's RMSNorm and its default eps.
        _check_source(source, "qk_norm", lambda v: kind != "selective_rope", "the official attention applies its q/k "
                      "RMS norms after Selective RoPE; here the rotation is the last transform of q and k")
        _check_source(source, "norm_eps", lambda v: v == QK_NORM_EPS, f"its q/k norms use eps {QK_NORM_EPS:g} and its "
                      "other norms norm_eps; here all norms share one eps, so norm_eps must equal it")
    hidden, heads = source["hidden_size"], source["num_heads"]
    _check_source(source, "hidden_size", lambda v: v % heads == 0, f"must be a multiple of num_heads ({heads})")
    config = dict(
        _copy(source, _TOKENS), hidden_size=hidden, num_hidden_layers=source["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=source.get("num_kv_heads") or heads, head_dim=hidden // heads,
        intermediate_size=fla_mlp_width(hidden, source.get("hidden_ratio", 4), source.get("intermediate_size")),
        hidden_act=source.get("hidden_act", "swish"), rms_norm_eps=source.get("norm_eps", 1e-6),
        attention_bias=bool(source.get("qkv_bias", False)), attention_output_bias=False,
        qk_norm=bool(source.get("qk_norm", False)), use_forget_gate=False,
    )
    return SelectiveRopeFoXConfig(**{**config, **fields})


def official_key(model_type: str, name: str) -> str:
    """Our parameter name for an official one."""
    if ".rotary." not in name:
        return fla_key(model_type, name)
    prefix, part = name.split(".rotary.", 1)
    renamed = {"phi_proj.0.weight": "phase_proj.down", "phi_proj.1.weight": "phase_proj.up",
               "phi_proj.weight": "phase_proj.weight", "phi_proj.scalar": "phase_proj.scale",
               "phi_conv1d.weight": "phase_conv.weight", "phi_bias": "phase_bias"}.get(part, part)
    return f"{prefix}.rotary.{renamed}"


def official_tensor(name: str, tensor: torch.Tensor, rotary_pairs: int) -> torch.Tensor:
    """A source tensor in our layout, by its name here (:func:`official_key`); ``rotary_pairs``: the model's ``R``.
    A tensor of an unexpected rank is left as it is, for the converter's shape check to name."""
    if name.endswith(".rotary.phase_proj.weight") and tensor.dim() == 3:  # full-rank (H, D/H, R) -> (H, R, D/H)
        return tensor.transpose(1, 2)
    if name.endswith(".rotary.phase_proj.scale") and tensor.dim() == 1:  # one scale per head -> per frequency too
        return tensor[:, None].expand(-1, rotary_pairs)
    if name.endswith(".rotary.phase_bias") and tensor.dim() == 4:  # (1, 1, H, R) -> (H, R)
        return tensor.reshape(tensor.shape[2:])
    if name.endswith(".rotary.temperature") and tensor.dim() == 4:  # (1, 1, 1, R) -> (R,)
        return tensor.reshape(-1)
    return tensor


def notes(raw: dict) -> list[str]:
    """What the model card says about the conversion of this source."""
    kind = position_type(raw)
    options = raw["position_embedding"]
    if kind == "rope" and options.get("partial_rope_ratio", 1.0) != 1.0:
        return [f"Its partial_rope_ratio={options['partial_rope_ratio']!r} is not read by the official code, which "
                "rotates whole heads; neither is it here."]
    if kind != "selective_rope":
        return []
    padding = ("attention lets padding tokens advance the phase" if raw["model_type"] == "transformer" else
               "layer unpads a masked batch into one row whose phase runs on from one sequence into the next")
    decoding = []
    if options.get("skip_conv"):
        decoding.append("its skip_conv difference restarts at every call")
    elif options.get("use_gate") and not options.get("use_bias"):
        decoding.append("its Triton decode step (use_triton without fuse_gate) gates the projection before the "
                        "convolution, where training gates after it")
    return [
        "Where the official code departs from its own math, the converted model computes the intended math: each "
        f"row of a padded batch has its own phase and padding adds nothing to it (the official {padding}); packed "
        "sequences restart the phase; cached decoding continues exactly what a full forward computes"
        + (f" (officially {decoding[0]})" if decoding else "")
        + "; the phase is summed in float64 (officially in the model's dtype)."
        + (" Its use_triton and fuse_gate settings choose kernels, not math, and are not read."
           if "use_triton" in options or "fuse_gate" in options else "")
    ]


def rope_frequencies(theta: float, rotary_dim: int) -> torch.Tensor:
    """flash-linear-attention's RoPE inverse frequencies (float32, as it computes them), the official RoPE's."""
    return 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


class OfficialSelectiveRoPE(nn.Module):
    """The official SelectiveRoPE's computation, written from its formulas on its own tensors (official names and
    shapes): the converter's probe reference, in place of our rotary module in a twin of the converted model.

    Whole unpadded sequences without cache only (what the probe runs), in float64: the official math as intended.
    """

    position_embedding = "selective_rope"  # what the mixers read of our rotary module

    def __init__(self, options: dict, tensors: dict[str, torch.Tensor], num_heads: int):
        super().__init__()
        self.options, self.num_heads = options, num_heads
        self.tensors = {name: tensor.double() for name, tensor in tensors.items()}

    def forward(self, x, q, k, state=None, lengths=None, cu_seqlens=None, backend=None, overwrite_state=False,
                in_place=False):
        """Our rotary module's signature; ``backend`` is not read (this is float64 PyTorch whatever the backend), nor
        ``overwrite_state`` and ``in_place`` (there is no state)."""
        if state or lengths is not None or cu_seqlens is not None:
            raise ValueError("the official reference runs whole unpadded sequences without cache")
        get, weights = self.options.get, self.tensors
        batch, seq_len, hidden = x.shape
        heads = self.num_heads
        temperature = weights["temperature"].reshape(-1)  # (R,)
        rotary_pairs = temperature.shape[0]
        chunks = x.double().view(batch, seq_len, heads, hidden // heads)
        u = chunks * torch.rsqrt(chunks.pow(2).sum(-1, keepdim=True) + L2_EPS)  # (B, T, H, D/H)
        flat = u.flatten(2)
        if get("phi_parametrization", "low-rank") == "low-rank":
            phi = F.linear(F.linear(flat, weights["phi_proj.0.weight"]), weights["phi_proj.1.weight"])
            phi = phi.view(batch, seq_len, heads, rotary_pairs)
        else:  # one weight-normalised (over its inputs) block per head, one scale per head
            block = weights["phi_proj.scalar"][:, None, None] * F.normalize(weights["phi_proj.weight"], dim=-2)
            phi = torch.einsum("bthi,hio->btho", u, block)
        if get("skip_conv", False):
            phi = phi - F.pad(phi, (0, 0, 0, 0, 1, 0))[:, :-1]
        else:
            taps = weights["phi_conv1d.weight"]  # (H·R, 1, K)
            signal = phi.flatten(2).transpose(1, 2)  # (B, H·R, T)
            phi = F.conv1d(F.pad(signal, (taps.shape[-1] - 1, 0)), taps, groups=taps.shape[0])
            phi = phi.transpose(1, 2).view(batch, seq_len, heads, rotary_pairs)
            if get("conv_act") is not None:
                phi = F.silu(phi)
        if get("use_bias", False):
            phi = phi + weights["phi_bias"].exp()
        if get("use_gate", False):
            gate = weights.get("phase_gate_proj.weight")
            if gate is not None:  # standard: one linear map
                logits = F.linear(flat, gate, weights["phase_gate_proj.bias"])
            else:
                low = F.linear(flat, weights["phase_gate_proj.0.weight"])
                logits = F.linear(low, weights["phase_gate_proj.1.weight"], weights["phase_gate_proj.1.bias"])
            phi = phi * torch.sigmoid(logits).view(batch, seq_len, heads, -1)
        angle = temperature * phi.cumsum(1)  # (B, T, H, R)
        return _rotate(q, angle), _rotate(k, angle), {}


def _rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    half = angle.shape[-1]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


def install_official_rotaries(model: nn.Module, options: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Replace every layer's rotary module of ``model`` by :class:`OfficialSelectiveRoPE` on the official tensors
    ``tensors`` (official names, e.g. ``model.layers.0.attn.rotary.phi_proj.0.weight``)."""
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}.attn.rotary."
        own = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        layer.attn.rotary = OfficialSelectiveRoPE(options, own, layer.attn.rotary.num_key_heads)
