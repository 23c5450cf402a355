"""SelectiveRopeFoX: the Forgetting Transformer (Lin et al., 2025) with Selective RoPE, a superset of Llama.

Mixer (parameter names follow transformers' Llama attention and flash-linear-attention's ``ForgettingAttention``):

    q, k, v   = q_proj(x), k_proj(x), v_proj(x)               (B, T, H·D); GQA: Hk key/value heads
    k, v      = α k_{t-1} + (1 - α) k_t, α = sigmoid(W x)       optional data-dependent token shift (FoX Pro)
    q, k      = RMSNorm(q), RMSNorm(k) per head                 optional, weights of size D (as Qwen3)
    log f_t   = logsigmoid(f_proj(x_t))                         per query head, optional forget gate
    q, k      = SelectiveRoPE(x, q, k)                          last transform: the cache stores rotated keys
    o_t       = Σ_τ softmax_τ(q_t·k_τ / √D + Σ_{s=τ+1..t} log f_s) v_τ
    out       = o_proj(sigmoid(g_proj(x)) ⊙ RMSNorm(o))         optional output norm and gate (FoX Pro); the gate's
                                                                projection may be carried in q_proj (Qwen3-Next)

With ``use_forget_gate=False``, ``position_embedding="rope"`` and no Pro option this is exactly Llama's attention, so a
Llama / Mistral / Qwen2 / Qwen3 checkpoint maps onto it weight for weight (see ``conversion/``).

The cache keeps the key timeline of each row: rotated keys, values, log forget gates and which slots hold real tokens
(left padding leaves holes), plus the running shift and Selective RoPE states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.fox import SelectiveRopeFoXConfig
from ..kernels.forgetting_attention import (
    FLA_MAX_ATTENTION_HEAD_DIM,
    forgetting_attention,
    forgetting_attention_and_weights,
)
from ..kernels.rotary_torch import phase_dtype
from ..kernels.segments import packed_positions
from .base import SelectiveRopeForCausalLMBase, SelectiveRopeModelBase
from .layers import RMSNorm, ZeroCentredRMSNorm
from .layout import SequenceLayout, valid_mask
from .mixer import LayerState
from .rotary import SelectiveRotaryEmbedding


def last_real(x: torch.Tensor, lengths: torch.Tensor | None, previous: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The last real token of each right-padded row of ``x`` ``(B, T, ...)``, or of each sequence packed in ``x``
    ``(1, total, ...)`` with ``cu_seqlens``; ``previous`` (or zeros) for empty rows."""
    if cu_seqlens is not None:
        lengths = cu_seqlens.diff()
        last = x[0, (cu_seqlens[1:].long() - 1).clamp(min=0)]  # (N, ...)
    elif lengths is None:
        return x[:, -1]
    else:
        last = x[torch.arange(x.shape[0], device=x.device), (lengths - 1).clamp(min=0)]
    fallback = torch.zeros_like(last) if previous is None else previous.to(last.dtype)
    empty = (lengths == 0).view(-1, *([1] * (last.dim() - 1)))
    return torch.where(empty, fallback, last)


def token_shift(x: torch.Tensor, alpha: torch.Tensor, previous: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``α_t x_{t-1} + (1 - α_t) x_t`` for ``x`` ``(B, T, H, D)`` and ``α`` ``(B, T, H)``; ``x_{-1}`` is ``previous``
    ``(B, H, D)`` (zeros at a sequence start). Packed sequences (``x`` ``(1, total, H, D)``, ``cu_seqlens``): each
    sequence's first token reads its own row of ``previous`` ``(N, H, D)``."""
    if cu_seqlens is None:
        first = torch.zeros_like(x[:, :1]) if previous is None else previous.unsqueeze(1).to(x.dtype)
        shifted = torch.cat([first, x[:, :-1]], dim=1)
    else:
        sequence, position = packed_positions(cu_seqlens, x.shape[1])  # (total,)
        before = (x.new_zeros(cu_seqlens.numel() - 1, *x.shape[2:]) if previous is None
                  else previous.to(x.dtype))  # (N, H, D)
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # (1, total, H, D)
        shifted = torch.where((position == 0)[None, :, None, None], before[sequence].unsqueeze(0), shifted)
    alpha = alpha.to(x.dtype).unsqueeze(-1)
    return alpha * shifted + (1 - alpha) * x


class ForgettingAttention(nn.Module):
    """The FoX mixer (:class:`~.mixer.Mixer`). Its state: the key timeline ``key``, ``value`` ``(B, T_seen, Hk, D)``,
    ``log_fgate`` ``(B, T_seen, Hq)`` and ``valid`` ``(B, T_seen)``, per-token histories the cache can crop; the
    token shifts' last keys / values and the Selective RoPE state, running states."""

    has_attention_weights = True  # softmax attention: output_attentions returns its weights

    def __init__(self, config: SelectiveRopeFoXConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, heads, kv_heads, head_dim = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim

        # With the gate carried in q_proj, each head's query is followed by its output gate: (H · 2D) outputs.
        self.gate_in_q_proj = config.output_gate_in_q_proj
        q_width = heads * head_dim * (2 if self.gate_in_q_proj else 1)
        self.q_proj = nn.Linear(hidden, q_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=config.attention_output_bias)
        self.f_proj = nn.Linear(hidden, heads, bias=True) if config.use_forget_gate else None
        self.k_shift_proj = nn.Linear(hidden, kv_heads, bias=False) if config.use_k_shift else None
        self.v_shift_proj = nn.Linear(hidden, kv_heads, bias=False) if config.use_v_shift else None
        qk_norm = ZeroCentredRMSNorm if config.qk_norm_zero_centred else RMSNorm
        self.q_norm = qk_norm(head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = qk_norm(head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.rotary = SelectiveRotaryEmbedding(config, heads, kv_heads, head_dim)
        self.o_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if config.use_output_norm else None
        separate_gate = config.use_output_gate and not self.gate_in_q_proj
        self.g_proj = nn.Linear(hidden, heads * head_dim, bias=False) if separate_gate else None

    def forward(self, x: torch.Tensor, state: LayerState, *, lengths: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, backend: str = "torch",
                phase_input: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``(B, T, D)`` right-padded rows -> ``(B, T, D)``; the new state goes into ``state``. ``phase_input``:
        what the Selective RoPE phase path reads instead of ``x`` (``x`` before its rounding to the model dtype).
        Packed sequences: ``x`` ``(1, total, D)`` with ``cu_seqlens`` (fla path only); the cache then holds one
        right-padded row per sequence, as on the torch path."""
        batch, seq_len, _ = x.shape
        valid = valid_mask(lengths, seq_len) if lengths is not None else None  # (B, T)

        # Head counts from the projections' outputs, not the config: under tensor parallelism each rank computes its
        # own heads (configuration/tensor_parallel.py).
        gate = None
        if self.gate_in_q_proj:  # (B, T, Hq, 2D) -> the queries and the output gate, (B, T, Hq, D) each
            q, gate = self.q_proj(x).view(batch, seq_len, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim)  # (B, T, Hq, D)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim)  # (B, T, Hk, D)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)
        if self.k_shift_proj is not None:  # the shift state is the last unshifted key / value
            if state.keep:
                state.set("k_shift", last_real(k, lengths, state.get("k_shift"), cu_seqlens))
            k = token_shift(k, torch.sigmoid(self.k_shift_proj(x).float()), state.get("k_shift"), cu_seqlens)
        if self.v_shift_proj is not None:
            if state.keep:
                state.set("v_shift", last_real(v, lengths, state.get("v_shift"), cu_seqlens))
            v = token_shift(v, torch.sigmoid(self.v_shift_proj(x).float()), state.get("v_shift"), cu_seqlens)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        log_fgate = None
        if self.f_proj is not None:
            log_fgate = F.logsigmoid(self.f_proj(x).float())  # (B, T, Hq)
            if valid is not None:
                log_fgate = log_fgate * valid[..., None]

        q, k = self._rotate(x if phase_input is None else phase_input, q, k, state, lengths, cu_seqlens, backend)

        if cu_seqlens is None:
            o = self._attend(q, k, v, log_fgate, valid, state, backend)  # (B, T, Hq, D)
        else:
            o = self._attend_packed(q, k, v, log_fgate, state, backend, cu_seqlens)

        if self.o_norm is not None:
            o = self.o_norm(o)
        o = o.reshape(batch, seq_len, -1)  # (B, T, Hq * D)
        if self.g_proj is not None:
            gate = self.g_proj(x)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(batch, seq_len, -1))
        return self.o_proj(o)

    def _rotate(self, x, q, k, state: LayerState, lengths, cu_seqlens, backend):
        """Selective RoPE continues its cached state. RoPE's phase is the number of real tokens so far: recomputed
        from the key timeline rather than cached, so that cropping the cache keeps it exact."""
        rotary_state = state.scope("rotary")
        if self.rotary.position_embedding == "rope" and "key" in state:
            if "valid" in state:  # real tokens per row
                seen = state.get("valid").sum(dim=1, dtype=phase_dtype(x.device))  # (B,)
            else:  # no padding so far: every cached slot
                seen = torch.full((x.shape[0],), state.get("key").shape[1], dtype=phase_dtype(x.device),
                                  device=x.device)
            previous = {"phase": seen[:, None, None].expand(-1, k.shape[2], self.rotary.rotary_pairs)}
        else:
            previous = rotary_state.previous()
        # (RoPE's phase here is derived from the key history, not a cached tensor: nothing to write in place.)
        q, k, new_rotary_state = self.rotary(x, q, k, previous, lengths, cu_seqlens, backend=backend,
                                             overwrite_state=state.keep, in_place=state.in_place and
                                             self.rotary.position_embedding == "selective_rope")
        if self.rotary.position_embedding == "selective_rope":
            rotary_state.update(new_rotary_state)
        return q, k

    @staticmethod
    def _attend(q, k, v, log_fgate, valid, state: LayerState, backend):
        """Attention over right-padded rows continuing the cached key timeline, which this call's tokens extend.

        Which key slots are real (``valid`` in the cache) is kept only from the first call with padding on: until
        then every slot is real, which needs no tensor and no check (a check is a device sync on a GPU, in every
        layer of every decoding step). A static cache keeps ``valid`` from the prefill on: it also marks the slots
        not written yet."""
        batch, seq_len = q.shape[:2]
        cached = state.get("key")  # (B, T_seen, Hk, D) or None
        # The key timeline: cached slots followed by this call's tokens.
        k, v = state.extend("key", k), state.extend("value", v)
        if log_fgate is not None:
            log_fgate = state.extend("log_fgate", log_fgate)
        if state.fixed_length:  # a static cache: max-length buffers, their unwritten slots marked invalid
            if state.output_attentions:  # the queries are not the last slots of the buffers the weights would cover
                raise ValueError("output_attentions=True is not supported with a static cache; use the default "
                                 "dynamic cache to read attention weights")
            query_valid = torch.ones(batch, seq_len, dtype=torch.bool, device=q.device) if valid is None else valid
            key_valid = state.extend("valid", query_valid)
            if cached is None and valid is None:  # the prefill, without padding: as with the dynamic cache
                return forgetting_attention(q, k, v, log_fgate, backend=backend)
            return forgetting_attention(q, k, v, log_fgate, key_valid=key_valid, query_valid=query_valid,
                                        backend=backend)
        key_valid = None
        if valid is not None or "valid" in state:
            if valid is None:
                valid = torch.ones(batch, seq_len, dtype=torch.bool, device=q.device)
            if "valid" not in state and cached is not None:  # the first padding: the slots so far were all real
                valid = torch.cat([torch.ones(batch, cached.shape[1], dtype=torch.bool, device=q.device), valid],
                                  dim=1)
            key_valid = state.extend("valid", valid)
        if state.output_attentions:  # (B, Hq, T, T_seen + T) weights over the key timeline, in the caller's layout
            o, state.attentions = forgetting_attention_and_weights(q, k, v, log_fgate, key_valid=key_valid,
                                                                   layout=state.attention_layout)
            return o
        return forgetting_attention(q, k, v, log_fgate, key_valid=key_valid, backend=backend)

    def _attend_packed(self, q, k, v, log_fgate, state: LayerState, backend, cu_seqlens):
        """Attention over sequences packed in ``(1, total, ...)``. fla's kernel takes whole sequences as they are; the
        cached timeline is one right-padded row per sequence, as on the torch path (the layout decoding continues
        from)."""
        native = "key" not in state and self.head_dim <= FLA_MAX_ATTENTION_HEAD_DIM
        o = forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, backend=backend) if native else None
        if native and not state.keep:
            return o
        layout = SequenceLayout.from_cu_seqlens(cu_seqlens, total=q.shape[1])
        valid = layout.valid  # (N, L)
        k_rows, v_rows = layout.to_rows(k), layout.to_rows(v)
        gates = None if log_fgate is None else layout.to_rows(log_fgate) * valid[..., None]  # zero at pads, as on rows
        if native:  # a fresh timeline: only the cache needs it
            for name, rows in (("key", k_rows), ("value", v_rows), ("valid", valid), ("log_fgate", gates)):
                if rows is not None:
                    state.extend(name, rows)
            return o
        # fla cannot continue a cached timeline: attend through the rows, as the torch path does
        return layout.from_rows(self._attend(layout.to_rows(q), k_rows, v_rows, gates, valid, state, backend))


class SelectiveRopeFoXModel(SelectiveRopeModelBase):
    config_class = SelectiveRopeFoXConfig
    mixer_class = ForgettingAttention


class SelectiveRopeFoXForCausalLM(SelectiveRopeForCausalLMBase):
    config_class = SelectiveRopeFoXConfig
    model_class = SelectiveRopeFoXModel
