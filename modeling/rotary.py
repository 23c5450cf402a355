"""The Selective RoPE module (SPEC §3), shared by every family.

Per token ``t`` and key head ``h`` (frequency pairs ``i < R``; ``R`` is ``rotary_pairs`` in the code, half the
rotary dims):

    u_t   = x_t split into Hk chunks, each L2-normalised
    a_t   = P(u_t)                                  phase projection (low-rank / full-rank / scalar / dense low-rank)
    c_t   = act(conv(a)_t)                          causal depthwise convolution over time (optional), learned or
                                                    the fixed difference a_t - a_{t-1}
    c_t  += exp(b)                                  optional positive bias
    c_t  *= sigmoid(G(u_t))                         optional phase gate
    θ_t   = θ_0 + Σ_{s<=t} c_s                      θ_0 = cached phase
    q_t, k_t rotated by τ_i · θ_t                   GPT-NeoX halves of the rotary part

``position_embedding="rope"`` is the same module with ``c_t ≡ 1`` (standard RoPE with inverse frequencies τ);
``"nope"`` leaves q and k untouched. The rotation must be the last transform applied to q and k.

The module holds the parameters and computes the phase inputs; which implementation runs a call (the compiled CPU
kernel, a decoding step, the Triton kernels, the torch op) is chosen by the one op it calls,
``kernels/rotary.py``'s ``rotary_embedding``.

Precision, whatever the model dtype (SPEC §3 asks for float32 at least; why more: ``kernels/rotary_torch.py``):

- ``c_t`` is computed in float64 (``phase_dtype``) from float32 parameters and rounded once to float32. A decoding
  step computes it for one token, a prefill for thousands at once; in float32 the two differ in the last bits
  (matrix products are blocked by shape, vectorised and scalar ``sigmoid``/``exp`` round differently, TF32 on GPUs),
  and over 32k tokens those bits add up to a visible drift of θ. In float64 both round to the same float32 values.
- θ is summed in float64 and each angle ``τ_i θ_t`` is reduced modulo 2π in float64 before sin/cos in float32.
- The parameters stay float32 when the model is cast to bf16/fp16 (``_apply``); q and k are rotated in float32 and
  returned in their own dtype.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ..configuration.position_embedding import SelectiveRopeConfigBase
from ..kernels.conv_torch import causal_conv1d
from ..kernels.dispatch import resolve_backend
from ..kernels.rotary import rotary_embedding, takes_packed
from ..kernels.rotary_torch import phase_dtype, writable
from .layers import ShortConvolution
from .layout import SequenceLayout, valid_mask


def rotary_temperature(kind: str, theta: float, rotary_dim: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """The per-frequency temperature τ (float32, length ``rotary_dim // 2``) for each ``temperature_type``."""
    rotary_pairs = rotary_dim // 2
    if kind == "rope":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64)[:rotary_pairs] / rotary_dim
        tau = theta ** (-exponent)
    elif kind == "rfa":
        angles = torch.linspace(0.0, theta * math.pi, rotary_pairs, dtype=torch.float64)
        tau = torch.tan(angles / 2) / math.tan(theta * math.pi / 2)
    else:
        generator = torch.Generator().manual_seed(seed)
        if kind == "gaussian":
            omega = torch.randn(rotary_pairs, generator=generator, dtype=torch.float64)
        elif kind == "uniform":
            omega = torch.rand(rotary_pairs, generator=generator, dtype=torch.float64) * 2 - 1
        elif kind == "laplace":
            # Inverse-CDF sampling of Laplace(0, 1) from a uniform draw in (-1/2, 1/2).
            centred = torch.rand(rotary_pairs, generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12) - 0.5
            omega = -torch.sign(centred) * torch.log1p(-2 * centred.abs())
        else:
            raise ValueError(f"unknown temperature_type {kind!r}")
        tau = theta * omega
    return (scale * tau).to(torch.float32)


# F.normalize's default; a module constant, as torch.compile cannot trace a class attribute read in a Function
NORMALIZE_EPS = 1e-12


class L2NormalizeChunks(torch.autograd.Function):
    """``F.normalize(x, dim=-1)`` (``x / max(‖x‖, 1e-12)``, the same operations, so the same values) whose backward
    keeps only the result and the clamped norms.

    Autograd through ``F.normalize`` keeps the float64 input as well, and its backward is eight full-size float64
    ops; in training that input is ~28 % of what the phase path keeps per layer (a (B, T, D) float64 tensor: 134 MB
    for 4 x 4096 tokens of width 1024). The gradient is the same formula, ``(g - u (u·g)) / ‖x‖`` (or ``g / 1e-12``
    where the norm is under the clamp, as ``clamp_min``'s gradient has it), equal to autograd's within float64
    rounding (tests/modeling/test_rotary.py)."""

    generate_vmap_rule = True  # (torch.func transforms work through it too)

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ``u``, the clamped norms and where the norm is not clamped (the last two for the backward only)."""
        norm = x.norm(2, -1, keepdim=True)
        denom = norm.clamp_min(NORMALIZE_EPS)
        return x / denom.expand_as(x), denom, norm >= NORMALIZE_EPS

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        u, denom, unclamped = output
        # denom stays differentiable: a double backward differentiates the backward's division by it
        ctx.mark_non_differentiable(unclamped)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(u, denom, unclamped)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, grad_denom: torch.Tensor | None, _grad_unclamped) -> torch.Tensor:
        u, denom, unclamped = ctx.saved_tensors
        if grad is None:
            grad = torch.zeros_like(u)
        along = (u * grad).sum(-1, keepdim=True) * unclamped  # the norm's share; none where the clamp holds it
        if torch.is_grad_enabled():  # a double backward (create_graph=True) differentiates these operations
            grad_x = (grad - u * along) / denom
        else:
            # The same operations into one buffer: each fresh full-width float64 temporary is fresh memory from the
            # OS (page faults), which cost as much as the arithmetic at small widths (docs/cpu_performance.md,
            # issue 51).
            out = u * along
            grad_x = torch.sub(grad, out, out=out).div_(denom)
        # Only the backward of a double backward reads denom (the first backward divides by it): d denom / dx = u
        # where the clamp does not hold it.
        return grad_x if grad_denom is None else grad_x + grad_denom * unclamped * u


def no_autocast(x: torch.Tensor):
    """The phase path has its own precision; under autocast (e.g. Trainer's ``bf16=True``) its projections would
    otherwise run in bf16. Outside autocast, no context at all (building one costs ~10 us, per layer and token)."""
    if not torch.is_autocast_enabled(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=x.device.type, enabled=False)


class PhaseProjection(nn.Module):
    """``P``: per-key-head map from the normalised input chunk ``u`` (width ``Dc``) to ``R`` phase increments.

    ``low_rank``: ``up_h @ down_h @ u_h``; ``full_rank``: a per-head block, weight-normalised
    (``scale · w / ||w||`` per output row); ``scalar``: one value per head, shared by every frequency.
    """

    def __init__(self, kind: str, num_key_heads: int, chunk_dim: int, rotary_pairs: int, rank: int):
        super().__init__()
        self.kind, self.rotary_pairs = kind, rotary_pairs
        if kind == "low_rank":
            self.down = nn.Parameter(torch.empty(num_key_heads, rank, chunk_dim))
            self.up = nn.Parameter(torch.empty(num_key_heads, rotary_pairs, rank))
        elif kind == "full_rank":
            self.weight = nn.Parameter(torch.empty(num_key_heads, rotary_pairs, chunk_dim))
            self.scale = nn.Parameter(torch.empty(num_key_heads, rotary_pairs))
        elif kind == "scalar":
            self.weight = nn.Parameter(torch.empty(num_key_heads, 1, chunk_dim))
        else:
            raise ValueError(f"unknown phase_proj {kind!r}")
        self.init_custom_parameters()

    @torch.no_grad()
    def init_custom_parameters(self) -> None:
        # u has unit norm, so N(0, 1) rows give a ~ N(0, 1): phase steps of the same order as RoPE's +1 per token.
        # transformers' init functions skip tensors already loaded from a checkpoint (this also runs in _init_weights).
        if self.kind == "low_rank":
            init.normal_(self.down)
            init.normal_(self.up, std=self.up.shape[-1] ** -0.5)
            return
        init.normal_(self.weight)
        if self.kind == "full_rank":  # weight norm starts as the plain weight (Salimans & Kingma)
            init.copy_(self.scale, self.weight.norm(dim=-1))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``u``: ``(B, T, Hk, Dc)`` -> ``(B, T, Hk, R)``, computed in ``u``'s dtype (float64 on the phase path).

        Batched matrix products over the heads (``bmm``) rather than ``torch.einsum``, whose argument parsing cost
        ~90 us a call: most of a decoding step's phase path."""
        batch, seq_len, heads, chunk = u.shape
        rows = u.permute(2, 0, 1, 3).reshape(heads, batch * seq_len, chunk)  # (Hk, B*T, Dc)
        if self.kind == "low_rank":
            low = torch.bmm(rows, self.down.to(u.dtype).transpose(1, 2))  # (Hk, B*T, rank)
            a = torch.bmm(low, self.up.to(u.dtype).transpose(1, 2))  # (Hk, B*T, R)
        elif self.kind == "full_rank":
            weight = self.scale.to(u.dtype).unsqueeze(-1) * F.normalize(self.weight.to(u.dtype), dim=-1)
            a = torch.bmm(rows, weight.transpose(1, 2))  # (Hk, B*T, R)
        else:
            a = torch.bmm(rows, self.weight.to(u.dtype).transpose(1, 2))  # (Hk, B*T, 1)
            a = a.expand(heads, batch * seq_len, self.rotary_pairs)
        return a.view(heads, batch, seq_len, -1).permute(1, 2, 0, 3)  # (B, T, Hk, R)


class DenseLowRankPhaseProjection(nn.Module):
    """``P`` as one low-rank map across key heads (``phase_proj="dense_low_rank"``; the official code's
    ``phi_parametrization="low-rank"``): every head's increments read the whole normalised input, every chunk.

        a_t = up @ (down @ u_t)        u_t: the Hk chunks concatenated (width D), down: (rank, D), up: (Hk·R, rank)

    ``rank`` (``phase_proj_rank``) is the total rank shared by every head, where ``"low_rank"``
    (:class:`PhaseProjection`) gives each head a map of its own from its own chunk; the two agree for one key head,
    or for block-diagonal weights. Rows of ``up`` are ordered head by head (``(Hk, R)`` when viewed).
    """

    kind = "dense_low_rank"

    def __init__(self, num_key_heads: int, chunk_dim: int, rotary_pairs: int, rank: int):
        super().__init__()
        self.num_key_heads, self.rotary_pairs = num_key_heads, rotary_pairs
        self.down = nn.Parameter(torch.empty(rank, num_key_heads * chunk_dim))
        self.up = nn.Parameter(torch.empty(num_key_heads * rotary_pairs, rank))
        self.init_custom_parameters()

    @torch.no_grad()
    def init_custom_parameters(self) -> None:
        # The concatenated u has norm sqrt(Hk): rows of std Hk^-1/2 give N(0, 1) low-rank features, and `up` turns
        # them into N(0, 1) increments, as the per-head projection starts.
        init.normal_(self.down, std=self.num_key_heads ** -0.5)
        init.normal_(self.up, std=self.up.shape[-1] ** -0.5)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``u``: ``(B, T, Hk, Dc)`` -> ``(B, T, Hk, R)``, computed in ``u``'s dtype (float64 on the phase path)."""
        low = F.linear(u.flatten(2), self.down.to(u.dtype))  # (B, T, rank)
        # (B, T, Hk, R); this rank's heads under tensor parallelism (``up``'s rows are split by head)
        return F.linear(low, self.up.to(u.dtype)).unflatten(-1, (-1, self.rotary_pairs))

    def extra_repr(self) -> str:
        return f"num_key_heads={self.num_key_heads}, rotary_pairs={self.rotary_pairs}, rank={self.down.shape[0]}"


class PhaseLinear(nn.Linear):
    """An ``nn.Linear`` computed in its input's dtype (float64 on the phase path) from its own (float32) weights.

    Still a ``Linear``, with the same parameter names: hooks, PEFT adapters and DeepSpeed's parameter gathering see
    the module they expect (an adapter adds its output, computed in its own dtype).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class PhaseConvolution(ShortConvolution):
    """The causal depthwise convolution on the phase increments, starting as the identity (a unit last tap).

    The usual N(0, initializer_range) convolution init would scale the increments down ~25× at the start (taps of
    ~0.02), far below the projection's order-1 steps; in our CPU parity runs that left Selective RoPE unable to learn
    the task within budget, while the identity start learns it as if there were no convolution and can still learn
    to mix neighbouring tokens.
    """

    @torch.no_grad()
    def init_custom_parameters(self) -> None:
        identity = torch.zeros_like(self.weight)  # (C, 1, K); the last tap multiplies the current token
        identity[..., -1] = 1.0
        init.copy_(self.weight, identity)

    def taps(self, device: torch.device, channels: int | None = None) -> torch.Tensor:
        """``(C, K)``, the last tap multiplying the current token (a view of the ``(C, 1, K)`` weight; the Triton
        kernels take the weight itself, see ``kernels.rotary.kernel_taps``; ``device`` and ``channels`` are for
        :class:`PhaseDifference`'s fixed taps)."""
        return self.weight.squeeze(1)


class PhaseDifference(nn.Module):
    """The fixed first difference over time, ``c_t = a_t - a_{t-1}`` (``phase_conv_type="difference"``; the official
    code's ``skip_conv``). Without gate and bias the phase then telescopes to ``θ_t = θ_0 + a_t - a_{-1}`` (``a_{-1}``
    the cached previous projection, 0 at a sequence start, so ``θ_t = a_t`` there): the rotation follows the current
    token's projection rather than a running sum of them.

    It is the causal convolution with the fixed taps ``(-1, 1)`` and no trainable parameter, computed by the same
    ``causal_conv1d``: its history is the previous projection ``(B, 1, C)`` (float64), cached, reordered with beams,
    left alone by padding tokens and restarted by packed sequences exactly as the learned convolution's, so a prefill
    followed by single-token steps equals one call. (The official implementation keeps no such history: each of its
    calls differences its first token against zero.)
    """

    def __init__(self, channels: int, activation: str | None = None):
        super().__init__()
        self.channels, self.activation = channels, activation

    def taps(self, device: torch.device, channels: int | None = None) -> torch.Tensor:
        """``(C, 2)``: ``-1`` on the previous input, ``+1`` on the current one (exact in every dtype). ``channels``:
        ``C`` if not the module's (this rank's heads' channels under tensor parallelism).

        Made on the device, not copied from a host list: ``torch.tensor([...], device="cuda")`` waits for the GPU
        to finish its queued work, on every call of every layer."""
        return (2 * torch.arange(2, device=device, dtype=torch.float32) - 1).expand(channels or self.channels, 2)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                dtype: torch.dtype | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``ShortConvolution.forward``: ``x`` ``(B, T, C)`` -> ``(B, T, C)`` and the new history ``(B, 1, C)``."""
        if dtype is not None:
            x = x.to(dtype)
        return causal_conv1d(x, self.taps(x.device, x.shape[-1]), state, lengths, self.activation,
                             cu_seqlens=cu_seqlens)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, taps=(-1, 1), activation={self.activation}"


class SelectiveRotaryEmbedding(nn.Module):
    """Rotates q and k by an input-dependent (``selective_rope``), fixed (``rope``) or no (``nope``) phase.

    Args:
        config: any family config (inherits :class:`SelectiveRopeConfigBase`).
        num_query_heads / num_key_heads: ``Hq`` and ``Hk`` (phases are per key head; ``Hq % Hk == 0``).
        head_dim: ``Dh`` of q and k.

    ``forward(x, q, k, state=None, lengths=None, cu_seqlens=None, backend=None, overwrite_state=False) -> (q, k,
    state)`` where ``x`` is the mixer input ``(B, T, D)``, ``q`` is ``(B, T, Hq, Dh)``, ``k`` is ``(B, T, Hk, Dh)``
    and ``state`` is a dict with the cached ``phase`` ``(B, Hk, R)`` (``R = rotary_pairs``) and ``phase_conv``
    history ``(B, K-1, Hk*R)`` (``K = 2`` for the difference), both float64 (``rotary_torch.phase_dtype``).

    Its parameters stay float32 when the model is cast to a lower precision (``model.to(torch.bfloat16)``,
    ``.half()``): see ``_apply``.

    Under tensor parallelism (``modeling/tensor_parallel.py``) the module holds the per-head parameters of this rank's
    key heads and ``head_shard`` is ``(rank, ranks)``: it rotates only its own heads (q and k arrive sharded by the
    attention projections), with the phases one process computes for them, from the whole (replicated) input ``x``.
    """

    head_shard: tuple[int, int] | None = None  # (rank, ranks) when tensor parallelism shards the heads

    def __init__(self, config: SelectiveRopeConfigBase, num_query_heads: int, num_key_heads: int, head_dim: int):
        super().__init__()
        if num_query_heads % num_key_heads:
            raise ValueError(f"num_query_heads ({num_query_heads}) must be a multiple of "
                             f"num_key_heads ({num_key_heads})")
        self.position_embedding = config.position_embedding  # "selective_rope", "rope" or "nope"
        self.backend = config.backend  # resolved per call (SELECTIVE_ROPE_BACKEND may override)
        self.num_key_heads = num_key_heads
        self.rotary_dim = int(head_dim * config.partial_rotary_factor)
        self.rotary_pairs = self.rotary_dim // 2
        self.temperature_config = (config.temperature_type, config.temperature_theta, config.temperature_max,
                                   config.temperature_seed)
        if self.position_embedding == "nope":
            return
        # Saved and loaded as `temperature` either way, and kept float32 (`_keep_in_fp32_modules_strict`, `_apply`); the
        # converter writes a source model's own inverse frequencies into it. Fixed (the default), it is a buffer, as
        # Llama's inverse frequencies are: a parameter with requires_grad=False does not stay fixed, since
        # transformers' loading gives every loaded parameter requires_grad=True and PEFT's `modules_to_save` copy
        # turns it on for every parameter of the module, after which any optimizer trains it.
        if config.temperature_trainable:
            self.temperature = nn.Parameter(self.initial_temperature())
        else:
            self.register_buffer("temperature", self.initial_temperature())
        if self.position_embedding == "rope":
            return

        hidden_size = config.hidden_size
        self.chunk_dim = hidden_size // num_key_heads
        if config.phase_proj == "dense_low_rank":
            self.phase_proj = DenseLowRankPhaseProjection(num_key_heads, self.chunk_dim, self.rotary_pairs,
                                                          config.phase_proj_rank)
        else:
            self.phase_proj = PhaseProjection(config.phase_proj, num_key_heads, self.chunk_dim, self.rotary_pairs,
                                              config.phase_proj_rank)
        self.phase_conv = self._build_conv(config, num_key_heads * self.rotary_pairs)
        self.phase_bias = nn.Parameter(torch.zeros(num_key_heads, self.rotary_pairs)) if config.phase_bias else None
        self.phase_gate_proj = self._build_gate(config, hidden_size) if config.phase_gate else None

    def _apply(self, fn, recurse: bool = True):
        """Device moves apply; casts to bf16 or fp16 do not.

        ``_keep_in_fp32_modules_strict`` keeps this module float32 when a checkpoint loads in bf16, but a later
        ``model.to(torch.bfloat16)`` or ``model.half()`` goes through ``_apply`` and would round the temperature:
        bf16 keeps 8 bits of each frequency, which for a Llama-3-style head (128 dims, base 500000) moves RoPE's
        angles by up to 59 rad at 32k tokens (README, "Numerical precision"). ``_apply`` is how ``nn.Module`` casts,
        so this covers every cast that goes through it (not, e.g., a framework's own low-precision parameter copies).
        """
        self.__dict__.pop("_cpu_plan", None)  # the compiled kernel's plan points at the storages being replaced
        low_precision = (torch.bfloat16, torch.float16)

        def keep_precision(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            if applied.dtype in low_precision and tensor.dtype not in low_precision:
                return tensor.to(applied.device)
            return applied

        return super()._apply(keep_precision, recurse)

    @staticmethod
    def _build_conv(config: SelectiveRopeConfigBase, channels: int) -> nn.Module | None:
        activation = "silu" if config.phase_conv_activation == "swish" else config.phase_conv_activation
        if config.phase_conv_type == "difference":
            return PhaseDifference(channels, activation=activation)
        if config.phase_conv_size == 0:
            return None
        return PhaseConvolution(channels, config.phase_conv_size, activation=activation)

    def _build_gate(self, config: SelectiveRopeConfigBase, hidden_size: int) -> nn.Module:
        if config.phase_gate_type == "head":
            return PhaseLinear(hidden_size, self.num_key_heads, bias=True)
        width = self.num_key_heads * (self.rotary_pairs if config.phase_gate_type == "channel" else 1)
        return nn.Sequential(PhaseLinear(hidden_size, config.phase_gate_rank, bias=False),
                             PhaseLinear(config.phase_gate_rank, width, bias=True))

    def per_head_parameters(self) -> list[str]:
        """The parameters indexed by key head along their first dim (tensor parallelism splits them with the heads):
        the per-head projection (the dense one's last map), the convolution's channels, the bias, the gate's last layer.
        The temperature and the first maps of the dense projection and of a low-rank gate are shared by every head."""
        if self.position_embedding != "selective_rope":
            return []
        if self.phase_proj.kind == "dense_low_rank":
            names = ["phase_proj.up"]
        else:
            names = [f"phase_proj.{name}" for name, _ in self.phase_proj.named_parameters()]
        if isinstance(self.phase_conv, PhaseConvolution):
            names.append("phase_conv.weight")
        if self.phase_bias is not None:
            names.append("phase_bias")
        if isinstance(self.phase_gate_proj, nn.Sequential):
            names += [f"phase_gate_proj.1.{name}" for name, _ in self.phase_gate_proj[1].named_parameters()]
        elif self.phase_gate_proj is not None:
            names += [f"phase_gate_proj.{name}" for name, _ in self.phase_gate_proj.named_parameters()]
        return names

    def initial_temperature(self) -> torch.Tensor:
        kind, theta, scale, seed = self.temperature_config
        return rotary_temperature(kind, theta, self.rotary_dim, scale, seed)

    def phase_increment(self, x: torch.Tensor, valid: torch.Tensor | None,
                        conv_state: torch.Tensor | None, lengths: torch.Tensor | None,
                        cu_seqlens: torch.Tensor | None = None):
        """``c_t`` of shape ``(B, T, Hk, R)`` float32 (zero at padding) and the new convolution history (float64;
        packed sequences, ``cu_seqlens``: the convolution restarts at each boundary, one history per sequence).

        Computed in float64 and rounded to float32 once, at the end (see the module docstring)."""
        batch, seq_len, _ = x.shape
        if self.position_embedding == "rope":
            ones = x.new_ones(batch, seq_len, 1, 1, dtype=torch.float32)
            return (ones if valid is None else ones * valid[..., None, None]), None

        u = self._normalized_chunks(x)
        a = self._project(u)  # (B, T, Hk, R)
        if valid is not None:
            a = a * valid[..., None, None]  # pads never enter the convolution history
        new_conv_state = None
        if self.phase_conv is not None:
            flat, new_conv_state = self.phase_conv(a.reshape(batch, seq_len, -1), conv_state, lengths, dtype=u.dtype,
                                                   cu_seqlens=cu_seqlens)
            a = flat.view(batch, seq_len, -1, self.rotary_pairs)
        if self.phase_bias is not None:
            a = a + self.phase_bias.to(u.dtype).exp()
        if self.phase_gate_proj is not None:
            a = a * torch.sigmoid(self._gate(u))
        if valid is not None:
            a = a * valid[..., None, None]  # pads never advance the phase
        return a.float(), new_conv_state

    def _normalized_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``u``: ``(B, T, D)`` -> ``(B, T, Hk, D / Hk)`` in ``phase_dtype`` (float64), each chunk L2-normalised (every
        key head's, also under tensor parallelism: the gate reads them all)."""
        batch, seq_len, _ = x.shape
        chunks = x.to(phase_dtype(x.device)).view(batch, seq_len, self.num_key_heads, self.chunk_dim)
        if torch.is_grad_enabled() and chunks.requires_grad:
            return L2NormalizeChunks.apply(chunks)[0]
        return F.normalize(chunks, dim=-1)

    def _project(self, u: torch.Tensor) -> torch.Tensor:
        """``P(u)``: ``(B, T, Hk, Dc)`` -> ``(B, T, Hk, R)``. Under tensor parallelism, this rank's heads: a per-head
        projection reads their own chunks, the dense one reads every chunk."""
        if self.head_shard is None or self.phase_proj.kind == "dense_low_rank":
            return self.phase_proj(u)
        rank, ranks = self.head_shard
        heads = self.num_key_heads // ranks
        return self.phase_proj(u[:, :, rank * heads:(rank + 1) * heads])

    def _gate(self, u: torch.Tensor) -> torch.Tensor:
        """``G(u)`` in ``u``'s dtype, shaped to broadcast against ``(B, T, Hk, R)``.

        The module is called (not its weights read), so hooks and adapters on it take effect.
        """
        batch, seq_len = u.shape[:2]
        gate = self.phase_gate_proj(u.flatten(2))  # (B, T, Hk) or (B, T, Hk * R): this rank's heads under TP
        heads = self.num_key_heads if self.head_shard is None else self.num_key_heads // self.head_shard[1]
        return gate.view(batch, seq_len, heads, -1)

    def forward(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
        lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        backend: str | None = None,
        overwrite_state: bool = False,
        in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``backend``: ``"torch"``, ``"torch+c"`` or ``"triton"`` as the model resolved it for this call
        (``dispatch.resolve_backend``); ``None``: resolved here from the config's ``backend`` (and the environment).

        ``overwrite_state``: the caller owns ``state`` and keeps only the new one (the model's cache, when it keeps
        states): the new phase and history may then be written into ``state``'s tensors instead of new ones (the
        compiled CPU path does; the returned state is the one to keep either way). Otherwise ``state`` is never
        modified.

        ``in_place``: ``state``'s tensors are a static cache's, which keep their addresses: the single-token steps
        (torch and Triton) then write the new phase and history into them and return them (where they have the
        step's dtype and layout: float64, contiguous). Implies ``overwrite_state``."""
        if self.position_embedding == "nope":
            return q, k, {}
        if backend is None:
            backend = resolve_backend(self.backend, q.device)
        if cu_seqlens is not None and not takes_packed(backend):  # the op then takes one dense row per sequence
            return self._forward_packed(x, q, k, state, cu_seqlens, backend)
        return rotary_embedding(self, x, q, k, state or {}, lengths, cu_seqlens=cu_seqlens, backend=backend,
                                overwrite_state=overwrite_state, in_place=in_place)

    # The phase inputs the op asks for (``kernels.rotary.PhasePath``), as its chosen path needs them.

    def sequence_increment(self, x, lengths, conv_state, cu_seqlens):
        """``phase_increment`` for right-padded rows with ``lengths`` real tokens (``None``: every row is full)."""
        valid = None if lengths is None else valid_mask(lengths, x.shape[1])  # (B, T)
        with no_autocast(x):
            return self.phase_increment(x, valid, conv_state, lengths, cu_seqlens)

    def step_increment(self, x, history, valid, in_place=False):
        """``c_t`` for one token per row, Selective RoPE or RoPE, in ``phase_dtype`` (rounded to float32 once, as a
        prefill rounds it), and the new convolution history; ``valid`` ``(B, 1, 1)`` or ``None``. ``in_place``: the
        history is written into ``history`` where it can be."""
        dtype = phase_dtype(x.device)
        if self.position_embedding == "rope":  # c_t = 1 for a real token, 0 for a pad
            return (x.new_ones((), dtype=dtype) if valid is None else valid.to(dtype)), None
        with no_autocast(x):
            increment, conv_state = self._single_token_increment(x, history, valid, in_place)
        return increment.float().to(dtype), conv_state

    def decode_phase_inputs(self, x):
        """Steps 1-2 for one token per row through the phase modules (their hooks and adapters run), float64: the
        projection ``(B, Hk, R)`` and the gate logits ``(B, Hk, 1 or R)`` (``None`` without a gate)."""
        with no_autocast(x):
            u = self._normalized_chunks(x)  # (B, 1, Hk, Dc) float64
            projection = self._project(u)[:, 0]  # (B, Hk, R) float64
            gate_logits = None if self.phase_gate_proj is None else self._gate(u)[:, 0]  # (B, Hk, 1 or R)
        return projection, gate_logits

    def fusable_phase_weights(self) -> tuple | None:
        """``(down, up, gate weight, gate bias)`` for the fused Triton step from the input
        (``rotary_triton.selective_rotary_decode_from_input_triton``), or ``None`` where the phase path is not the
        default one (a ``"low_rank"`` projection, a per-head gate or none), a module is not ours (a PEFT adapter
        replaces one) or something observes the modules (hooks on them, or global ones: they would not see the
        modules run). Then the modules are called."""
        proj, gate = self.phase_proj, self.phase_gate_proj
        if self.head_shard is not None:  # the fused step reads every head's input chunk from its own weights
            return None
        if type(proj) is not PhaseProjection or proj.kind != "low_rank":
            return None
        if gate is not None and (type(gate) is not PhaseLinear or gate.bias is None):  # the per-head gate only
            return None
        for module in (proj, gate):
            if module is not None and (module._forward_hooks or module._forward_pre_hooks):
                return None
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return None
        return proj.down, proj.up, None if gate is None else gate.weight, None if gate is None else gate.bias

    def cpu_kernel_parameters(self) -> tuple[list[nn.Module], dict | None]:
        """The phase modules (this one's hooks run whichever path does) and ``RotaryPlan``'s keyword arguments for the
        compiled CPU kernel, ``None`` where it does not know a phase module: exactly our classes, not subclasses or
        wrappers (e.g. a PEFT adapter), which may compute something else."""
        if self.position_embedding != "selective_rope":
            return [], {}
        proj, conv, gate = self.phase_proj, self.phase_conv, self.phase_gate_proj
        children = list(gate.children()) if type(gate) is nn.Sequential else []
        gate_layers = children or ([] if gate is None else [gate])
        modules = [m for m in (proj, conv, gate) if m is not None] + children
        known = (type(proj) in (PhaseProjection, DenseLowRankPhaseProjection)
                 and (conv is None or type(conv) in (PhaseConvolution, PhaseDifference))
                 and all(type(layer) is PhaseLinear for layer in gate_layers))
        if not known:
            return modules, None
        low_rank = proj.kind in ("low_rank", "dense_low_rank")
        parameters = {"projection": ((proj.kind, proj.down, proj.up) if low_rank else
                                     (proj.kind, proj.weight, proj.scale if proj.kind == "full_rank" else None))}
        if type(conv) is PhaseDifference:
            parameters["conv"] = ("difference", None, conv.activation)
        elif conv is not None:
            parameters["conv"] = ("learned", conv.weight, conv.activation)
        parameters["bias"] = self.phase_bias
        parameters["gate"] = tuple((layer.weight, layer.bias) for layer in gate_layers)
        return modules, parameters

    def _single_token_increment(self, x, history, valid, in_place=False):
        """``c_t`` for one token per row, float64 ``(B, Hk, R)`` (not yet rounded), and the new convolution history
        (written into ``history`` where ``in_place`` and it can be); ``valid`` ``(B, 1, 1)`` or None."""
        u = self._normalized_chunks(x)  # (B, 1, Hk, Dc) float64
        a = self._project(u)[:, 0]  # (B, Hk, R)
        if valid is not None:
            a = a * valid  # pads never enter the convolution history
        conv_state = None
        if self.phase_conv is not None:
            a, conv_state = self._conv_step(a, history, valid, in_place)
        if self.phase_bias is not None:
            a = a + self.phase_bias.to(u.dtype).exp()
        if self.phase_gate_proj is not None:
            a = a * torch.sigmoid(self._gate(u)[:, 0])
        if valid is not None:
            a = a * valid  # pads never advance the phase
        return a, conv_state

    def _conv_step(self, a: torch.Tensor, history: torch.Tensor | None, valid: torch.Tensor | None,
                   in_place: bool = False):
        """The phase convolution for one token: ``a`` ``(B, Hk, R)`` -> its output and the new history
        ``(B, K-1, C)`` (``history`` itself where ``in_place`` and it has ``a``'s dtype). The taps are summed oldest
        first, as ``causal_conv1d`` sums them (one reduction over the window rather than K products and K-1
        additions: fewer ops)."""
        batch = a.shape[0]
        current = a.reshape(batch, 1, -1)  # (B, 1, C)
        taps = self.phase_conv.taps(a.device, current.shape[-1]).to(a.dtype)  # (C, K), the last tap on the current one
        out = history if in_place and writable(history, a.dtype) else None
        if history is None:
            history = current.new_zeros(batch, taps.shape[1] - 1, current.shape[-1])
        history = history.to(a.dtype)
        window = torch.cat([history, current], dim=1)  # (B, K, C), oldest first (a copy: `out` may be overwritten)
        y = (window * taps.t()).sum(1)  # (B, C)
        y = F.silu(y) if self.phase_conv.activation == "silu" else y
        if out is not None:  # a pad keeps the history it had
            new_history = out.copy_(window[:, 1:]) if valid is None else torch.where(valid, window[:, 1:], out,
                                                                                       out=out)
        else:
            new_history = window[:, 1:].clone()  # not a view: the cache must not keep the window alive
            if valid is not None:  # a pad keeps the history it had
                new_history = torch.where(valid, new_history, history)
        return y.view_as(a), new_history

    def _forward_packed(self, x, q, k, state, cu_seqlens, backend):
        """Packed sequences ``(1, total, ...)`` on the torch path, through one dense row per sequence (the Triton
        kernel takes them as they are): each sequence restarts phase and convolution; state is per sequence."""
        layout = SequenceLayout.from_cu_seqlens(cu_seqlens, total=x.shape[1])
        q_rows, k_rows, new_state = self.forward(layout.to_rows(x), layout.to_rows(q), layout.to_rows(k),
                                                 state=state, lengths=layout.lengths, backend=backend)
        return layout.from_rows(q_rows), layout.from_rows(k_rows), new_state

