"""The Triton Selective RoPE kernels (run on CPU by Triton's interpreter) against the PyTorch reference.

Prefill op (forward and backward), the fused decode step, the torch.library registration (opcheck, fake shapes,
torch.compile without graph breaks) and the rotary module with ``backend="triton"`` against ``backend="torch"``.
With a GPU the same tests run on CUDA tensors.
"""

import contextlib

import pytest
import torch

# Without a GPU, conftest.py has set TRITON_INTERPRET=1 (before triton was imported): the kernels run on CPU.
pytest.importorskip("triton", reason="triton is not installed: the Triton rotary kernel cannot be tested")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from selective_rope.kernels import rotary_triton  # noqa: E402
from selective_rope.kernels.conv_torch import causal_conv1d  # noqa: E402
from selective_rope.kernels.rotary_torch import selective_rotary  # noqa: E402

from rotary_reference import HIDDEN, make_rotary, rotate_exactly  # noqa: E402

selective_rotary_triton = rotary_triton.selective_rotary_triton
selective_rotary_decode_triton = rotary_triton.selective_rotary_decode_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _device():
    with torch.device(DEVICE):  # factory functions (randn, zeros, tensor, ...) create tensors there
        yield


def make_inputs(batch, seq_len, hq, hk, head_dim, half, dtype=torch.float32, init=True, increment_shape=None,
                temperature_grad=True):
    q = torch.randn(batch, seq_len, hq, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seq_len, hk, head_dim, dtype=dtype, requires_grad=True)
    shape = increment_shape or (batch, seq_len, hk, half)
    increment = (0.5 * torch.randn(*shape)).requires_grad_()
    temperature = (0.5 + torch.rand(half)).requires_grad_(temperature_grad)
    phase0 = torch.randn(batch, hk, half, requires_grad=True) if init else None
    return q, k, increment, temperature, phase0


def grads(outputs, weights, inputs):
    loss = sum((out.float() * w).sum() for out, w in zip(outputs, weights))
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    return torch.autograd.grad(loss, wanted)


def assert_close(actual, expected, name, rtol=1e-4, atol=1e-4):
    scale = max(expected.float().abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale,
                               msg=lambda message: f"{name}: {message}")


def check(batch, seq_len, hq, hk, head_dim, half, dtype=torch.float32, init=True, increment_shape=None,
          temperature_grad=True):
    inputs = make_inputs(batch, seq_len, hq, hk, head_dim, half, dtype, init, increment_shape, temperature_grad)
    expected = selective_rotary(*inputs)
    actual = selective_rotary_triton(*inputs)
    for name, a, e in zip(("q", "k", "final_phase"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        if a.dtype == torch.bfloat16:  # same float32 math, rounded once: at most one bf16 step apart
            assert_close(a, e, name, rtol=1e-2, atol=1e-2)
        else:
            assert_close(a, e, name, rtol=1e-5, atol=1e-5)

    weights = [torch.randn(e.shape) for e in expected]  # the final phase's gradient is checked too
    names = [n for n, x in zip(("q", "k", "increment", "temperature", "initial_phase"), inputs)
             if x is not None and x.requires_grad]
    for name, a, e, x in zip(names, grads(actual, weights, inputs), grads(expected, weights, inputs),
                             [x for x in inputs if x is not None and x.requires_grad]):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert_close(a, e, f"d{name}", rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                     atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("seq_len", [1, 7, 33])
@pytest.mark.parametrize("init", [True, False], ids=["init", "no_init"])
def test_odd_lengths(seq_len, init):
    check(2, seq_len, 2, 2, 8, 4, init=init)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gqa(groups):
    check(1, 9, 2 * groups, 2, 8, 4)


@pytest.mark.parametrize("head_dim,half", [(10, 3), (12, 2), (7, 3), (6, 1)])
def test_partial_rotation(head_dim, half):
    check(2, 7, 4, 2, head_dim, half)


def test_long_sequence_spans_several_time_tiles(monkeypatch):
    base = rotary_triton._config
    monkeypatch.setattr(rotary_triton, "_config", lambda r, p: {**base(r, p), "BLOCK_T": 16})  # 70 tokens: 5 tiles
    check(1, 70, 2, 1, 8, 4)


def test_rope_broadcast_increment():
    """RoPE: increment ``(B, T, 1, 1)`` of ones, its gradient reduced back to that shape."""
    check(2, 11, 4, 2, 8, 4, init=False, increment_shape=(2, 11, 1, 1))
    check(1, 5, 2, 2, 6, 3, increment_shape=(1, 5, 2, 1), temperature_grad=False)


def test_rope_matches_positions():
    seq_len, half = 9, 4
    q, k = torch.randn(1, seq_len, 2, 8), torch.randn(1, seq_len, 1, 8)
    tau = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    out_q, out_k, final = selective_rotary_triton(q, k, torch.ones(1, seq_len, 1, 1), tau)
    angle = (torch.arange(1, seq_len + 1, dtype=torch.float32)[:, None] * tau)[None, :, None]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = k[..., :half], k[..., half:]
    torch.testing.assert_close(out_k, torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1))
    torch.testing.assert_close(final, torch.full((1, 1, half), float(seq_len), dtype=torch.float64))


@triton.jit
def _angles_kernel(phase_ptr, temp_ptr, out_ptr, N, R, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    """``rotary_triton._angle`` of a (N, R) float64 phase: what every kernel computes before sin/cos."""
    ns, rs = tl.arange(0, BLOCK), tl.arange(0, BLOCK_R)
    mask_r = rs < R
    mask = (ns < N)[:, None] & mask_r[None, :]
    phase = tl.load(phase_ptr + ns[:, None] * R + rs[None, :], mask=mask, other=0.0)
    turns = rotary_triton._turns_per_phase(temp_ptr, rs, mask_r)
    tl.store(out_ptr + ns[:, None] * R + rs[None, :], rotary_triton._angle(phase, turns[None, :]), mask=mask)


def test_the_kernels_reduce_angles_exactly_as_the_torch_path():
    """The same float32 angle as ``rotary_angles`` for every phase, negative ones and ones of 10^4-10^7 turns too:
    the integer part is taken toward zero, in float64 (a floor instead would move a negative angle by 2π, which the
    rotation tests' tolerances would not see)."""
    from selective_rope.kernels.rotary_torch import rotary_angles

    phase = torch.cat([torch.randn(8, 5) * scale for scale in (1.0, 1e3, 1e5, 1e7)]).double()
    phase[0, 0], phase[1, 1] = 0.0, -0.0
    temperature = torch.tensor([1.0, 0.3, 1e-3, 2.5, 500000.0 ** -0.5])
    out = torch.empty(phase.shape, dtype=torch.float32)
    _angles_kernel[(1,)](phase, temperature, out, phase.shape[0], phase.shape[1], BLOCK=32, BLOCK_R=8)
    expected = rotary_angles(phase, temperature)
    assert (expected < 0).any() and torch.equal(out, expected)


@triton.jit
def _sincos_kernel(angle_ptr, sin_ptr, cos_ptr, N, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    """``rotary_triton._sincos`` of N float32 angles, or (``LIBDEVICE``) ``tl.sin`` and ``tl.cos``."""
    ns = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    angle = tl.load(angle_ptr + ns, mask=ns < N, other=0.0)
    if LIBDEVICE:
        sin, cos = tl.sin(angle), tl.cos(angle)
    else:
        sin, cos = rotary_triton._sincos(angle)
    tl.store(sin_ptr + ns, sin, mask=ns < N)
    tl.store(cos_ptr + ns, cos, mask=ns < N)


def sincos_angles() -> torch.Tensor:
    """Float32 angles over (-2π, 2π] (``_angle``'s range; float32 2π rounds up): a dense grid, the floats either side
    of every multiple of π/4 (where the quadrant and the polynomial change), ±0 and tiny angles."""
    grid = torch.linspace(-6.2831855, 6.2831855, 2**17)
    boundaries = (torch.arange(-8, 9, dtype=torch.float64) * torch.pi / 4).float()
    near, below, above = [boundaries], boundaries, boundaries
    for _ in range(3):
        below, above = torch.nextafter(below, torch.tensor(-10.0)), torch.nextafter(above, torch.tensor(10.0))
        near += [below, above]
    tiny = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-20, 2.0**-126, 3e-4])
    return torch.cat([grid, *near, tiny])


def run_sincos(angles, libdevice=False):
    sin, cos = torch.empty_like(angles), torch.empty_like(angles)
    block = 1024
    _sincos_kernel[(triton.cdiv(angles.numel(), block),)](angles, sin, cos, angles.numel(), LIBDEVICE=libdevice,
                                                           BLOCK=block)
    return sin, cos


def test_sincos_is_float32_sin_and_cos():
    """``_sincos`` (libdevice's sinf/cosf algorithm, one range reduction for both) against float64 sin and cos: a
    relative error below 2^-23 (at most two float32 steps; measured: 0.95 of it, torch's float32 sin 0.54), the sign
    of zero kept (sin(-0) = -0)."""
    angles = sincos_angles()
    sin, cos = run_sincos(angles)
    for name, got, exact in (("sin", sin, angles.double().sin()), ("cos", cos, angles.double().cos())):
        scale = torch.maximum(exact.abs(), torch.tensor(2.0**-126, dtype=torch.float64)) * 2.0**-23
        error = (got.double() - exact).abs() / scale
        assert error.max() <= 1.0, f"{name}: {error.max():.2f} x 2^-23 at angle {angles[error.argmax()].item()!r}"
    assert torch.equal(sin[angles == 0].signbit(), angles[angles == 0].signbit())


@pytest.mark.skipif(DEVICE != "cuda", reason="tl.sin and tl.cos are libdevice's only on a GPU (numpy's here)")
def test_sincos_equals_libdevice_bit_for_bit():
    """On a GPU, ``_sincos`` is what ``tl.sin`` / ``tl.cos`` (libdevice) give, bit for bit, for every angle the
    kernels make (|angle| <= 2π, none subnormal)."""
    angles = sincos_angles()
    angles = angles[(angles == 0) | (angles.abs() >= 2.0**-126)]
    ours, libdevice = run_sincos(angles), run_sincos(angles, libdevice=True)
    for got, expected in zip(ours, libdevice):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_bf16_inputs():
    check(2, 13, 4, 2, 10, 4, dtype=torch.bfloat16)


def test_no_temperature_grad_and_frozen_initial_phase():
    q, k, increment, temperature, phase0 = make_inputs(1, 6, 2, 1, 8, 4, temperature_grad=False)
    phase0.requires_grad_(False)
    out = selective_rotary_triton(q, k, increment, temperature, phase0)
    ref = selective_rotary(q, k, increment, temperature, phase0)
    weights = [torch.randn(r.shape) for r in ref]
    for a, e in zip(grads(out, weights, (q, k, increment)), grads(ref, weights, (q, k, increment))):
        assert_close(a, e, "grad")


def test_several_frequency_and_pass_through_blocks(monkeypatch):
    """Tiny blocks so that R spans 3 frequency programs and the pass-through dims 3 chunks."""
    base = rotary_triton._config
    monkeypatch.setattr(rotary_triton, "_config",
                        lambda r, p: {**base(r, p), "BLOCK_T": 4, "BLOCK_R": 2, "BLOCK_P": 2})
    check(1, 9, 4, 2, 16, 5)


def test_non_contiguous_inputs():
    q = torch.randn(1, 2, 5, 8).transpose(1, 2).requires_grad_()  # (B, T, H, D) view with odd strides
    k = torch.randn(1, 1, 5, 8).permute(0, 2, 1, 3).requires_grad_()
    increment = torch.randn(1, 5, 1, 4)
    tau = torch.rand(4)
    for a, e in zip(selective_rotary_triton(q, k, increment, tau), selective_rotary(q, k, increment, tau)):
        assert_close(a, e, "out", rtol=1e-5, atol=1e-5)


def test_empty_sequence():
    q, k = torch.randn(2, 0, 2, 8), torch.randn(2, 0, 1, 8)
    phase0 = torch.randn(2, 1, 4)
    out_q, out_k, final = selective_rotary_triton(q, k, torch.zeros(2, 0, 1, 4), torch.rand(4), phase0)
    assert out_q.shape == q.shape and out_k.shape == k.shape
    torch.testing.assert_close(final, phase0.double())


def chunk_tiles(monkeypatch, tiles):
    """Time tiles per chunk of the prefill kernels' two-pass scan (``None``: the kernels' own choice)."""
    if tiles is not None:
        monkeypatch.setattr(rotary_triton, "_chunk_tiles", lambda *args: tiles)


@pytest.mark.parametrize("tiles", [1, 2, 4, 1000])
@pytest.mark.parametrize("init", [True, False], ids=["init", "no_init"])
def test_time_chunks_scan_in_parallel(tiles, init, monkeypatch):
    """Long sequences are cut into time chunks that run as separate programs, each starting from the phase the
    chunks before it sum to (pass 1) and, backward, taking the gradient that later chunks send back: any chunking
    gives the reference's outputs and gradients, the final phase's gradient included."""
    chunk_tiles(monkeypatch, tiles)
    seq_len = 70  # 5 tiles of 16 under the interpreter, 2 of 64 on a GPU
    plan = rotary_triton._plan(torch.empty(2, seq_len, 4, 12), 2, 2, 4)
    time_tiles = -(-seq_len // plan.cfg["BLOCK_T"])
    assert plan.grid[2] == -(-time_tiles // tiles)
    check(2, seq_len, 4, 2, 12, 4, init=init)


@pytest.mark.parametrize("batch, seq_len, num_seqs, chunks", [
    (1, 32768, 1, 32),  # one row: 16 programs, cut into 32 chunks of 1024 tokens
    (8, 32768, 8, 5),  # 128 programs: 5 chunks of each row
    (64, 4096, 64, 1),  # 1024 programs fill the device: no chunks
    (1, 32768, 1000, 1),  # a packed row of 1000 short sequences: one chunk each, not 1000 mostly empty ones
    (1, 32768, 8, 40),  # 8 packed sequences: chunks from their mean length (4096 / 5, in 32-token tiles)
])
def test_chunk_plan_fills_the_device_without_empty_grids(batch, seq_len, num_seqs, chunks, monkeypatch):
    """The plan a GPU of 132 multiprocessors gets (16 key heads, R = 64, 32-token tiles): enough programs, and the
    grid stays within a small multiple of the target (4 per multiprocessor) unless the sequences alone exceed it."""
    monkeypatch.setattr(rotary_triton, "_multiprocessors", lambda index: 132)
    tiles = rotary_triton._chunk_tiles(seq_len, num_seqs, num_seqs != batch, num_seqs * 16, 32,
                                       torch.device("cuda", 0))
    grid_chunks = -(-seq_len // (32 * tiles))
    assert grid_chunks == chunks
    assert num_seqs * 16 * grid_chunks <= max(num_seqs * 16, 16 * 4 * 132)


@pytest.mark.parametrize("tiles", [None, 1], ids=["default_chunks", "one_tile_chunks"])
@pytest.mark.parametrize("init", [True, False], ids=["init", "no_init"])
def test_packed_sequences(init, tiles, monkeypatch):
    """cu_seqlens: the phase restarts at each boundary; equal to running each sequence on its own, also when the
    sequences are cut into chunks (chunks past a short sequence's end carry its whole sum to the final phase)."""
    chunk_tiles(monkeypatch, tiles)
    lengths = [5, 1, 17, 0, 8]
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    total, hq, hk, head_dim, half = sum(lengths), 4, 2, 10, 3
    q = torch.randn(1, total, hq, head_dim, requires_grad=True)
    k = torch.randn(1, total, hk, head_dim, requires_grad=True)
    increment = torch.randn(1, total, hk, half, requires_grad=True)
    temperature = torch.rand(half, requires_grad=True)
    phase0 = torch.randn(len(lengths), hk, half, requires_grad=True) if init else None

    actual = selective_rotary_triton(q, k, increment, temperature, phase0, cu_seqlens=offsets)
    pieces = [selective_rotary(q[:, s:e], k[:, s:e], increment[:, s:e], temperature,
                               None if phase0 is None else phase0[i:i + 1])
              for i, (s, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))]
    expected = (torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1),
                torch.cat([p[2] for p in pieces], 0))
    for name, a, e in zip(("q", "k", "final_phase"), actual, expected):
        assert a.shape == e.shape, name
        assert_close(a, e, name, rtol=1e-5, atol=1e-5)
    inputs = (q, k, increment, temperature, phase0)
    weights = [torch.randn(e.shape) for e in expected]
    for a, e in zip(grads(actual, weights, inputs), grads(expected, weights, inputs)):
        assert_close(a, e, "grad")


def test_detects_a_wrong_phase():
    """The comparison is sharp: the reference with a one-token shift of the phase is rejected."""
    q, k, increment, temperature, _ = make_inputs(1, 8, 2, 1, 8, 4, init=False)
    out_k = selective_rotary_triton(q, k, increment, temperature)[1]
    shifted = torch.cat([torch.zeros_like(increment[:, :1]), increment[:, :-1]], 1)
    with pytest.raises(AssertionError):
        assert_close(out_k, selective_rotary(q, k, shifted, temperature)[1], "k")


@pytest.mark.parametrize("seq_len, start", [pytest.param(4096, 2e4, id="4k-from-2e4"),
                                             pytest.param(32768, 0.0, id="32k", marks=pytest.mark.slow)])
def test_long_sequence_keeps_the_phase_exact(seq_len, start, monkeypatch):
    """Increments around +0.7 continuing a phase of ``start`` (θ ends past 2e4, where a float32 phase steps by 2e-3;
    in 64-token tiles, as on a GPU): the final phase is the exact float64 sum (float64 carry across tiles), and q and
    k are rotated by the exact angles (reduced mod 2π in float64). Then a decoding step continues exactly."""
    base = rotary_triton._config
    monkeypatch.setattr(rotary_triton, "_config", lambda r, p: {**base(r, p), "BLOCK_T": 64})
    half = 4
    q, k = torch.randn(1, seq_len, 2, 8), torch.randn(1, seq_len, 1, 8)
    increment = 0.7 + 0.5 * torch.randn(1, seq_len, 1, half)
    tau = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)  # τ_0 = 1
    phase0 = start + torch.rand(1, 1, half, dtype=torch.float64)
    out_q, out_k, final = selective_rotary_triton(q, k, increment, tau, phase0)
    phase = phase0[:, None] + increment.double().cumsum(1)
    assert final.dtype == torch.float64 and final.min() > 2e4
    torch.testing.assert_close(final, phase[:, -1], rtol=1e-13, atol=0)
    torch.testing.assert_close(out_k.double(), rotate_exactly(k, phase, tau), rtol=0, atol=1e-5)
    torch.testing.assert_close(out_q.double(), rotate_exactly(q, phase.expand(1, seq_len, 2, half), tau), rtol=0,
                               atol=1e-5)

    inputs = decode_inputs(batch=1, hq=2, hk=1, head_dim=8, half=half, padded=False)
    inputs.update(temperature=tau, phase=final, q=q[:, -1], k=k[:, -1])
    q_step, k_step, new_phase, _ = check_decode(inputs)  # the torch path gives the same
    increment_step = (new_phase - final).float()  # the step's float32 increment, added in float64
    torch.testing.assert_close(new_phase, final + increment_step.double(), rtol=0, atol=0)
    torch.testing.assert_close(k_step.double(), rotate_exactly(k[:, -1:], new_phase[:, None], tau)[:, 0], rtol=0,
                               atol=1e-5)


@pytest.mark.slow
def test_larger_shapes():
    check(2, 300, 8, 2, 64, 16)
    check(1, 257, 4, 4, 128, 64, dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------------
# the fused decode step
# --------------------------------------------------------------------------------------------------------------------
def decode_reference(q, k, projection, temperature, phase=None, conv_state=None, conv_weight=None,
                     conv_activation=None, bias=None, gate_logits=None, valid=None):
    """The torch path of ``SelectiveRotaryEmbedding`` for one token (``phase_increment`` + ``selective_rotary``):
    steps 3-5 in float64, the increment rounded to float32."""
    batch, num_key_heads, half = projection.shape
    keep = None if valid is None else valid.double()[:, None, None]  # (B, 1, 1)
    projection = projection.double()
    a = projection if keep is None else projection * keep
    new_conv = None
    if conv_weight is not None:
        lengths = None if valid is None else valid.long()
        flat, new_conv = causal_conv1d(a.reshape(batch, 1, -1), conv_weight, conv_state, lengths, conv_activation)
        a = flat.view(batch, num_key_heads, half)
    if bias is not None:
        a = a + bias.double().exp()
    if gate_logits is not None:
        a = a * torch.sigmoid(gate_logits.double())
    if keep is not None:
        a = a * keep
    q_out, k_out, new_phase = selective_rotary(q[:, None], k[:, None], a.float()[:, None], temperature, phase)
    return q_out[:, 0], k_out[:, 0], new_phase, new_conv


def decode_inputs(batch=3, hq=4, hk=2, head_dim=10, half=4, conv_size=4, bias=True, gate="head", padded=True,
                  state=True, dtype=torch.float32):
    channels = hk * half
    return dict(
        q=torch.randn(batch, hq, head_dim, dtype=dtype), k=torch.randn(batch, hk, head_dim, dtype=dtype),
        projection=torch.randn(batch, hk, half, dtype=torch.float64), temperature=0.5 + torch.rand(half),
        phase=10 * torch.randn(batch, hk, half, dtype=torch.float64) if state else None,
        conv_state=torch.randn(batch, conv_size - 1, channels, dtype=torch.float64) if conv_size and state else None,
        conv_weight=torch.randn(channels, conv_size) if conv_size else None,
        bias=0.3 * torch.randn(hk, half) if bias else None,
        gate_logits={"head": torch.randn(batch, hk, 1, dtype=torch.float64),
                     "channel": torch.randn(batch, hk, half, dtype=torch.float64), None: None}[gate],
        valid=torch.tensor([True, False, True][:batch] + [True] * max(0, batch - 3)) if padded else None,
    )


def check_decode(inputs, conv_activation=None, tol=1e-5):
    actual = selective_rotary_decode_triton(**inputs, conv_activation=conv_activation)
    expected = decode_reference(**inputs, conv_activation=conv_activation)
    for name, a, e in zip(("q", "k", "phase", "conv_state"), actual, expected):
        if e is None:
            assert a is None, name
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert_close(a, e, name, rtol=tol, atol=tol)
    return actual


DECODE_CASES = [
    dict(),
    dict(conv_size=0),
    dict(conv_size=2, gate="channel"),
    dict(conv_size=1, bias=False, gate=None),
    dict(hq=6, hk=3, head_dim=8, half=4),  # GQA 2, no pass-through dims
    dict(hq=2, hk=2, head_dim=13, half=3),  # odd head size, partial rotation
    dict(padded=False, state=False),  # a sequence start: zero phase and history
    dict(batch=5, half=5, head_dim=12, gate="channel", bias=False),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: option_id(c))
@pytest.mark.parametrize("activation", [None, "silu"], ids=["linear", "silu"])
def test_decode_step_matches_torch_path(case, activation):
    check_decode(decode_inputs(**case), conv_activation=activation)


def test_decode_padding_row_keeps_its_state():
    """A row whose token is padding: phase and convolution history unchanged, q/k rotated by the old phase."""
    inputs = decode_inputs(batch=3, padded=True)
    _, k_out, phase, history = check_decode(inputs)
    torch.testing.assert_close(phase[1], inputs["phase"][1], rtol=0, atol=0)
    torch.testing.assert_close(history[1], inputs["conv_state"][1], rtol=0, atol=0)
    assert not torch.equal(phase[0], inputs["phase"][0])  # real rows do move


def test_decode_scalar_projection_with_zero_strides():
    """The ``scalar`` projection gives one value per head, expanded over the frequencies (stride 0)."""
    inputs = decode_inputs()
    inputs["projection"] = torch.randn(3, 2, 1, dtype=torch.float64).expand(3, 2, 4)
    check_decode(inputs)


def test_decode_bf16_and_strided_inputs():
    inputs = decode_inputs(dtype=torch.bfloat16)
    inputs["q"] = torch.randn(4, 3, 10, dtype=torch.bfloat16).transpose(0, 1)  # (B=3, Hq=4, D) with odd strides
    check_decode(inputs, tol=1e-2)


def test_decode_detects_gate_before_convolution():
    """The sharp check: gating before the convolution (the public code's decode bug) is rejected."""
    inputs = decode_inputs(bias=False, padded=False)
    _, _, phase, _ = selective_rotary_decode_triton(**inputs)
    wrong = dict(inputs, projection=inputs["projection"] * torch.sigmoid(inputs["gate_logits"]), gate_logits=None)
    with pytest.raises(AssertionError):
        assert_close(phase, decode_reference(**wrong)[2], "phase")


# --------------------------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------------------------
def test_opcheck_forward_and_backward():
    q, k, increment, temperature, phase0 = make_inputs(2, 3, 2, 1, 6, 2)
    torch.library.opcheck(torch.ops.selective_rope.rotary_forward.default, (q, k, increment, temperature, phase0, None))
    offsets = torch.tensor([0, 1, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.selective_rope.rotary_forward.default,
                          (q[:1], k[:1], increment[:1], temperature, None, offsets),
                          test_utils=("test_schema", "test_faketensor"))
    grads = (torch.randn(q.shape), torch.randn(k.shape), torch.randn(phase0.shape))
    torch.library.opcheck(torch.ops.selective_rope.rotary_backward.default,
                          (q.detach(), k.detach(), *grads, increment.detach(), temperature.detach(), phase0.detach(),
                           None, True))


class _LaunchRecorder:
    """Stands in for a Triton kernel: records the dtype of one argument of each launch, named ``argument`` (when
    ``flag`` is set), then launches the kernel."""

    def __init__(self, kernel, name, argument, flag, seen):
        self.kernel, self.name, self.flag, self.seen = kernel, name, flag, seen
        self.index = kernel.arg_names.index(argument)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs[self.flag]:
                self.seen.append((self.name, args[self.index].dtype))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("several_chunks", [False, True])
def test_the_op_widens_a_float32_initial_phase(monkeypatch, several_chunks):
    """The op called directly with a float32 initial phase (as opcheck calls it): every kernel reads the phase as
    float64 (on a GPU Triton refuses to compile a float32 carry in the float64 scan, which the interpreter does not
    check; seen on an H200) and the outputs and gradients equal those from the same phase in float64."""
    # 40 tokens: in one chunk (the carry is the initial phase itself), or in chunks of one 16-token tile (3 chunks:
    # pass 1 reads the initial phase)
    base = rotary_triton._config
    monkeypatch.setattr(rotary_triton, "_config", lambda r, p: {**base(r, p), "BLOCK_T": 16})
    monkeypatch.setattr(rotary_triton, "_chunk_tiles", lambda *args: 1 if several_chunks else 3)
    seen = []
    for name, argument, flag in (("_chunk_totals_kernel", "init_ptr", "HAS_INIT"),
                                 ("_selective_rotary_fwd_kernel", "carry_ptr", "HAS_CARRY"),
                                 ("_selective_rotary_bwd_kernel", "carry_ptr", "HAS_CARRY")):
        monkeypatch.setattr(rotary_triton, name, _LaunchRecorder(getattr(rotary_triton, name), name, argument, flag,
                                                                 seen))
    q, k, increment, temperature, phase0 = make_inputs(1, 40, 2, 1, 8, 3)
    weights = [torch.randn(q.shape), torch.randn(k.shape), torch.randn(phase0.shape)]
    results = []
    for initial_phase in (phase0, phase0.double()):
        outputs = torch.ops.selective_rope.rotary_forward(q, k, increment, temperature, initial_phase, None)
        results.append((outputs, grads(outputs, weights, (q, k, increment, temperature, phase0))))
    for actual, expected in zip(*(torch.utils._pytree.tree_leaves(r) for r in results)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    launched = {name for name, _ in seen}
    assert launched == ({"_chunk_totals_kernel"} if several_chunks else set()) | {
        "_selective_rotary_fwd_kernel", "_selective_rotary_bwd_kernel"}
    assert all(dtype == torch.float64 for _, dtype in seen), seen


def test_opcheck_decode():
    inputs = decode_inputs()
    args = (inputs["q"], inputs["k"], inputs["projection"], inputs["temperature"], inputs["phase"],
            inputs["conv_state"], inputs["conv_weight"], inputs["bias"], inputs["gate_logits"].expand(3, 2, 4),
            inputs["valid"].int(), True)
    torch.library.opcheck(torch.ops.selective_rope.rotary_decode.default, args)


def test_fake_implementations_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, increment, temperature, phase0 = (x.detach() for x in make_inputs(1, 7, 6, 2, 12, 5))
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    decode = decode_inputs(batch=2, hq=6, hk=3, head_dim=12, half=5, conv_size=3)
    real = (selective_rotary_triton(q, k, increment, temperature, phase0[:1].expand(3, 2, 5), cu_seqlens=offsets),
            selective_rotary_decode_triton(**decode))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_in = [mode.from_tensor(x) for x in (q, k, increment, temperature)]
        fake = (selective_rotary_triton(*fake_in, mode.from_tensor(phase0[:1].expand(3, 2, 5)),
                                        cu_seqlens=mode.from_tensor(offsets)),
                selective_rotary_decode_triton(**{n: None if x is None else mode.from_tensor(x)
                                                  for n, x in decode.items()}))
    for real_out, fake_out in zip(real, fake):
        for r, f in zip(real_out, fake_out):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_eager_inference_calls_the_functions_and_modes_see_the_custom_ops(monkeypatch):
    """Plain eager calls with nothing to differentiate skip the custom ops' dispatch layers (host time a decoding step
    pays); under a dispatch mode (here a recorder; fake tensors, flop counters alike) the custom ops run, so the mode
    sees one opaque call, and the results are the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    decode = decode_inputs()
    prefill = [x.detach() for x in make_inputs(1, 5, 2, 1, 8, 4)]
    with Recorder() as recorder:
        seen = (selective_rotary_decode_triton(**decode), selective_rotary_triton(*prefill))
    assert "selective_rope.rotary_decode.default" in recorder.ops
    assert "selective_rope.rotary_forward.default" in recorder.ops

    def refuse(*args, **kwargs):
        raise AssertionError("an eager inference call went through the custom op")

    monkeypatch.setattr(rotary_triton, "_rotary_decode", refuse)
    monkeypatch.setattr(rotary_triton, "_rotary_forward", refuse)
    direct = (selective_rotary_decode_triton(**decode), selective_rotary_triton(*prefill))
    for a, b in zip((*seen[0], *seen[1]), (*direct[0], *direct[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # training calls too (test_eager_training_calls_equal_the_custom_op)
    selective_rotary_triton(prefill[0].requires_grad_(), *prefill[1:])[0].sum().backward()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_eager_training_calls_equal_the_custom_op(packed):
    """Plain eager calls with gradients run the op's functions through an autograd.Function without the custom ops'
    dispatch layers: the same outputs and gradients (q, k, increment, temperature, initial phase) bit for bit, and
    the same refusal of a second derivative."""
    q, k, increment, temperature, phase0 = make_inputs(1, 40, 4, 2, 12, 4)
    cu_seqlens = torch.tensor([0, 15, 40], dtype=torch.int32) if packed else None
    phase0 = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True) if packed else phase0.double()
    inputs = (q, k, increment, temperature, phase0)
    weights = [torch.randn_like(x, dtype=torch.float32) for x in (q, k)] + [torch.randn(phase0.shape,
                                                                                       dtype=torch.float64)]
    eager = selective_rotary_triton(*inputs, cu_seqlens=cu_seqlens)
    assert type(eager[0].grad_fn).__name__ == "_EagerRotaryBackward"
    op = rotary_triton._rotary_forward(q, k, increment, temperature, phase0, cu_seqlens)
    for a, b in zip(eager, op):
        assert torch.equal(a, b)
    for a, b in zip(grads(eager, weights, inputs), grads(op, weights, inputs)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for outputs in (selective_rotary_triton(*inputs, cu_seqlens=cu_seqlens),
                    rotary_triton._rotary_forward(q, k, increment, temperature, phase0, cu_seqlens)):
        loss = (outputs[0].float() * weights[0]).sum()
        first = torch.autograd.grad(loss, increment, create_graph=True)[0]
        with pytest.raises(RuntimeError, match="no autograd formula"):
            torch.autograd.grad(first.sum(), increment)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning",
                            "ignore:.*torch.jit.trace. is deprecated:DeprecationWarning")
def test_jit_trace_records_the_custom_op():
    """``torch.jit.trace`` gets the custom op (one recorded call), not the function's Triton launches, so the trace
    computes the op on new inputs."""
    q, k, increment, temperature, _ = (x.detach() for x in make_inputs(1, 5, 2, 1, 8, 4))

    def rotate_q(q, k, increment, temperature):
        return selective_rotary_triton(q, k, increment, temperature)[0]

    with torch.no_grad():
        traced = torch.jit.trace(rotate_q, (q, k, increment, temperature), check_trace=False)
        new_q = torch.randn_like(q)
        torch.testing.assert_close(traced(new_q, k, increment, temperature), rotate_q(new_q, k, increment, temperature))
    assert "selective_rope::rotary_forward" in str(traced.graph)


def test_torch_compile_fullgraph():
    """Opaque custom ops: torch.compile traces through them without a graph break, forward, backward and decode."""
    q, k, increment, temperature, phase0 = make_inputs(2, 6, 4, 2, 10, 4)
    compiled = torch.compile(selective_rotary_triton, fullgraph=True, backend="aot_eager")
    weights = [torch.randn(2, 6, 4, 10), torch.randn(2, 6, 2, 10), torch.randn(2, 2, 4)]
    inputs = (q, k, increment, temperature, phase0)
    expected = grads(selective_rotary_triton(*inputs), weights, inputs)
    for a, e in zip(grads(compiled(*inputs), weights, inputs), expected):
        assert_close(a, e, "grad", rtol=1e-6, atol=1e-6)

    decode = decode_inputs()
    step = torch.compile(selective_rotary_decode_triton, fullgraph=True, backend="aot_eager")
    for a, e in zip(step(**decode, conv_activation="silu"), selective_rotary_decode_triton(**decode,
                                                                                          conv_activation="silu")):
        assert_close(a, e, "decode", rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# the rotary module: backend="triton" against backend="torch"
# --------------------------------------------------------------------------------------------------------------------
MODULE_OPTIONS = [
    dict(),
    dict(phase_proj="full_rank", phase_gate_type="channel", phase_bias=True, phase_conv_activation="silu"),
    dict(phase_proj="scalar", phase_gate_type="low_rank", phase_conv_size=2, partial_rotary_factor=0.5),
    dict(phase_gate=False, phase_bias=True, phase_conv_size=0),
    dict(position_embedding="rope"),
    # the official code's options (issue 24): the decode step reads the difference's fixed taps
    dict(phase_proj="dense_low_rank", phase_proj_rank=6, phase_conv_type="difference", phase_gate_type="low_rank",
         phase_gate_rank=3, phase_bias=True, phase_conv_activation="swish"),
]
PACKED_OPTIONS = MODULE_OPTIONS[:3] + MODULE_OPTIONS[-1:]


def run_module(module, backend, x, q, k, state=None, lengths=None, cu_seqlens=None):
    module.backend = backend
    try:
        return module(x, q, k, state=state, lengths=lengths, cu_seqlens=cu_seqlens)
    finally:
        module.backend = "torch"


def count_fused_decode_steps(monkeypatch) -> list:
    """A list that grows by one per fused decode step, from the phase inputs or from the input."""
    calls = []
    for name in ("selective_rotary_decode_triton", "selective_rotary_decode_from_input_triton"):
        fused = getattr(rotary_triton, name)
        monkeypatch.setattr(rotary_triton, name, lambda *a, fused=fused, **kw: calls.append(1) or fused(*a, **kw))
    return calls


def option_id(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "default"


@pytest.mark.parametrize("options", MODULE_OPTIONS, ids=option_id)
def test_module_prefill_then_decode(options, monkeypatch):
    """A padded prefill (with gradients), then decoding steps where one row's token is padding: the Triton path
    (prefill op, fused decode step) gives the torch path's q, k and cached state."""
    decode_calls = count_fused_decode_steps(monkeypatch)
    module = make_rotary(dtype=torch.float32, device=DEVICE, **options)
    x = torch.randn(3, 6, HIDDEN)
    q, k = torch.randn(3, 6, 4, 8), torch.randn(3, 6, 2, 8)
    lengths = torch.tensor([6, 4, 0])
    params = [p for p in module.parameters() if p.requires_grad]
    outputs = {}
    for backend in ("torch", "triton"):
        q_rot, k_rot, state = run_module(module, backend, x, q, k, lengths=lengths)
        loss = (q_rot * torch.linspace(-1, 1, 8)).sum() + (k_rot ** 2 * torch.linspace(0, 1, 8)).sum()
        outputs[backend] = (q_rot, k_rot, state, torch.autograd.grad(loss, params) if params else ())
    (tq, tk, tstate, tgrads), (xq, xk, xstate, xgrads) = outputs["torch"], outputs["triton"]
    assert_close(xq, tq, "q", rtol=1e-5, atol=1e-5)
    assert_close(xk, tk, "k", rtol=1e-5, atol=1e-5)
    assert tstate.keys() == xstate.keys()
    for name in tstate:
        assert_close(xstate[name], tstate[name], name, rtol=1e-5, atol=1e-5)
    for a, e in zip(xgrads, tgrads):
        assert_close(a, e, "parameter grad", rtol=1e-4, atol=1e-4)

    states = {"torch": tstate, "triton": xstate}
    with torch.no_grad():
        for step_lengths in (torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1]), None):
            x, q, k = torch.randn(3, 1, HIDDEN), torch.randn(3, 1, 4, 8), torch.randn(3, 1, 2, 8)
            results = {b: run_module(module, b, x, q, k, states[b], step_lengths) for b in states}
            for name, a, e in zip(("q", "k"), results["triton"][:2], results["torch"][:2]):
                assert_close(a, e, name, rtol=1e-5, atol=1e-5)
            for name in results["torch"][2]:
                assert_close(results["triton"][2][name], results["torch"][2][name], name, rtol=1e-5, atol=1e-5)
            states = {b: r[2] for b, r in results.items()}
    assert len(decode_calls) == 3  # Selective RoPE and RoPE alike


@pytest.mark.parametrize("options", PACKED_OPTIONS, ids=option_id)
def test_module_packed_sequences_stay_packed(options, monkeypatch):
    """Packed sequences, starting and continuing per-sequence states: the Triton path runs the prefill kernel once
    on the packed tensors (cu_seqlens) and gives the torch path's (one dense row per sequence) q, k, states and
    parameter gradients."""
    from selective_rope.kernels import dispatch

    # imported before the patches below (each finds its module from the function it imports)
    dispatch.triton_rotary()
    fused_op = dispatch.triton_rotary_from_input()
    packed_calls = []
    for op, name in ((rotary_triton, "selective_rotary_triton"), (fused_op, "selective_rotary_from_input_triton")):
        prefill = getattr(op, name)  # (the default phase path takes the fused op from the input)
        monkeypatch.setattr(op, name, lambda *a, prefill=prefill, **kw: packed_calls.append(
            kw.get("cu_seqlens") is not None) or prefill(*a, **kw))
    module = make_rotary(dtype=torch.float32, device=DEVICE, **options)
    offsets = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)  # an empty sequence, a one-token one
    x, q, k = torch.randn(1, 9, HIDDEN), torch.randn(1, 9, 4, 8), torch.randn(1, 9, 2, 8)
    params = [p for p in module.parameters() if p.requires_grad]
    states = {"torch": None, "triton": None}
    for call in range(2):  # the second call continues the states the first one ended with
        outputs = {}
        for backend in ("torch", "triton"):
            q_rot, k_rot, state = run_module(module, backend, x, q, k, states[backend], cu_seqlens=offsets)
            loss = (q_rot * torch.linspace(-1, 1, 8)).sum() + (k_rot ** 2 * torch.linspace(0, 1, 8)).sum()
            outputs[backend] = q_rot, k_rot, state, torch.autograd.grad(loss, params)
            states[backend] = {name: t.detach() for name, t in state.items()}
        (tq, tk, tstate, tgrads), (xq, xk, xstate, xgrads) = outputs["torch"], outputs["triton"]
        assert_close(xq, tq, f"q of call {call}", rtol=1e-5, atol=1e-5)
        assert_close(xk, tk, f"k of call {call}", rtol=1e-5, atol=1e-5)
        assert tstate.keys() == xstate.keys() and tstate["phase"].shape[0] == 4
        for name in tstate:
            assert_close(xstate[name], tstate[name], name, rtol=1e-5, atol=1e-5)
        for a, e in zip(xgrads, tgrads):
            assert_close(a, e, "parameter grad", rtol=1e-4, atol=1e-4)
        x, q, k = torch.randn(1, 9, HIDDEN), torch.randn(1, 9, 4, 8), torch.randn(1, 9, 2, 8)
    assert packed_calls == [True, True]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_phase_path_stays_float32_under_autocast(backend):
    """Under autocast (Trainer's bf16=True) the phase projections still run in float32: nothing changes."""
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_gate_type="low_rank", phase_bias=True)
    x, q, k = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    expected = run_module(module, backend, x, q, k)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        actual = run_module(module, backend, x, q, k)
    for a, e in zip(actual[:2], expected[:2]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    torch.testing.assert_close(actual[2]["phase"], expected[2]["phase"], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rotary_module_compiles_without_graph_break(backend):
    """Backend resolution and the custom ops trace under torch.compile(fullgraph=True)."""
    module = make_rotary(dtype=torch.float32, device=DEVICE, phase_bias=True)
    module.backend = backend
    x, q, k = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    expected = module(x, q, k)
    actual = torch.compile(module, fullgraph=True, backend="aot_eager")(x, q, k)
    for a, e in zip(actual[:2], expected[:2]):
        assert_close(a, e, "compiled", rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# the decode step from the input, one launch (the default phase path)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,chunk_dim,rank,pairs,gate,dtype", [
    (2, 8, 32, 4, True, torch.float32),
    (4, 100, 5, 7, True, torch.bfloat16),  # a chunk in two blocks of 64 (the second partial), odd rank and pairs
    (3, 16, 4, 8, False, torch.float32),
], ids=["default", "two-blocks-bf16", "no-gate"])
def test_decode_from_input_matches_the_modules(heads, chunk_dim, rank, pairs, gate, dtype):
    """The one-launch step against ``selective_rotary_decode_triton`` fed by ``PhaseProjection`` and the per-head
    ``PhaseLinear`` on the L2-normalised chunks (float64): the same rotated q and k and the same phase (the increment
    rounds to the same float32 value), and the projection, which the new convolution history holds last, equal within
    float64 rounding. Rows of ``x`` are strided (a slice of a wider tensor); one row is padding."""
    from selective_rope.modeling.rotary import PhaseLinear, PhaseProjection

    projection = PhaseProjection("low_rank", heads, chunk_dim, pairs, rank)
    gate_module = PhaseLinear(heads * chunk_dim, heads, bias=True) if gate else None
    wide = torch.randn(3, heads * chunk_dim + 5, dtype=dtype)
    x = wide[:, 5:]
    u = torch.nn.functional.normalize(x.double().view(3, 1, heads, chunk_dim), dim=-1)
    with torch.no_grad():
        inputs = projection(u)[:, 0], None if gate_module is None else gate_module(u.flatten(2))[:, 0, :, None]
    head_dim = 2 * pairs + 2
    step = dict(q=torch.randn(3, 2 * heads, head_dim, dtype=dtype), k=torch.randn(3, heads, head_dim, dtype=dtype),
                temperature=torch.rand(pairs) + 0.5, phase=torch.randn(3, heads, pairs, dtype=torch.float64),
                conv_state=torch.randn(3, 2, heads * pairs, dtype=torch.float64),
                conv_weight=torch.randn(heads * pairs, 3), conv_activation="silu", bias=torch.randn(heads, pairs),
                valid=torch.tensor([True, False, True]))
    expected = selective_rotary_decode_triton(projection=inputs[0], gate_logits=inputs[1], **step)
    weights = (projection.down, projection.up) + ((gate_module.weight, gate_module.bias) if gate else (None, None))
    actual = rotary_triton.selective_rotary_decode_from_input_triton(x=x, down=weights[0], up=weights[1],
                                                                     gate_weight=weights[2], gate_bias=weights[3],
                                                                     **step)
    for name, a, e in zip(("q", "k", "phase"), actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e), name
    torch.testing.assert_close(actual[3], expected[3], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(actual[3][[0, 2], -1].view(2, heads, pairs), inputs[0][[0, 2]], rtol=1e-13,
                               atol=1e-13)


@pytest.mark.parametrize("entry", ["projection", "from_input"])
def test_decode_steps_take_the_layers_tensors_as_they_are(entry):
    """q ``(B, 1, Hq, D)``, k ``(B, 1, Hk, D)`` and x ``(B, 1, D)``, as a layer has them (no view to make per layer
    and step): the results of the ``(B, H, D)`` call, with the time axis; any other shape is refused by name."""
    inputs = decode_inputs(head_dim=8)
    if entry == "from_input":
        x, down, up = torch.randn(3, 2 * 6), torch.randn(2, 3, 6), torch.randn(2, 4, 3)
        gate = torch.randn(2, 12), torch.randn(2)

        def call(q, k, x=x, **rest):
            return rotary_triton.selective_rotary_decode_from_input_triton(
                q, k, x, down, up, *gate, rest["temperature"], phase=rest["phase"], conv_state=rest["conv_state"],
                conv_weight=rest["conv_weight"], bias=rest["bias"], valid=rest["valid"])
    else:
        x = None

        def call(q, k, x=None, **rest):
            return selective_rotary_decode_triton(q, k, **rest)
    rest = {n: v for n, v in inputs.items() if n not in ("q", "k")}
    flat = call(inputs["q"], inputs["k"], **rest)
    timed = call(inputs["q"][:, None], inputs["k"][:, None], **({} if x is None else {"x": x[:, None]}), **rest)
    assert timed[0].shape == (3, 1, 4, 8) and timed[1].shape == (3, 1, 2, 8)
    for a, e in zip((timed[0][:, 0], timed[1][:, 0], *timed[2:]), flat):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="disagree"):
        call(torch.randn(3, 2, 4, 8), torch.randn(3, 2, 2, 8), **rest)
    with pytest.raises(ValueError, match="disagree"):
        call(inputs["q"][:, None], inputs["k"], **rest)


def _with_fresh_state(inputs):
    return {**inputs, "phase": inputs["phase"].clone(),
            "conv_state": None if inputs["conv_state"] is None else inputs["conv_state"].clone()}


@pytest.mark.parametrize("case", [dict(), dict(conv_size=0), dict(conv_size=2, gate="channel", padded=False)],
                         ids=lambda c: option_id(c))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom-op"])
def test_decode_in_place_writes_the_given_state(case, traced):
    """``in_place``: the step's new phase and history are written into the given tensors (a static cache's), which
    it returns, with exactly the values of the step that returns new ones; under a dispatch mode (how a tracer
    calls it) through the custom op that declares the mutation. The padding row's state stays as it was."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    inputs = decode_inputs(**case)
    expected = selective_rotary_decode_triton(**_with_fresh_state(inputs))
    given = _with_fresh_state(inputs)
    mode = Ops()
    with mode if traced else contextlib.nullcontext():
        actual = selective_rotary_decode_triton(**given, in_place=True)
    assert actual[2] is given["phase"] and actual[3] is given["conv_state"]
    for name, a, e in zip(("q", "k", "phase", "conv_state"), actual, expected):
        assert (a is None and e is None) or torch.equal(a, e), name
    if traced:
        assert "selective_rope.rotary_decode_in_place.default" in mode.ops
        assert not any(op.startswith("aten.copy") for op in mode.ops), mode.ops  # the kernel wrote the state
    if inputs["valid"] is not None:
        assert torch.equal(given["phase"][1], inputs["phase"][1])


def test_decode_in_place_needs_a_float64_contiguous_state():
    """Without a state to write (a sequence start), or with one the kernel cannot write as it is (float32, strided),
    the in-place step returns new tensors and leaves the given ones untouched."""
    inputs = decode_inputs(state=False)
    assert selective_rotary_decode_triton(**inputs, in_place=True)[2] is not None
    inputs = decode_inputs()
    phase32, history = inputs["phase"].float(), inputs["conv_state"].transpose(1, 2).contiguous().transpose(1, 2)
    kept = phase32.clone(), history.clone()
    _, _, phase, new_history = selective_rotary_decode_triton(**{**inputs, "phase": phase32, "conv_state": history},
                                                              in_place=True)
    assert phase is not phase32 and new_history is not history
    assert torch.equal(phase32, kept[0]) and torch.equal(history, kept[1])


def test_decode_from_input_in_place_writes_the_given_state():
    from selective_rope.modeling.rotary import PhaseLinear, PhaseProjection

    heads, chunk_dim, rank, pairs = 2, 8, 4, 4
    projection = PhaseProjection("low_rank", heads, chunk_dim, pairs, rank)
    gate = PhaseLinear(heads * chunk_dim, heads, bias=True)
    step = dict(q=torch.randn(3, 2 * heads, 10), k=torch.randn(3, heads, 10), x=torch.randn(3, heads * chunk_dim),
                down=projection.down, up=projection.up, gate_weight=gate.weight, gate_bias=gate.bias,
                temperature=torch.rand(pairs) + 0.5, conv_weight=torch.randn(heads * pairs, 3),
                conv_activation="silu", bias=torch.randn(heads, pairs), valid=torch.tensor([True, False, True]))
    phase, history = torch.randn(3, heads, pairs, dtype=torch.float64), torch.randn(3, 2, heads * pairs,
                                                                                     dtype=torch.float64)
    kernel = rotary_triton.selective_rotary_decode_from_input_triton
    expected = kernel(**step, phase=phase.clone(), conv_state=history.clone())
    actual = kernel(**step, phase=phase, conv_state=history, in_place=True)
    assert actual[2] is phase and actual[3] is history
    for name, a, e in zip(("q", "k", "phase", "conv_state"), actual, expected):
        assert torch.equal(a, e), name


def test_opcheck_decode_in_place():
    """The in-place op's schema declares what it writes (opcheck's schema test fails on an undeclared mutation)."""
    inputs = decode_inputs()
    args = (inputs["q"], inputs["k"], inputs["projection"], inputs["temperature"], inputs["phase"],
            inputs["conv_state"], inputs["conv_weight"], inputs["bias"], inputs["gate_logits"].expand(3, 2, 4),
            inputs["valid"].int(), True)
    torch.library.opcheck(torch.ops.selective_rope.rotary_decode_in_place.default, args)


def test_decode_from_input_refuses_disagreeing_weights():
    x, q, k = torch.randn(2, 12), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="disagree"):
        rotary_triton.selective_rotary_decode_from_input_triton(q, k, x, torch.randn(3, 2, 5), torch.randn(3, 4, 2),
                                                                None, None, torch.ones(4))


@pytest.mark.parametrize("options,observer,fused", [
    (dict(), None, True),
    (dict(phase_gate=False), None, True),
    (dict(phase_gate_type="channel"), None, False),
    (dict(phase_proj="full_rank"), None, False),
    (dict(), "projection hook", False),
    (dict(), "gate hook", False),
    (dict(), "global hook", False),
], ids=["default", "no-gate", "channel-gate", "full-rank", "projection-hook", "gate-hook", "global-hook"])
def test_decode_step_fuses_its_phase_inputs_where_nothing_observes(options, observer, fused, monkeypatch):
    """Decoding steps on the Triton path compute the projection and gate in the step's launch for the default phase
    path, and call the modules (their hooks run) for other kinds or where a hook observes them; the steps give the same
    q, k and state either way (the path with a pass-through hook on the projection is the reference)."""
    calls = []
    kernel = rotary_triton.selective_rotary_decode_from_input_triton
    monkeypatch.setattr(rotary_triton, "selective_rotary_decode_from_input_triton",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    module = make_rotary(dtype=torch.float32, device=DEVICE, **options)
    seen = []
    observe = lambda *args: seen.append(1)  # noqa: E731
    handle = {"projection hook": lambda: module.phase_proj.register_forward_hook(observe),
              "gate hook": lambda: module.phase_gate_proj.register_forward_pre_hook(observe),
              "global hook": lambda: torch.nn.modules.module.register_module_forward_hook(observe),
              None: lambda: None}[observer]()
    x, q, k = torch.randn(3, 4, HIDDEN), torch.randn(3, 4, 4, 8), torch.randn(3, 4, 2, 8)
    try:
        with torch.no_grad():
            _, _, state = run_module(module, "triton", x[:, :1], q[:, :1], k[:, :1])
            steps = []
            for t in range(1, 4):
                q_t, k_t, state = run_module(module, "triton", x[:, t:t + 1], q[:, t:t + 1], k[:, t:t + 1], state,
                                             torch.tensor([1, 0, 1]) if t == 2 else None)
                steps.append((q_t, k_t, state))
    finally:
        if handle is not None:
            handle.remove()
    assert len(calls) == (4 if fused else 0)  # four single-token calls (the first starts the state)
    assert (len(seen) > 0) == (observer is not None)

    reference = module.phase_proj.register_forward_hook(lambda *args: None)  # forces the modules' path
    try:
        with torch.no_grad():
            _, _, state = run_module(module, "triton", x[:, :1], q[:, :1], k[:, :1])
            for t, (q_t, k_t, step_state) in zip(range(1, 4), steps):
                q_r, k_r, state = run_module(module, "triton", x[:, t:t + 1], q[:, t:t + 1], k[:, t:t + 1], state,
                                             torch.tensor([1, 0, 1]) if t == 2 else None)
                # q, k and the phase equal (the increment is rounded to float32 alike); the convolution's history
                # holds the float64 projection, summed in another order: equal within float64 rounding
                assert torch.equal(q_t, q_r) and torch.equal(k_t, k_r) and torch.equal(step_state["phase"],
                                                                                     state["phase"])
                assert step_state.keys() == state.keys()
                torch.testing.assert_close(step_state["phase_conv"], state["phase_conv"], rtol=1e-13, atol=1e-13)
    finally:
        reference.remove()
    assert len(calls) == (4 if fused else 0)  # the reference steps did not fuse


def test_rope_decoding_step_equals_the_prefill_op_exactly():
    """RoPE's decoding steps take the fused decode kernel with a unit step (not the prefill op on one token): the
    same q, k and phase bit for bit, a padding token adding nothing."""
    from selective_rope.kernels.rotary import unit_step

    module = make_rotary(dtype=torch.float32, device=DEVICE, position_embedding="rope")
    q, k = torch.randn(3, 1, 4, 8), torch.randn(3, 1, 2, 8)
    phase = 1000 * torch.rand(3, 2, 4, dtype=torch.float64)  # far along: the angle reduction matters
    lengths = torch.tensor([1, 0, 1])
    with torch.no_grad():
        step = run_module(module, "triton", torch.randn(3, 1, HIDDEN), q, k, {"phase": phase}, lengths)
        increment = (lengths > 0).float()[:, None, None, None]  # (B, 1, 1, 1): 1 for a real token, 0 for a pad
        prefill = selective_rotary_triton(q, k, increment, module.temperature, phase)
    assert unit_step(torch.device(DEVICE)).item() == 1.0
    assert torch.equal(step[0], prefill[0]) and torch.equal(step[1], prefill[1])
    assert torch.equal(step[2]["phase"], prefill[2]) and torch.equal(prefill[2][1], phase[1])
