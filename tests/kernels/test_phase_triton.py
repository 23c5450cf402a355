"""``kernels/phase_triton.py`` (run on CPU by Triton's interpreter) against the rotary module's torch phase path,
``SelectiveRotaryEmbedding.phase_increment``: the default phase path's increments and the convolution's new history,
from a sequence start or a cached history, with its options, padding and packed sequences (issue 46, item 1's first
block; no model calls it yet)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton phase kernel cannot be tested")

from rotary_reference import HIDDEN, make_rotary  # noqa: E402

from selective_rope.kernels.phase_triton import phase_increment_triton  # noqa: E402
from selective_rope.modeling.layout import valid_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Small ranks: the interpreter runs each rank's step of every program in Python.
OPTIONS = {
    "default": dict(phase_proj_rank=5),  # the per-head gate, a 4-tap convolution
    "bias-silu": dict(phase_bias=True, phase_conv_activation="silu", phase_proj_rank=3),
    "no-conv": dict(phase_conv_size=0, phase_bias=True, phase_proj_rank=4),
    "no-gate": dict(phase_gate=False, phase_conv_size=2, phase_proj_rank=4),
    "partial": dict(partial_rotary_factor=0.5, phase_conv_size=3, phase_proj_rank=4),
}


def kernel_increment(module, x, lengths=None, cu_seqlens=None, conv_state=None):
    conv, gate = module.phase_conv, module.phase_gate_proj
    return phase_increment_triton(
        x, module.phase_proj.down, module.phase_proj.up,
        conv_weight=None if conv is None else conv.taps(x.device), conv_activation=None if conv is None else
        conv.activation, bias=module.phase_bias, gate_weight=None if gate is None else gate.weight,
        gate_bias=None if gate is None else gate.bias, lengths=lengths, cu_seqlens=cu_seqlens, conv_state=conv_state)


def torch_increment(module, x, lengths=None, conv_state=None):
    valid = None if lengths is None else valid_mask(lengths, x.shape[1])
    with torch.no_grad():
        return module.phase_increment(x, valid, conv_state, lengths)


def assert_same_increments(actual, expected):
    """Increments equal after the one rounding to float32, but where the float64 sums (in another order) fell on
    either side of a float32 rounding boundary: one float32 step there; the histories (float64) within rounding."""
    (increment, history), (expected_increment, expected_history) = actual, expected
    assert increment.shape == expected_increment.shape and increment.dtype == expected_increment.dtype == torch.float32
    torch.testing.assert_close(increment, expected_increment, rtol=2 ** -23, atol=1e-12)
    if expected_history is None:
        assert history is None
    else:
        assert history.shape == expected_history.shape and history.dtype == torch.float64
        torch.testing.assert_close(history, expected_history, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", OPTIONS)
def test_the_kernel_computes_the_torch_phase_paths_increments(name):
    heads = (2, 1) if name == "no-conv" else (4, 2)  # (phases per key head: GQA changes nothing here)
    module = make_rotary(*heads, dtype=torch.float32, device=DEVICE, **OPTIONS[name])
    x = torch.randn(2, 19, HIDDEN, device=DEVICE)  # 2 time tiles, the second partial
    assert_same_increments(kernel_increment(module, x), torch_increment(module, x))


def test_padding_adds_nothing_and_strided_rows_are_read_as_they_are():
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_bias=True, phase_proj_rank=4)
    wide = torch.randn(3, 21, HIDDEN + 3, device=DEVICE)
    x = wide[..., 3:]  # rows and tokens strided
    lengths = torch.tensor([21, 5, 0], device=DEVICE)
    actual = kernel_increment(module, x, lengths=lengths)
    assert_same_increments(actual, torch_increment(module, x, lengths))
    increment = actual[0]
    assert not increment[1, 5:].any() and not increment[2].any() and increment[1, :5].all()


@pytest.mark.parametrize("taps", [4, 2])
def test_a_cached_history_is_continued(taps):
    """A prefill after a cache: the window before each row's start reads the cached history, and the new history
    continues it where a row has fewer than K - 1 real tokens (lengths 1 and 0)."""
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_conv_size=taps, phase_bias=True,
                         phase_proj_rank=4)
    x = torch.randn(4, 18, HIDDEN, device=DEVICE)
    lengths = torch.tensor([18, 1, 0, 7], device=DEVICE)
    history = torch.randn(4, taps - 1, module.num_key_heads * module.rotary_pairs, dtype=torch.float64,
                          device=DEVICE)
    actual = kernel_increment(module, x, lengths=lengths, conv_state=history)
    assert_same_increments(actual, torch_increment(module, x, lengths, history))
    assert torch.equal(actual[1][2], history[2])  # no real token: the history as it was


def test_packed_sequences_restart_at_each_boundary():
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_bias=True, phase_conv_activation="silu",
                         phase_proj_rank=4)
    bounds = [0, 5, 6, 22, 29]
    x = torch.randn(1, bounds[-1], HIDDEN, device=DEVICE)
    history = torch.randn(len(bounds) - 1, 3, module.num_key_heads * module.rotary_pairs, dtype=torch.float64,
                          device=DEVICE)
    actual = kernel_increment(module, x, cu_seqlens=torch.tensor(bounds, device=DEVICE), conv_state=history)
    pieces = [torch_increment(module, x[:, start:end], conv_state=history[i:i + 1])
              for i, (start, end) in enumerate(zip(bounds, bounds[1:]))]
    expected = torch.cat([piece[0] for piece in pieces], 1), torch.cat([piece[1] for piece in pieces])
    assert_same_increments(actual, expected)


def test_bad_arguments_are_refused_by_name():
    module = make_rotary(dtype=torch.float32, device=DEVICE)
    x = torch.randn(2, 4, HIDDEN, device=DEVICE)
    with pytest.raises(ValueError, match="disagree"):
        phase_increment_triton(x[..., 1:], module.phase_proj.down, module.phase_proj.up)
    with pytest.raises(ValueError, match="activation"):
        phase_increment_triton(x, module.phase_proj.down, module.phase_proj.up, conv_activation="gelu")
    with pytest.raises(ValueError, match="cu_seqlens needs batch 1"):
        phase_increment_triton(x, module.phase_proj.down, module.phase_proj.up, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="conv_state"):
        phase_increment_triton(x, module.phase_proj.down, module.phase_proj.up, conv_weight=module.phase_conv.taps(
            x.device), conv_state=torch.zeros(2, 2, 8, dtype=torch.float64))
