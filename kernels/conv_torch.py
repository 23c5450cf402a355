"""Causal depthwise short convolution over time, pure PyTorch (the reference for every backend)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y_t = act(Σ_j weight[:, j] · x_{t-K+1+j})`` with the history before ``x_0`` taken from ``initial_state``.

    Args:
        x: ``(B, T, C)``; rows are right-padded when ``lengths`` is given (pads sit after the real tokens, so they
            never reach a real output).
        weight: ``(C, K)`` taps, the last one multiplying the current token.
        initial_state: ``(B, K-1, C)`` the previous ``K-1`` inputs, oldest first (zeros when ``None``).
        lengths: ``(B,)`` number of real tokens per row, or ``None`` when every row is full.
        activation: ``None`` or ``"silu"``.
        cu_seqlens: ``(N + 1,)`` offsets of sequences packed in one row (``x`` of shape ``(1, total, C)``, no
            ``lengths``): the convolution restarts at each boundary, and ``initial_state`` and the final state hold
            one history per sequence, ``(N, K-1, C)``.
        in_place: write the final state into ``initial_state`` itself and return it (a static cache's history,
            whose address must not change), where it has ``x``'s dtype and rows are not packed; else a new tensor.

    Returns:
        ``y`` of shape ``(B, T, C)`` and the final state ``(B, K-1, C)`` (``(N, K-1, C)`` when packed): the last
        ``K-1`` real inputs of each row or sequence (continuing from ``initial_state`` when it is shorter than
        ``K-1``).
    """
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}; expected None or 'silu'")
    if cu_seqlens is not None:
        if lengths is not None:
            raise ValueError("pass lengths (padded rows) or cu_seqlens (packed sequences), not both")
        return _packed_causal_conv1d(x, weight, initial_state, activation, cu_seqlens)
    batch, seq_len, channels = x.shape
    kernel_size = weight.shape[-1]
    out = initial_state if in_place and initial_state is not None and initial_state.dtype == x.dtype else None
    if initial_state is None:
        initial_state = x.new_zeros(batch, kernel_size - 1, channels)
    history = torch.cat([initial_state.to(x.dtype), x], dim=1)  # (B, K-1+T, C), a copy: `out` may be overwritten
    y = _taps_over(history, _contiguous_taps(weight, x.dtype), seq_len)
    y = F.silu(y) if activation == "silu" else y

    if lengths is None:
        # Not a view: the cache must not keep all of `history` alive.
        final_state = history[:, seq_len:].clone() if out is None else out.copy_(history[:, seq_len:])
    else:
        # The K-1 inputs just before each row's end sit at history[len : len+K-1].
        index = lengths.view(batch, 1) + torch.arange(kernel_size - 1, device=x.device)  # (B, K-1)
        index = index.unsqueeze(-1).expand(-1, -1, channels)
        final_state = history.gather(1, index) if out is None else torch.gather(history, 1, index, out=out)
    return y, final_state


def _contiguous_taps(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(C, K)`` -> ``(K, C)``: each tap's weights contiguous, which the broadcast products run ~3x faster on than
    a strided column."""
    return weight.to(dtype).t().contiguous()


def _taps_over(history: torch.Tensor, taps: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``Σ_j history[:, j : j+T] · taps[j]`` for ``history`` ``(B, K-1+T, C)`` and ``taps`` ``(K, C)``: ``(B, T, C)``.
    K is tiny (2-4): a sum of K shifted products is as fast as conv1d on CPU and keeps the layout (B, T, C)."""
    if torch.is_grad_enabled() and (history.requires_grad or taps.requires_grad):
        return _CausalTaps.apply(history, taps, seq_len)
    return _sum_of_taps(history[:, j : j + seq_len] * taps[j] for j in range(taps.shape[0]))


def _packed_causal_conv1d(x, weight, initial_state, activation, cu_seqlens):
    """``causal_conv1d`` over packed sequences without padding them into rows.

    The packed row runs through the dense taps as one sequence. Only the first ``K-1`` tokens of each sequence read
    across its start, where they must read the sequence's own history instead: those ``N * (K-1)`` outputs are
    recomputed from small gathers (the same products, summed in the same order: equal bit for bit to the sequence
    run alone) and written over the row's. Why not gather every tap's input for every token: K index gathers, and a
    scatter-add per tap in their backward, made packed training's convolution 2.3x the dense one (CPU, 1 x 8192 x
    512 float64, 4 taps), and the packed 370M Selective RoPE FoX trained at 0.92x the dense (H200, run 4)."""
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs packed sequences in a batch of 1, got x of shape {tuple(x.shape)}")
    total, channels = x.shape[1:]
    kernel_size = weight.shape[-1]
    cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    starts, lengths = cu_seqlens[:-1], cu_seqlens.diff()  # (N,)
    num_seqs = lengths.numel()
    if initial_state is None:
        initial_state = x.new_zeros(num_seqs, kernel_size - 1, channels)
    initial_state = initial_state.to(x.dtype)
    taps = _contiguous_taps(weight, x.dtype)
    history = torch.cat([x.new_zeros(1, kernel_size - 1, channels), x], dim=1)  # (1, K-1 + total, C)
    y = _taps_over(history, taps, total)  # (1, total, C): the first sequence's reads before it are replaced too
    rows = history.view(-1, channels)  # gathered from as a view: history[0] would add a full-size select backward

    if kernel_size > 1 and total > 0:
        p = torch.arange(kernel_size - 1, device=x.device).view(1, -1, 1)  # (1, K-1, 1): position in the sequence
        j = torch.arange(kernel_size, device=x.device).view(1, 1, -1)  # (1, 1, K): tap
        token = starts.view(-1, 1, 1) + p  # (N, K-1, 1)
        # Tap j of position p reads x_{p-K+1+j}: the history's slot p+j where that is before the sequence (p+j < K-1).
        own = initial_state[torch.arange(num_seqs, device=x.device).view(-1, 1, 1), (p + j).clamp(max=kernel_size - 2)]
        row = rows[(token + j).clamp(max=rows.shape[0] - 1)]  # (N, K-1, K, C): what the row read
        reads = torch.where((p + j < kernel_size - 1).unsqueeze(-1), own, row)
        boundary = _sum_of_taps(reads[:, :, k] * taps[k] for k in range(kernel_size))  # (N, K-1, C)
        # Positions past a sequence's end are no tokens of it: they write token 0's own value (the first non-empty
        # sequence's position 0, detached so its gradient counts once) to token 0. Same bits, so the duplicate
        # writes are deterministic, and no spare row (and no copy of y to drop it) is needed. No host sync.
        inside = p[..., 0] < lengths.view(-1, 1)  # (N, K-1)
        first = boundary[(lengths > 0).long().argmax(), 0].detach()  # (C,)
        boundary = torch.where(inside.unsqueeze(-1), boundary, first)
        slot = torch.where(inside, token[..., 0], 0)  # (N, K-1)
        y.index_put_((torch.zeros_like(slot), slot), boundary)  # (the taps' backward does not read their output)
    y = F.silu(y) if activation == "silu" else y

    # Final state: the last K-1 inputs of each sequence, from its own history where it is shorter than K-1.
    last = lengths.view(-1, 1) - (kernel_size - 1) + torch.arange(kernel_size - 1, device=x.device)  # (N, K-1)
    from_row = rows[(starts.view(-1, 1) + last + kernel_size - 1).clamp(min=0)]  # (N, K-1, C)
    slot = (last + kernel_size - 1).clamp(0, max(kernel_size - 2, 0))  # the history's slot where last < 0
    from_state = initial_state.gather(1, slot.unsqueeze(-1).expand(-1, -1, channels))
    return y, torch.where((last >= 0).unsqueeze(-1), from_row, from_state)


def _sum_of_taps(products) -> torch.Tensor:
    """The taps' products summed oldest first, into the first product (a fresh tensor, which autograd does not need:
    a product's backward reads its inputs). Not ``sum(...)``, which starts from the integer 0: one more pass over the
    whole (B, T, C) output. In place, because every fresh (B, T, C) temporary of a long prefill is also fresh memory
    from the OS: at 8k tokens and 128 float64 channels, ~2k page faults (~4 ms on our VM) each."""
    products = iter(products)
    total = next(products)
    for product in products:
        total.add_(product)
    return total


class _CausalTaps(torch.autograd.Function):
    """``Σ_j history[:, j : j+T] · taps[j]``, the taps' sum of ``causal_conv1d`` in training: the same forward (same
    products, same order); the backward writes every tap's input gradient into one ``(B, K-1+T, C)`` buffer
    (``addcmul_``), where autograd through the products builds one zero-padded buffer per tap and adds them up.
    With contiguous taps (``causal_conv1d``), CPU, 1 x 4096 x 512 float64, 4 taps, interleaved: forward + backward
    21.0 against 40.3 ms. The backward's operations are differentiable, so double backward still works."""

    generate_vmap_rule = True

    @staticmethod
    def forward(history: torch.Tensor, taps: torch.Tensor, seq_len: int) -> torch.Tensor:
        return _sum_of_taps(history[:, j : j + seq_len] * taps[j] for j in range(taps.shape[0]))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        history, taps, ctx.seq_len = inputs
        ctx.save_for_backward(history, taps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        history, taps = ctx.saved_tensors
        seq_len, kernel_size = ctx.seq_len, taps.shape[0]
        grad_history = grad_taps = None
        if ctx.needs_input_grad[0]:
            grad_history = torch.zeros_like(history)
            for j in range(kernel_size):
                grad_history[:, j : j + seq_len].addcmul_(grad, taps[j])
        if ctx.needs_input_grad[1]:
            grad_taps = torch.stack([(grad * history[:, j : j + seq_len]).sum((0, 1)) for j in range(kernel_size)])
        return grad_history, grad_taps, None
