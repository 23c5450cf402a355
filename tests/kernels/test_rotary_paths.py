"""Which path the rotary op (``kernels/rotary.py``) takes for each backend and input, and that each gives the torch
reference's results: the dispatch moved out of ``modeling/rotary.py`` must send every call where it went before.

The paths are counted by wrapping the op's own functions (``cpu_kernel_call`` counts only when the C kernel served the
call, i.e. ``RotaryPlan.try_call`` returned a result; the CPython entry each plan gets counts as ``"c_entry"``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from selective_rope.kernels import rotary, rotary_cpu, rotary_cpu_entry

from rotary_reference import HIDDEN, make_rotary

HAS_C = rotary_cpu.find_compiler() is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()  # (the interpreter)


@pytest.fixture
def paths(monkeypatch):
    """The paths taken, in order: ``"c"``, ``"c_entry"``, ``"c_train"`` (the compiled training path),
    ``"step_torch"``, ``"step_triton"``, ``"sequence_torch"``,
    ``"sequence_triton"``, ``"sequence_from_input_triton"`` (the fused op from the input)."""
    taken = []
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")

    def wrap(name, label):
        original = getattr(rotary, name)

        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            if result is not None:
                taken.append(label(kwargs) if callable(label) else label)
            return result

        monkeypatch.setattr(rotary, name, counted)

    wrap("cpu_kernel_call", "c")
    wrap("cpu_training_call", "c_train")
    make = rotary.CachedPlan.make

    def make_counted(cls, module, sizes):
        cached = make(module, sizes)
        if cached.entry_call is not None:
            entry = cached.entry_call

            def counted(*args):
                result = entry(*args)
                if result is not None:
                    taken.append("c_entry")
                return result

            cached.entry_call = counted
        return cached

    monkeypatch.setattr(rotary.CachedPlan, "make", classmethod(make_counted))
    wrap("decode_step_torch", "step_torch")
    wrap("decode_step_triton", "step_triton")
    wrap("sequence_from_input_triton", "sequence_from_input_triton")
    wrap("selective_rotary", lambda kwargs: f"sequence_{kwargs['backend'].replace('+c', '')}")
    return taken


def inputs(seq_len, batch=2, heads=(4, 2), seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, HIDDEN, generator=generator)
    q = torch.randn(batch, seq_len, heads[0], 8, generator=generator)
    k = torch.randn(batch, seq_len, heads[1], 8, generator=generator)
    return x, q, k


def run(module, paths, backend, seq_len, grad=False, lengths=None):
    """The module's forward on ``backend`` after a 3-token prefill, and the same on ``"torch"`` (``paths``: theirs).
    With autograd, from the prefill's phase only: the compiled training path starts each row's convolution afresh
    (test_rotary_cpu_train.py checks that a history sends a call to the torch path)."""
    with torch.no_grad():
        _, _, state = module(*inputs(3, seed=1), backend="torch")
    if grad:
        state = {"phase": state["phase"]}
    paths.clear()
    results = []
    for name in (backend, "torch"):
        with torch.set_grad_enabled(grad):
            q, k, new_state = module(*inputs(seq_len), state=state, lengths=lengths, backend=name)
        results.append((q.detach(), k.detach(), {n: t.detach() for n, t in new_state.items()}))
    return results


def assert_same(actual, expected):
    for a, e in zip(actual[:2], expected[:2]):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert actual[2].keys() == expected[2].keys()
    for name in expected[2]:
        torch.testing.assert_close(actual[2][name], expected[2][name], rtol=1e-9, atol=1e-6)


VARIANTS = {"selective_rope": {}, "full_rank": {"phase_proj": "full_rank", "phase_gate_type": "channel"},
            "rope": {"position_embedding": "rope"}}
CASES = [  # backend, tokens, autograd, padded, expected paths (the call on the backend, then the torch reference's)
    ("torch", 5, False, False, ["sequence_torch", "sequence_torch"]),
    ("torch", 1, False, False, ["step_torch", "step_torch"]),
    ("torch", 1, False, True, ["step_torch", "step_torch"]),
    ("torch", 1, True, False, ["sequence_torch", "sequence_torch"]),  # the steps have no backward
    ("torch+c", 5, False, False, ["c", "sequence_torch"]),
    ("torch+c", 5, False, True, ["c", "sequence_torch"]),
    ("torch+c", 1, False, False, ["c", "step_torch"]),
    ("torch+c", 1, False, True, ["c", "step_torch"]),
    ("torch+c", 5, True, False, ["c_train", "sequence_torch"]),  # training: the compiled training path
    ("torch+c", 1, True, False, ["c_train", "sequence_torch"]),
    ("torch+c", 5, True, True, ["c_train", "sequence_torch"]),
]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backend, seq_len, grad, padded, expected", CASES)
def test_each_call_takes_its_path(paths, variant, backend, seq_len, grad, padded, expected):
    if backend == "torch+c" and not HAS_C:
        pytest.skip("no C compiler")
    module = make_rotary(4, 2, dtype=torch.float32, **VARIANTS[variant])
    lengths = torch.tensor([seq_len, seq_len - 1 if seq_len > 1 else 0]) if padded else None
    actual, reference = run(module, paths, backend, seq_len, grad, lengths)
    assert paths == expected
    assert_same(actual, reference)


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seq_len", [5, 1])
def test_planned_calls_take_the_entry(paths, variant, seq_len):
    """The first ``"torch+c"`` call plans (through Python); the next ones go through the plan's CPython entry where
    Python's headers let it be built, with the same results bit for bit."""
    module = make_rotary(4, 2, dtype=torch.float32, **VARIANTS[variant])
    with torch.no_grad():
        _, _, state = module(*inputs(3, seed=1), backend="torch")
        paths.clear()
        first, second = (module(*inputs(seq_len), state=state, backend="torch+c") for _ in range(2))
    assert paths == ["c", "c_entry" if rotary_cpu_entry.python_include() is not None else "c"]
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][name], second[2][name]) for name in first[2])


@pytest.mark.skipif(not HAS_C, reason="no C compiler")
def test_hooked_phase_module_leaves_the_c_kernel(paths):
    """A forward hook on a phase module must see it run: the torch paths, not the C kernel."""
    module = make_rotary(4, 2, dtype=torch.float32)
    calls = []
    module.phase_proj.register_forward_hook(lambda *args: calls.append(1))
    for seq_len, path in ((5, "sequence_torch"), (1, "step_torch")):
        actual, reference = run(module, paths, "torch+c", seq_len)
        assert paths == [path, path]
        assert_same(actual, reference)
    assert calls


@pytest.mark.parametrize("backend, expected", [("torch", ["sequence_torch"]), ("torch+c", ["c"])])
def test_packed_sequences_become_rows_off_triton(paths, backend, expected):
    """Off the Triton backend a packed call is one dense row per sequence, each then on its backend's path."""
    if backend == "torch+c" and not HAS_C:
        pytest.skip("no C compiler")
    module = make_rotary(4, 2, dtype=torch.float32)
    x, q, k = inputs(7, batch=1)
    cu_seqlens = torch.tensor([0, 3, 7])
    with torch.no_grad():
        packed = module(x, q, k, cu_seqlens=cu_seqlens, backend=backend)
        rows = [module(x[:, a:b], q[:, a:b], k[:, a:b], backend="torch") for a, b in ((0, 3), (3, 7))]
    assert paths == expected + ["sequence_torch"] * 2
    torch.testing.assert_close(packed[0], torch.cat([r[0] for r in rows], 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[2]["phase"], torch.cat([r[2]["phase"] for r in rows]), rtol=1e-9, atol=1e-6)
    assert not rotary.takes_packed(backend) and rotary.takes_packed("triton")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (run here under its interpreter)")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seq_len, expected", [(4, "sequence_triton"), (1, "step_triton")])
def test_triton_paths(paths, monkeypatch, variant, seq_len, expected):
    """On ``"triton"``: the Triton op for sequences, the fused step for one token per row; both compute the phase
    inputs themselves for the default phase path only (``fusable_phase_weights``): the sequence through the fused op
    from the input."""
    from selective_rope.kernels import rotary_triton

    fused = []
    original = rotary_triton.selective_rotary_decode_from_input_triton

    def counted(*args, **kwargs):
        fused.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(rotary_triton, "selective_rotary_decode_from_input_triton", counted)
    module = make_rotary(4, 2, dtype=torch.float32, **VARIANTS[variant])
    actual, reference = run(module, paths, "triton", seq_len)
    torch_path = "step_torch" if seq_len == 1 else "sequence_torch"
    if seq_len > 1 and variant == "selective_rope":
        expected = "sequence_from_input_triton"
    assert paths == [expected, torch_path]
    assert len(fused) == (seq_len == 1 and variant == "selective_rope")
    for a, e in zip(actual[:2], reference[:2]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(actual[2]["phase"], reference[2]["phase"], rtol=1e-6, atol=1e-5)
