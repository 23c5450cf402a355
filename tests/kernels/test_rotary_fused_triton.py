"""The fused Selective RoPE op from the layer input (``kernels/rotary_fused_triton.py``, run on CPU by Triton's
interpreter, compiled on a GPU where there is one) against the torch path: the rotary module on ``backend="triton"``,
which takes the fused op for the default phase path, gives ``backend="torch"``'s rotated q and k, new state and every
gradient (x, q, k, the projection, the convolution's taps, the gate, the bias, the temperature, the initial phase),
with padding, GQA, a cached state, packed sequences, bf16 q and k, one time chunk a sequence or several (issue 46,
item 1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused Triton op cannot be tested")

from selective_rope.kernels import dispatch, rotary, rotary_triton  # noqa: E402

from rotary_reference import HIDDEN, make_rotary  # noqa: E402

# On a GPU the compiled kernels; here Triton's interpreter (tests/conftest.py sets it)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, **kwargs) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, **kwargs)

# Small ranks: the interpreter runs each rank's step of every program in Python.
OPTIONS = {
    "default": dict(phase_proj_rank=3),  # the per-head gate, a 4-tap convolution
    "bias-silu": dict(phase_bias=True, phase_conv_activation="silu", phase_proj_rank=3),
    "no-conv-no-gate": dict(phase_conv_size=0, phase_gate=False, phase_bias=True, phase_proj_rank=2),
    "difference-partial": dict(phase_conv_type="difference", phase_bias=True, partial_rotary_factor=0.5,
                               phase_proj_rank=2),
}


@pytest.fixture
def fused_calls(monkeypatch):
    """The fused op's calls (the module's forward on "triton" must take it, not the unfused path)."""
    op = dispatch.triton_rotary_from_input()
    calls = []
    original = op._forward_impl
    monkeypatch.setattr(op, "_forward_impl", lambda *a: calls.append(1) or original(*a))
    return calls


def chunks(monkeypatch, several: bool) -> None:
    """One time chunk a sequence, or as many as the plan makes (32-token chunks: the two-pass scan), on the
    interpreter's plan or a GPU's."""
    monkeypatch.setattr(rotary_triton, "_INTERPRETER_PROGRAMS", 1024 if several else 0)
    monkeypatch.setattr(rotary_triton, "_PROGRAMS_PER_SM", 1024 if several else 0)


def assert_close(actual, expected, name, tolerance=1e-4):
    scale = max(expected.detach().abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), rtol=tolerance,
                               atol=tolerance * scale, msg=lambda message: f"{name}: {message}")


def run_both(module, x, q, k, state=None, lengths=None, cu_seqlens=None):
    """The module's forward and backward on "torch" and on "triton": ``{backend: (q, k, state, {name: grad})}``, the
    gradients of x, q, k, the initial phase (where given) and every trainable parameter."""
    results = {}
    for backend in ("torch", "triton"):
        inputs = {"x": x.detach().clone().requires_grad_(), "q": q.detach().clone().requires_grad_(),
                  "k": k.detach().clone().requires_grad_()}
        given = None
        if state is not None:
            given = {name: t.detach().clone() for name, t in state.items()}
            given["phase"].requires_grad_()
            inputs["initial_phase"] = given["phase"]
        q_out, k_out, new_state = module(inputs["x"], inputs["q"], inputs["k"], state=given, lengths=lengths,
                                         cu_seqlens=cu_seqlens, backend=backend)
        weights = torch.linspace(-1, 1, q.shape[-1], device=q.device)
        loss = ((q_out.float() * weights).sum() + (k_out.float() ** 2 * weights.flip(0)).sum()
                + (new_state["phase"] * 0.1).sum())
        named = {**inputs, **{n: p for n, p in module.named_parameters() if p.requires_grad}}
        grads = torch.autograd.grad(loss, list(named.values()))
        results[backend] = q_out, k_out, new_state, dict(zip(named, grads))
    return results


def assert_same(results, tolerance=1e-4):
    (tq, tk, tstate, tgrads), (xq, xk, xstate, xgrads) = results["torch"], results["triton"]
    assert xq.dtype == tq.dtype and xk.dtype == tk.dtype
    assert_close(xq, tq, "q", tolerance)
    assert_close(xk, tk, "k", tolerance)
    assert xstate.keys() == tstate.keys()
    for name in tstate:
        assert xstate[name].dtype == tstate[name].dtype == torch.float64
        assert_close(xstate[name], tstate[name], f"state {name}", 1e-6)
    assert xgrads.keys() == tgrads.keys()
    for name in tgrads:
        assert xgrads[name].dtype == tgrads[name].dtype, name
        assert_close(xgrads[name], tgrads[name], f"d{name}", tolerance)


def cached_state(module, batch):
    return {"phase": 3 * randn(batch, module.num_key_heads, module.rotary_pairs, dtype=torch.float64),
            "phase_conv": randn(batch, 3, module.num_key_heads * module.rotary_pairs, dtype=torch.float64)}


@pytest.mark.parametrize("name, several", [("default", False)] + [(name, True) for name in OPTIONS],
                         ids=["default-one-chunk"] + [f"{name}-chunks" for name in OPTIONS])
def test_padded_rows_after_a_cache_give_the_torch_paths_outputs_and_gradients(name, several, monkeypatch,
                                                                               fused_calls):
    """Right-padded rows (one full, one short, one empty), GQA (4 query heads on 2 key heads), a cached phase and
    convolution history, a trainable temperature: every output and gradient as on the torch path."""
    chunks(monkeypatch, several)
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, temperature_trainable=True, **OPTIONS[name])
    x, q, k = randn(3, 37, HIDDEN), randn(3, 37, 4, 8), randn(3, 37, 2, 8)  # 2 chunks of 32
    state = cached_state(module, 3)
    if module.phase_conv is None:
        del state["phase_conv"]
    elif name.startswith("difference"):
        state["phase_conv"] = state["phase_conv"][:, :1]  # the difference keeps one previous projection
    assert_same(run_both(module, x, q, k, state, lengths=torch.tensor([37, 23, 0], device=DEVICE)))
    assert fused_calls == [1]


def test_bf16_queries_and_keys_from_a_sequence_start(monkeypatch, fused_calls):
    """bf16 q and k (as a bf16 model's): the same float32 math rounded once, so at most a bf16 step apart; the phase
    path's gradients (from float32 increments' gradients) as close as in float32."""
    chunks(monkeypatch, True)
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, phase_bias=True, phase_proj_rank=3)
    x = randn(2, 40, HIDDEN)
    q, k = randn(2, 40, 4, 8, dtype=torch.bfloat16), randn(2, 40, 2, 8, dtype=torch.bfloat16)
    results = run_both(module, x, q, k)
    (tq, tk, _, tgrads), (xq, xk, _, xgrads) = results["torch"], results["triton"]
    assert xq.dtype == torch.bfloat16 and xgrads["q"].dtype == torch.bfloat16
    pairs = (("q", xq, tq), ("k", xk, tk), ("dq", xgrads["q"], tgrads["q"]), ("dk", xgrads["k"], tgrads["k"]))
    for name, a, e in pairs:
        assert_close(a, e, name, 1e-2)
    for name in tgrads.keys() - {"q", "k"}:
        assert_close(xgrads[name], tgrads[name], f"d{name}", 2e-2)  # through bf16 rounding of the rotated outputs
    assert fused_calls == [1]


@pytest.mark.parametrize("several", [False, True], ids=["one-chunk", "chunks"])
def test_packed_sequences_after_their_caches(several, monkeypatch, fused_calls):
    """Packed sequences (an empty one, a one-token one, one spanning chunks), each continuing its own cached phase
    and history: the fused op runs once on the packed row; the torch path runs one dense row per sequence."""
    chunks(monkeypatch, several)
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, phase_bias=True, phase_conv_activation="silu",
                         phase_proj_rank=3)
    offsets = torch.tensor([0, 3, 3, 4, 41, 45], dtype=torch.int32, device=DEVICE)
    x, q, k = randn(1, 45, HIDDEN), randn(1, 45, 4, 8), randn(1, 45, 2, 8)
    assert_same(run_both(module, x, q, k, cached_state(module, 5), cu_seqlens=offsets))
    assert fused_calls == [1]


def test_the_backward_keeps_no_float64_activation():
    """What the op saves for its backward: q, k, x, the weights, the float32 increments and the chunk totals
    (``(N * Hk, chunks + 1, R)`` float64), none of the phase path's float64 per-token intermediates."""
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, phase_bias=True, phase_proj_rank=3)
    x = randn(2, 40, HIDDEN, requires_grad=True)
    q, k = randn(2, 40, 4, 8, requires_grad=True), randn(2, 40, 2, 8, requires_grad=True)
    q_out, _, _ = module(x, q, k, backend="triton")
    saved = [t for t in q_out.grad_fn.saved_tensors if t is not None]
    per_token = [t for t in saved if t.dim() >= 3 and t.shape[:2] == (2, 40)]
    assert {t.dtype for t in per_token} == {torch.float32}  # x, q, k and the increments
    assert [tuple(t.shape) for t in per_token if t.shape[-1] == module.rotary_pairs] == [(2, 40, 2, 4)]
    float64 = [tuple(t.shape) for t in saved if t.dtype == torch.float64]
    assert len(float64) == 1 and float64[0][0] == 2 * 2 and float64[0][2] == module.rotary_pairs  # the totals


def test_compiled_training_has_no_graph_break_and_the_eager_gradients():
    """Under torch.compile(fullgraph=True) the module's training call is the custom ops (forward, and its registered
    backward), with the eager results."""
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, phase_bias=True, phase_proj_rank=2)
    module.backend = "triton"
    x, q, k = randn(2, 9, HIDDEN), randn(2, 9, 4, 8), randn(2, 9, 2, 8)
    params = [p for p in module.parameters() if p.requires_grad]

    def loss_and_grads(forward):
        inputs = [t.clone().requires_grad_() for t in (x, q, k)]
        q_out, k_out, state = forward(*inputs)
        loss = q_out.sum() + (k_out ** 2).sum() + state["phase"].sum()
        return loss, torch.autograd.grad(loss, inputs + params)

    expected = loss_and_grads(module)
    torch._dynamo.reset()
    actual = loss_and_grads(torch.compile(module, fullgraph=True, backend="aot_eager"))
    assert_close(actual[0], expected[0], "loss", 1e-6)
    for a, e in zip(actual[1], expected[1]):
        assert_close(a, e, "grad", 1e-6)


def test_the_custom_ops_are_well_formed():
    """Schema, fake shapes and the registered autograd formula (torch.library.opcheck), with every optional input."""
    op = dispatch.triton_rotary_from_input()
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, phase_bias=True, phase_proj_rank=2)
    state = cached_state(module, 2)
    args = (randn(2, 5, 4, 8, requires_grad=True), randn(2, 5, 2, 8, requires_grad=True),
            randn(2, 5, HIDDEN, requires_grad=True), module.phase_proj.down, module.phase_proj.up,
            module.phase_conv.taps(None), module.phase_bias, module.phase_gate_proj.weight,
            module.phase_gate_proj.bias, module.temperature, state["phase"], state["phase_conv"],
            torch.tensor([5, 2], device=DEVICE), None, False)
    torch.library.opcheck(op._forward_op, args, test_utils=("test_schema", "test_faketensor",
                                                            "test_autograd_registration"))


def test_bad_arguments_are_refused_by_name():
    op = dispatch.triton_rotary_from_input()
    module = make_rotary(4, 2, dtype=torch.float32, device=DEVICE)
    x, q, k = randn(2, 5, HIDDEN), randn(2, 5, 4, 8), randn(2, 5, 2, 8)
    weights = module.fusable_phase_weights()
    with pytest.raises(ValueError, match="initial_phase"):
        op.selective_rotary_from_input_triton(q, k, x, *weights, module.temperature,
                                              initial_phase=torch.zeros(2, 2, 3, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="disagree"):
        op.selective_rotary_from_input_triton(q, k, x[:, :4], *weights, module.temperature)
    with torch.no_grad():  # a broadcastable initial phase is taken, as the rotary op takes it
        shared = randn(1, 2, 4, dtype=torch.float64)
        broadcast, expanded = (op.selective_rotary_from_input_triton(q, k, x, *weights, module.temperature,
                                                                     initial_phase=phase)
                               for phase in (shared, shared.expand(2, 2, 4).clone()))
    assert all(torch.equal(a, b) for a, b in zip(broadcast[:3], expanded[:3]))
    with pytest.raises(ValueError, match="activation"):
        op.selective_rotary_from_input_triton(q, k, x, *weights, module.temperature,
                                              conv_weight=module.phase_conv.taps(None), conv_activation="gelu")
    with pytest.raises(ValueError, match="conv_weight"):  # (C, K) or a depthwise Conv1d's (C, 1, K), nothing else
        op.selective_rotary_from_input_triton(q, k, x, *weights, module.temperature,
                                              conv_weight=module.phase_conv.weight.expand(-1, 2, -1))


def test_other_phase_paths_and_empty_calls_stay_unfused(fused_calls):
    """A phase path the fused op does not compute (a full-rank projection, a hooked module) and a call without
    tokens take the module's increments and the rotary op, as before."""
    x, q, k = randn(2, 5, HIDDEN), randn(2, 5, 4, 8), randn(2, 5, 2, 8)
    other = make_rotary(4, 2, dtype=torch.float32, device=DEVICE, phase_proj="full_rank")
    hooked = make_rotary(4, 2, dtype=torch.float32, device=DEVICE)
    hooked.phase_proj.register_forward_hook(lambda *args: None)
    for module in (other, hooked):
        assert rotary.sequence_from_input_triton(module, x, q, k, {}, None, None) is None
        module(x, q, k, backend="triton")
    default = make_rotary(4, 2, dtype=torch.float32, device=DEVICE)
    assert rotary.sequence_from_input_triton(default, x[:, :0], q[:, :0], k[:, :0], {}, None, None) is None
    assert fused_calls == []
