"""The compiled CPU training path of the rotary module (kernels/rotary_cpu_train.py): its forward is the inference
kernel's (bit for bit), its gradients are the torch path's autograd gradients (to float64 rounding), it does not
depend on the number of threads, and everything it does not take runs the torch path."""

from __future__ import annotations

import pytest
import torch

from selective_rope.kernels import rotary_cpu
from selective_rope.kernels.rotary_cpu_train import CompiledRotaryTraining

from families import FAMILIES
from rotary_reference import HEADS, HIDDEN, ROTATING_GRID, make_rotary

pytestmark = pytest.mark.skipif(rotary_cpu.find_compiler() is None, reason="no C compiler")

COMPILED = "CompiledRotaryTrainingBackward"


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")


def inputs(module, heads, batch=2, seq_len=13, dtype=torch.float32, seed=0):
    """x, q, k, an initial phase and the upstream gradients of q, k and the final phase."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq_len, HIDDEN), (batch, seq_len, heads[0], 8), (batch, seq_len, heads[1], 8)]
    x, q, k = (torch.randn(*shape, generator=generator).to(dtype) for shape in shapes)
    phase = torch.randn(batch, heads[1], module.rotary_pairs, generator=generator, dtype=torch.float64)
    upstream = [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes[1:]]
    upstream.append(torch.randn(batch, heads[1], module.rotary_pairs, generator=generator, dtype=torch.float64))
    return (x, q, k, phase), upstream


def gradients(module, tensors, upstream, backend, lengths=None, create_graph=False, **call):
    """The rotated q and k, the final phase, the grad_fn's name and the gradients of x, q, k, the initial phase and
    every parameter (``None`` where one does not reach the loss) of ``Σ upstream · outputs``."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    state = {"phase": leaves[3]} if len(leaves) > 3 else {}
    q_out, k_out, new_state = module(*leaves[:3], state, lengths, backend=backend, **call)
    loss = (q_out * upstream[0]).sum() + (k_out * upstream[1]).sum() + (new_state["phase"] * upstream[2]).sum()
    parameters = list(module.parameters())
    grads = torch.autograd.grad(loss, leaves + parameters, allow_unused=True, create_graph=create_graph)
    return q_out, k_out, new_state["phase"], type(q_out.grad_fn).__name__, grads


def assert_close_gradients(compiled, reference, names, rtol=1e-5):
    for name, got, expected in zip(names, compiled, reference):
        if expected is None:  # (e.g. x under RoPE: the compiled path returns no gradient either)
            assert got is None or not got.any(), name
            continue
        assert got is not None and got.dtype == expected.dtype, name
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * scale, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_gradients_equal_the_torch_paths(options, heads, param_dtype):
    """Every option set, GQA, right-padded rows (13 and 7 real tokens), an initial phase and a gradient on the final
    phase, every parameter trainable (the temperature too): the forward is the inference kernel's exactly, and every
    gradient is autograd's through the torch path to float64 rounding (~1e-6 of the largest)."""
    module = make_rotary(*heads, dtype=param_dtype, **options)
    for parameter in module.parameters():
        parameter.requires_grad_(True)
    tensors, upstream = inputs(module, heads)
    lengths = torch.tensor([13, 7])
    compiled = gradients(module, tensors, upstream, "torch+c", lengths)
    reference = gradients(module, tensors, upstream, "torch", lengths)
    assert compiled[3] == COMPILED and reference[3] != COMPILED
    with torch.no_grad():
        inference = module(*tensors[:3], {"phase": tensors[3]}, lengths, backend="torch+c")
    for got, expected in zip(compiled[:3], (inference[0], inference[1], inference[2]["phase"])):
        assert torch.equal(got.detach(), expected)
    names = ["x", "q", "k", "phase"] + [name for name, _ in module.named_parameters()]
    assert_close_gradients(compiled[4], reference[4], names)
    assert compiled[4][0] is None or not compiled[4][0][1, 7:].any()  # pads (and RoPE): x reaches no phase


@pytest.mark.parametrize("options", [dict(), dict(phase_proj="full_rank", phase_gate_type="channel",
                                                  phase_conv_activation="silu", phase_bias=True)], ids=str)
def test_threads_give_the_same_results_bit_for_bit(options):
    """The forward shares many short rows out between threads, each row on one; the backward splits the rows into a
    fixed number of parts whatever the number of threads: 1 and 2 threads, 20 rows of 30 tokens (more rows than
    parts, enough tokens to share out), 3 rows of 11 and 2 rows of 1100 (long enough for the forward to split each
    row between the threads, each part keeping its own tokens' values for the backward) give identical outputs and
    gradients."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    threads = torch.get_num_threads()
    for batch, seq_len in ((20, 30), (3, 11), (2, 1100)):
        tensors, upstream = inputs(module, (4, 2), batch=batch, seq_len=seq_len)
        results = []
        try:
            for count in (1, 2):
                torch.set_num_threads(count)
                results.append(gradients(module, tensors, upstream, "torch+c"))
        finally:
            torch.set_num_threads(threads)
        assert results[0][3] == COMPILED
        for one, two in zip(results[0][:3], results[1][:3]):
            assert torch.equal(one, two)
        for one, two in zip(results[0][4], results[1][4]):
            assert (one is None and two is None) or torch.equal(one, two)


def test_gradients_that_arrive_transposed_are_read_where_they_are():
    """An attention's backward leaves the gradients of q and k (B, H, T, D) transposed; the C backward reads them by
    their strides: the same results, bit for bit, as from the same gradients laid out contiguously."""
    module = make_rotary(4, 2, dtype=torch.float32)
    tensors, upstream = inputs(module, (4, 2), batch=3, seq_len=11)
    results = []
    for transposed in (False, True):
        leaves = [t.clone().requires_grad_() for t in tensors]
        q_out, k_out, state = module(*leaves[:3], {"phase": leaves[3]}, backend="torch+c")
        if transposed:  # the upstream gradients reach q_out and k_out as transposed views
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
            grads = [g.transpose(1, 2).contiguous() for g in upstream[:2]]
        else:
            grads = upstream[:2]
        loss = (q_out * grads[0]).sum() + (k_out * grads[1]).sum() + (state["phase"] * upstream[2]).sum()
        results.append(torch.autograd.grad(loss, leaves + list(module.parameters())))
    assert type(q_out.grad_fn).__name__ == "TransposeBackward0"
    for contiguous, transposed in zip(*results):
        assert torch.equal(contiguous, transposed)


@pytest.mark.parametrize("options", [dict(), dict(position_embedding="rope"),
                                     dict(phase_conv_type="difference", phase_gate_type="channel")], ids=str)
def test_bfloat16_inputs(options):
    """bf16 x, q and k (a bf16 model; the rotary parameters stay float32): the gradients of q and k are rounded to
    bf16 once, as the torch path rounds them, and the others agree to bf16's precision."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    tensors, upstream = inputs(module, (4, 2), dtype=torch.bfloat16)
    tensors = (*tensors[:3], tensors[3])
    compiled = gradients(module, tensors, upstream, "torch+c")
    reference = gradients(module, tensors, upstream, "torch")
    assert compiled[3] == COMPILED and compiled[0].dtype == torch.bfloat16
    names = ["x", "q", "k", "phase"] + [name for name, _ in module.named_parameters()]
    assert_close_gradients(compiled[4], reference[4], names, rtol=2 ** -6)


def test_packed_sequences_equal_the_torch_path():
    """Packed sequences (cu_seqlens) reach the op as one right-padded row per sequence: each restarts its phase and
    convolution, and the gradients are the torch path's."""
    module = make_rotary(4, 2, dtype=torch.float32, phase_conv_activation="silu", phase_bias=True)
    (x, q, k, _), _ = inputs(module, (4, 2), batch=1, seq_len=17)
    generator = torch.Generator().manual_seed(5)
    upstream = [torch.randn(1, 17, 4, 8, generator=generator), torch.randn(1, 17, 2, 8, generator=generator),
                torch.randn(3, 2, module.rotary_pairs, generator=generator, dtype=torch.float64)]
    cu_seqlens = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    compiled = gradients(module, (x, q, k), upstream, "torch+c", cu_seqlens=cu_seqlens)
    reference = gradients(module, (x, q, k), upstream, "torch", cu_seqlens=cu_seqlens)
    names = ["x", "q", "k"] + [name for name, _ in module.named_parameters()]
    torch.testing.assert_close(compiled[0], reference[0], rtol=1e-5, atol=1e-5)
    assert_close_gradients(compiled[4], reference[4], names)


def test_double_backward_differentiates_the_torch_path():
    """create_graph=True: the first gradients are the compiled path's (to rounding) and differentiable; the second
    derivatives are the torch path's."""
    module = make_rotary(4, 2, dtype=torch.float32)
    tensors, upstream = inputs(module, (4, 2))
    second = []
    for backend in ("torch+c", "torch"):
        _, _, _, name, grads = gradients(module, tensors[:3], upstream, backend, create_graph=True)
        dx, down = grads[0], grads[3]  # x and the projection's down weight
        second.append(torch.autograd.grad(dx.square().sum() + down.square().sum(), module.phase_proj.up))
        second[-1] += (dx.detach(),)
    assert_close_gradients(second[0], second[1], ["d2 up", "dx"])


def test_what_the_compiled_path_does_not_take_runs_the_torch_path(monkeypatch):
    """A convolution history to start from, a forward hook on a phase module, and the kernel switched off: the torch
    path, with the torch path's gradients."""
    module = make_rotary(4, 2, dtype=torch.float32)
    tensors, upstream = inputs(module, (4, 2))
    with torch.no_grad():
        _, _, state = module(*tensors[:3], backend="torch")
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    q_out, _, _ = module(*leaves, state, backend="torch+c")
    assert type(q_out.grad_fn).__name__ != COMPILED
    calls = []
    handle = module.phase_proj.register_forward_hook(lambda *args: calls.append(1))
    assert gradients(module, tensors, upstream, "torch+c")[3] != COMPILED and calls
    handle.remove()
    assert gradients(module, tensors, upstream, "torch+c")[3] == COMPILED
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
    assert gradients(module, tensors, upstream, None)[3] != COMPILED


@pytest.mark.parametrize("change", ["moved", "strided"])
def test_the_backward_reads_the_parameters_where_they_are_then(change):
    """A sharded model (FSDP) frees a parameter's memory after the forward and gathers it anew for the backward: the
    backward reads each parameter where it is then (here the old memory is filled with NaN), and one it cannot read
    (non-contiguous) sends the backward to the torch path; the gradients are the torch path's either way."""
    module = make_rotary(4, 2, dtype=torch.float32)
    tensors, upstream = inputs(module, (4, 2))
    reference = gradients(module, tensors, upstream, "torch")[4]
    leaves = [t.clone().requires_grad_() for t in tensors]
    q_out, k_out, state = module(*leaves[:3], {"phase": leaves[3]}, backend="torch+c")
    assert type(q_out.grad_fn).__name__ == COMPILED
    down = module.phase_proj.down
    old = down.data
    down.data = old.clone() if change == "moved" else old.transpose(1, 2).contiguous().transpose(1, 2)
    old.fill_(float("nan"))
    loss = (q_out * upstream[0]).sum() + (k_out * upstream[1]).sum() + (state["phase"] * upstream[2]).sum()
    compiled = torch.autograd.grad(loss, leaves + list(module.parameters()), allow_unused=True)
    names = ["x", "q", "k", "phase"] + [name for name, _ in module.named_parameters()]
    assert_close_gradients(compiled, reference, names)


def test_torch_func_transforms_run_the_torch_path():
    """torch.func.grad wraps its tensors (no memory the C code could read): the torch path, and its gradient."""
    module = make_rotary(4, 2, dtype=torch.float32)
    (x, q, k, _), _ = inputs(module, (4, 2))

    def loss(x, backend):
        q_out, k_out, _ = module(x, q, k, backend=backend)
        return q_out.square().sum() + (q_out[:, :, ::2] * k_out).sum()

    compiled = torch.func.grad(loss)(x, "torch+c")
    torch.testing.assert_close(compiled, torch.func.grad(loss)(x, "torch"), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gla", "gated_deltanet", "fox", "hybrid"])
def test_a_model_training_step_equals_the_torch_backend(family, monkeypatch):
    """A training step (loss and every parameter's gradient, right-padded rows) with the default backend ("auto": the
    compiled training path on the CPU) equals one with backend="torch" to rounding."""
    spec = FAMILIES[family]
    calls = []
    original = CompiledRotaryTraining.forward
    monkeypatch.setattr(CompiledRotaryTraining, "forward",
                        staticmethod(lambda *args: calls.append(1) or original(*args)))
    results = []
    for backend in ("auto", "torch"):
        torch.manual_seed(0)
        model = spec.lm_class(spec.config_class(**spec.tiny, backend=backend)).train()
        ids = torch.randint(3, 61, (3, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 9:] = mask[2, 5:] = 0
        loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert calls, "the compiled training path did not run"
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[1][1].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(results[0][1][name], grad, rtol=1e-4, atol=1e-5 * max(scale, 1e-3),
                                   msg=lambda m, name=name: f"{name}: {m}")
