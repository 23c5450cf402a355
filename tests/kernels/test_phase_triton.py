"""``kernels/phase_triton.py`` (run on CPU by Triton's interpreter) against the rotary module's torch phase path,
``SelectiveRotaryEmbedding.phase_increment``: the default phase path's increments and the convolution's new history,
from a sequence start or a cached history, with its options, padding and packed sequences; and the backward's
gradients against autograd through that path and against finite differences (issue 46, item 1; no model calls them
yet)."""

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the Triton phase kernel cannot be tested")

from selective_rope import SelectiveRopeGLAConfig  # noqa: E402
from selective_rope.kernels import phase_triton  # noqa: E402
from selective_rope.kernels.backends import interpreting  # noqa: E402
from selective_rope.kernels.phase_triton import phase_increment_backward_triton, phase_increment_triton  # noqa: E402
from selective_rope.modeling.layout import valid_mask  # noqa: E402
from selective_rope.modeling.rotary import SelectiveRotaryEmbedding  # noqa: E402

from rotary_reference import HIDDEN, make_rotary  # noqa: E402

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


@pytest.mark.parametrize("taps", [4, 2, 20])
def test_a_cached_history_is_continued(taps):
    """A prefill after a cache: the window before each row's start reads the cached history, and the new history
    continues it where a row has fewer than K - 1 real tokens (lengths 1 and 0). 20 taps: a window wider than the
    kernel's 16-token tile."""
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


# --------------------------------------------------------------------------------------------------------------------
# the backward
# --------------------------------------------------------------------------------------------------------------------
GRADIENTS = ("x", "down", "up", "conv taps", "bias", "gate weight", "gate bias")
BACKWARD_OPTIONS = {
    **OPTIONS,
    "difference-silu": dict(phase_conv_type="difference", phase_conv_activation="silu", phase_bias=True,
                            phase_proj_rank=3),  # the fixed taps (-1, 1)
    "one-tap": dict(phase_conv_size=1, phase_gate=False, phase_proj_rank=2),  # no halo
}


def kernel_weights(module, device):
    conv, gate = module.phase_conv, module.phase_gate_proj
    return dict(conv_weight=None if conv is None else conv.taps(device),
                conv_activation=None if conv is None else conv.activation, bias=module.phase_bias,
                gate_weight=None if gate is None else gate.weight, gate_bias=None if gate is None else gate.bias)


def kernel_gradients(module, grad, x, lengths=None, cu_seqlens=None, conv_state=None):
    return phase_increment_backward_triton(grad, x, module.phase_proj.down, module.phase_proj.up,
                                           **kernel_weights(module, x.device), lengths=lengths, cu_seqlens=cu_seqlens,
                                           conv_state=conv_state)


def torch_gradients(module, grad, x, lengths=None, cu_seqlens=None, conv_state=None):
    """Autograd through the torch phase path: the gradients in ``GRADIENTS``' order, ``None`` for an input the module
    lacks (the difference's taps are no parameter), the taps' as ``(C, K)``."""
    x = x.detach().requires_grad_()
    conv, gate = module.phase_conv, module.phase_gate_proj
    inputs = [x, module.phase_proj.down, module.phase_proj.up, getattr(conv, "weight", None), module.phase_bias,
              None if gate is None else gate.weight, None if gate is None else gate.bias]
    increment, _ = module.sequence_increment(x, lengths, conv_state, cu_seqlens)
    grads = iter(torch.autograd.grad(increment, [t for t in inputs if t is not None], grad))
    expected = [None if t is None else next(grads) for t in inputs]
    if expected[3] is not None:
        expected[3] = expected[3].squeeze(1)  # (C, 1, K) -> (C, K), as the kernel takes the taps
    return expected


def assert_same_gradients(actual, expected, rounded=False):
    """Every gradient the module has equal to autograd's, in its dtype and shape.

    Float64 inputs and weights (``rounded=False``): both sum float64 products in other orders (the kernel's matrix
    products block them), so they agree to float64 rounding over sums of O(100) terms of order 1, far below 1e-10,
    while a wrong or missing term moves a gradient by orders of magnitude more. Float32 weights and bf16 or float32
    x (``rounded=True``): both compute in float64 and round once to the gradient's dtype, so each element is the
    same or, where the float64 sums straddle a rounding boundary (rare: at most 1 % of the elements here), one step
    of that dtype apart. (Triton's interpreter truncates float32 to bf16 instead of rounding it: there, bf16 dx is
    only within one step.)"""
    assert len(actual) == len(GRADIENTS)
    for name, got, want in zip(GRADIENTS, actual, expected):
        if want is None:  # absent (or the difference's fixed taps: the caller drops their gradient)
            assert got is None or name == "conv taps", name
            continue
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, got.dtype, want.dtype)
        rtol, atol = (torch.finfo(got.dtype).eps, 0.0) if rounded else (1e-10, 1e-13)  # eps |v|: one step at v
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"{name} differs")
        if rounded and not (interpreting() and got.dtype == torch.bfloat16):
            assert (got != want).float().mean() <= 0.01, name


@pytest.mark.parametrize("name", BACKWARD_OPTIONS)
def test_the_backward_gives_the_torch_phase_paths_gradients(name):
    """40 tokens: two tiles of the backward (26 tokens each with 4 taps), so tiles read each other's tokens."""
    module = make_rotary(dtype=torch.float64, device=DEVICE, **BACKWARD_OPTIONS[name])
    x = torch.randn(2, 40, HIDDEN, dtype=torch.float64, device=DEVICE)
    grad = torch.randn(2, 40, module.num_key_heads, module.rotary_pairs, device=DEVICE)  # float32, as autograd's
    assert_same_gradients(kernel_gradients(module, grad, x), torch_gradients(module, grad, x))


def test_the_backward_reads_the_convolution_window_across_its_tiles():
    """Gradient only on the first tokens of the second tile: their convolution windows reach back into the first
    tile, so dx there comes from the second tile's dz (the halo after a tile) and their z from the first tile's
    projections (the halo before it). Without either, dx before the boundary would be zero or wrong."""
    module = make_rotary(dtype=torch.float64, device=DEVICE, phase_conv_activation="silu", phase_proj_rank=4)
    taps = module.phase_conv.weight.shape[-1]
    boundary = phase_triton._BACKWARD_BLOCK_T - 2 * (taps - 1)  # the first token of the second tile
    x = torch.randn(1, 2 * boundary, HIDDEN, dtype=torch.float64, device=DEVICE)
    grad = torch.zeros(1, 2 * boundary, module.num_key_heads, module.rotary_pairs, device=DEVICE)
    grad[:, boundary:boundary + taps - 1] = torch.randn_like(grad[:, :taps - 1])
    actual = kernel_gradients(module, grad, x)
    assert_same_gradients(actual, torch_gradients(module, grad, x))
    assert actual[0][0, boundary - taps + 1:boundary].abs().amin() > 0  # (not vacuous)


def test_the_backward_rounds_once_into_bf16_x_and_float32_weights():
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_bias=True, phase_conv_activation="silu",
                         phase_proj_rank=5)
    x = torch.randn(2, 40, HIDDEN, device=DEVICE).bfloat16()
    grad = torch.randn(2, 40, module.num_key_heads, module.rotary_pairs, device=DEVICE)
    actual = kernel_gradients(module, grad, x)
    assert actual[0].dtype == torch.bfloat16 and actual[1].dtype == torch.float32
    assert_same_gradients(actual, torch_gradients(module, grad, x), rounded=True)


def test_the_backward_ignores_padding_and_continues_a_cached_history():
    """Right-padded rows (a full row, rows shorter than the window and than a tile, an empty one), strided rows,
    float32 weights, a cached history before each row: padding gets no gradient and gives none, whatever its
    incoming gradient."""
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_bias=True, phase_proj_rank=4)
    wide = torch.randn(4, 33, HIDDEN + 3, device=DEVICE)
    x = wide[..., 3:]
    lengths = torch.tensor([33, 2, 0, 29], device=DEVICE)
    history = torch.randn(4, 3, module.num_key_heads * module.rotary_pairs, dtype=torch.float64, device=DEVICE)
    grad = torch.randn(4, 33, module.num_key_heads, module.rotary_pairs, device=DEVICE)
    actual = kernel_gradients(module, grad, x, lengths=lengths, conv_state=history)
    assert_same_gradients(actual, torch_gradients(module, grad, x, lengths, conv_state=history), rounded=True)
    dx = actual[0]
    assert not dx[1, 2:].any() and not dx[2].any() and not dx[3, 29:].any() and dx[3, :29].all()


def test_the_backward_restarts_the_convolution_at_packed_boundaries():
    """Packed sequences of 1 token (shorter than the window), 5, 40 (two tiles) and 3, each after its own cached
    history: no gradient flows across a boundary."""
    module = make_rotary(dtype=torch.float64, device=DEVICE, phase_bias=True, phase_conv_activation="silu",
                         phase_proj_rank=4)
    bounds = torch.tensor([0, 1, 6, 46, 49], device=DEVICE)
    x = torch.randn(1, 49, HIDDEN, dtype=torch.float64, device=DEVICE)
    history = torch.randn(4, 3, module.num_key_heads * module.rotary_pairs, dtype=torch.float64, device=DEVICE)
    grad = torch.randn(1, 49, module.num_key_heads, module.rotary_pairs, device=DEVICE)
    actual = kernel_gradients(module, grad, x, cu_seqlens=bounds, conv_state=history)
    assert_same_gradients(actual, torch_gradients(module, grad, x, cu_seqlens=bounds, conv_state=history))


def unrounded_increment(x, down, up, taps, bias, gate_weight, gate_bias, lengths):
    """The default phase path written out from its formula (SPEC §3), in float64 and not rounded: finite
    differences need a smooth function, and this one shares no code with the module."""
    batch, seq_len, _ = x.shape
    heads, _, chunk = down.shape
    pairs, kernel_size = up.shape[1], taps.shape[-1]
    valid = (torch.arange(seq_len, device=x.device) < lengths[:, None])[..., None, None]  # (B, T, 1, 1)
    u = F.normalize(x.view(batch, seq_len, heads, chunk), dim=-1)
    a = torch.einsum("bthd,hkd,hrk->bthr", u, down, up) * valid
    window = F.pad(a, (0, 0, 0, 0, kernel_size - 1, 0))  # zeros before the start
    z = sum(window[:, j:j + seq_len] * taps.view(heads, pairs, kernel_size)[..., j] for j in range(kernel_size))
    gate = torch.sigmoid(torch.einsum("btd,hd->bth", u.flatten(2), gate_weight) + gate_bias)
    return (F.silu(z) + bias.exp()) * gate[..., None] * valid


def test_the_backward_agrees_with_finite_differences():
    """``torch.autograd.gradcheck`` (fast mode: random projections of the Jacobians) of the kernel's backward against
    central differences of ``unrounded_increment``, every input at once."""
    lengths = torch.tensor([7, 4], device=DEVICE)

    class KernelBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.save_for_backward(*inputs)
            return unrounded_increment(*inputs, lengths)

        @staticmethod
        def backward(ctx, grad):
            x, down, up, taps, bias, gate_weight, gate_bias = ctx.saved_tensors
            return phase_increment_backward_triton(grad, x, down, up, taps, "silu", bias, gate_weight, gate_bias,
                                                   lengths)

    heads, rank, chunk, pairs = 2, 3, HIDDEN // 2, 4
    shapes = [(2, 7, HIDDEN), (heads, rank, chunk), (heads, pairs, rank), (heads * pairs, 3), (heads, pairs),
              (heads, HIDDEN), (heads,)]
    inputs = [torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True) for shape in shapes]
    assert torch.autograd.gradcheck(KernelBackward.apply, inputs, fast_mode=True, nondet_tol=1e-12)


def test_the_backward_walks_wide_chunks_and_many_channels_in_blocks(monkeypatch):
    """The backward walks each input chunk ``_BACKWARD_BLOCK_D`` dims and each head's channels ``_BACKWARD_BLOCK_R``
    at a time (a whole (32, Dc) float64 tile per chunk spills on a GPU). With both at 16, Dc = 40 and R = 20, the walks
    take three and two steps, the last ones partly past the chunk: every gradient equals autograd's through
    ``unrounded_increment`` (float64, within rounding of sums in another order). A norm or u·du summed over one step,
    a step skipped or a masked tail read fails it."""
    monkeypatch.setattr(phase_triton, "_BACKWARD_BLOCK_D", 16)
    monkeypatch.setattr(phase_triton, "_BACKWARD_BLOCK_R", 16)
    heads, rank, chunk, pairs, taps = 2, 3, 40, 20, 3
    lengths = torch.tensor([30, 17], device=DEVICE)  # 30 tokens: two tiles of the backward
    shapes = [(2, 30, heads * chunk), (heads, rank, chunk), (heads, pairs, rank), (heads * pairs, taps), (heads, pairs),
              (heads, heads * chunk), (heads,)]
    inputs = [torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True) for shape in shapes]
    grad = torch.randn(2, 30, heads, pairs, dtype=torch.float64, device=DEVICE)
    expected = torch.autograd.grad(unrounded_increment(*inputs, lengths), inputs, grad)
    x, down, up, conv_weight, bias, gate_weight, gate_bias = (t.detach() for t in inputs)
    actual = phase_increment_backward_triton(grad, x, down, up, conv_weight, "silu", bias, gate_weight, gate_bias,
                                             lengths)
    for name, got, want in zip(GRADIENTS, actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13, msg=f"{name} differs")


def test_the_backward_refuses_bad_arguments_by_name():
    module = make_rotary(dtype=torch.float32, device=DEVICE)
    x = torch.randn(2, 4, HIDDEN, device=DEVICE)
    grad = torch.zeros(2, 4, module.num_key_heads, module.rotary_pairs, device=DEVICE)
    with pytest.raises(ValueError, match="grad_increment"):
        kernel_gradients(module, grad[..., 1:], x)
    with pytest.raises(ValueError, match="disagree"):
        kernel_gradients(module, grad, x[..., 1:])
    with pytest.raises(ValueError, match="conv_state"):
        kernel_gradients(module, grad, x, conv_state=torch.zeros(2, 2, 8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens needs batch 1"):
        kernel_gradients(module, grad, x, cu_seqlens=torch.tensor([0, 4], device=DEVICE))


def test_the_backward_is_one_launch_and_its_outputs_allocations(monkeypatch):
    """Issue 46, item 3 (forward + backward of a layer's Selective RoPE in at most 4 launches and no other aten op):
    the phase path's backward takes one launch, and its only aten ops allocate dx, the six weight gradients and the
    zeroed float64 buffer of the atomics (counted with the launch stubbed, by ``host_time_cpu``'s counter)."""
    spec = importlib.util.spec_from_file_location(
        "host_time_cpu", Path(__file__).resolve().parents[2] / "benchmarks" / "host_time_cpu.py")
    host_time_cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_time_cpu)
    launches = Counter()

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.update(["backward"])

    monkeypatch.setattr(phase_triton, "_phase_increment_bwd_kernel", Stub())
    module = make_rotary(dtype=torch.float32, phase_bias=True)
    x = torch.randn(2, 40, HIDDEN)
    grad = torch.randn(2, 40, module.num_key_heads, module.rotary_pairs)
    lengths = torch.tensor([40, 7])
    weights = kernel_weights(module, x.device)  # (the taps' view of the convolution weight is the caller's op)
    ops = host_time_cpu.top_level_ops(lambda: phase_increment_backward_triton(
        grad, x, module.phase_proj.down, module.phase_proj.up, **weights, lengths=lengths))
    assert launches == {"backward": 1}
    assert ops == {"aten::empty": 7, "aten::zeros": 1}


def wide_rotary(hidden: int, **options):
    """``make_rotary``'s module over ``hidden`` inputs: 2 key heads of ``hidden / 2`` dims each (the chunk each head
    normalises), float64, on ``DEVICE``."""
    config = SelectiveRopeGLAConfig(hidden_size=hidden, num_heads=2, num_kv_heads=2, expand_k=16 / hidden, **options)
    module = SelectiveRotaryEmbedding(config, 2, 2, 8).to(device=DEVICE, dtype=torch.float64)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name != "temperature":
                param.add_(0.3 * torch.randn_like(param))
    return module


@pytest.mark.parametrize("name", ["default", "bias-silu"])
def test_chunks_wider_than_one_step_of_the_walk(name):
    """Chunks of 100 dims: the kernels walk each chunk 64 dims at a time (a full step and a partial one), the norm,
    the projection and the gate's logit summed over the steps, forward and backward (the other tests' chunks fit
    in one step)."""
    module = wide_rotary(200, **OPTIONS[name])
    assert module.phase_proj.down.shape[-1] == 100
    x = torch.randn(2, 19, 200, dtype=torch.float64, device=DEVICE)
    lengths = torch.tensor([19, 11], device=DEVICE)
    assert_same_increments(kernel_increment(module, x, lengths=lengths), torch_increment(module, x, lengths))
    grad = torch.randn(2, 19, module.num_key_heads, module.rotary_pairs, device=DEVICE)
    assert_same_gradients(kernel_gradients(module, grad, x, lengths=lengths),
                          torch_gradients(module, grad, x, lengths=lengths))
