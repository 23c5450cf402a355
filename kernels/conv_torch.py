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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y_t = act(Σ_j weight[:, j] · x_{t-K+1+j})`` with the history before ``x_0`` taken from ``initial_state``.

    Args:
        x: ``(B, T, C)``; rows are right-padded when ``lengths`` is given (pads sit after the real tokens, so they
            never reach a real output).
        weight: ``(C, K)`` taps, the last one multiplying the current token.
        initial_state: ``(B, K-1, C)`` the previous ``K-1`` inputs, oldest first (zeros when ``None``).
        lengths: ``(B,)`` number of real tokens per row, or ``None`` when every row is full.
        activation: ``None`` or ``"silu"``.

    Returns:
        ``y`` of shape ``(B, T, C)`` and the final state ``(B, K-1, C)``: the last ``K-1`` real inputs of each row
        (continuing from ``initial_state`` when the row is shorter than ``K-1``).
    """
    batch, seq_len, channels = x.shape
    kernel_size = weight.shape[-1]
    if initial_state is None:
        initial_state = x.new_zeros(batch, kernel_size - 1, channels)
    history = torch.cat([initial_state.to(x.dtype), x], dim=1)  # (B, K-1+T, C)
    weight = weight.to(x.dtype)
    # K is tiny (2-4): a sum of K shifted products is as fast as conv1d on CPU and keeps the layout (B, T, C).
    y = sum(history[:, j : j + seq_len] * weight[:, j] for j in range(kernel_size))
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}; expected None or 'silu'")

    if lengths is None:
        final_state = history[:, seq_len:].clone()  # not a view: the cache must not keep all of `history` alive
    else:
        # The K-1 inputs just before each row's end sit at history[len : len+K-1].
        index = lengths.view(batch, 1) + torch.arange(kernel_size - 1, device=x.device)  # (B, K-1)
        final_state = history.gather(1, index.unsqueeze(-1).expand(-1, -1, channels))
    return y, final_state
