"""The compiled CPU decoding step (kernels/rotary_cpu.py): equal to the torch step it replaces, declined wherever
the torch step must run (hooks, adapters, unusual tensors), and a build cache that never loses a file."""

from __future__ import annotations

import copy
import ctypes
import gc
import io
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from selective_rope.kernels import rotary_cpu, rotary_cpu_entry
from selective_rope.modeling.rotary import PhaseLinear

from rotary_reference import HEADS, HIDDEN, ROTATING_GRID, make_rotary, rotate_exactly

pytestmark = pytest.mark.skipif(rotary_cpu.find_compiler() is None, reason="no C compiler")


def step_inputs(module, heads=(4, 2), dtype=torch.float32, cached_tokens=5):
    """A cached state from a prefill of ``cached_tokens`` and the next token's ``(x, q, k)`` in ``dtype``, 2 rows."""
    x = torch.randn(2, cached_tokens + 1, HIDDEN)
    q, k = torch.randn(2, cached_tokens + 1, heads[0], 8), torch.randn(2, cached_tokens + 1, heads[1], 8)
    with torch.no_grad():
        _, _, state = module(x[:, :cached_tokens], q[:, :cached_tokens], k[:, :cached_tokens])
    return state, (x[:, cached_tokens:].to(dtype), q[:, cached_tokens:].to(dtype), k[:, cached_tokens:].to(dtype))


class StepCounter:
    """Counts the compiled calls that ran, through the CPython entry (``rotary_cpu_entry``) or through Python
    (``try_call`` returning a result): single-token steps in ``count``, longer calls (prefills) in ``prefills``."""

    def __init__(self, monkeypatch):
        self.python_steps = self.python_prefills = 0
        self.entry_before = rotary_cpu_entry.served()
        original = rotary_cpu.RotaryPlan.try_call

        def counted(plan, x, *args, **kwargs):
            result = original(plan, x, *args, **kwargs)
            if result is not None and x.shape[1] == 1:
                self.python_steps += 1
            elif result is not None:
                self.python_prefills += 1
            return result

        monkeypatch.setattr(rotary_cpu.RotaryPlan, "try_call", counted)

    def entry_served(self) -> tuple[int, int]:
        return tuple(now - before for now, before in zip(rotary_cpu_entry.served(), self.entry_before))

    @property
    def count(self) -> int:
        return self.python_steps + self.entry_served()[0]

    @property
    def prefills(self) -> int:
        return self.python_prefills + self.entry_served()[1]


@pytest.fixture
def compiled_steps(monkeypatch):
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")
    return StepCounter(monkeypatch)


def both_steps(module, step, state, monkeypatch, lengths=None):
    """(compiled, torch) results of one decoding step from the same state."""
    with torch.no_grad():
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")
        compiled = module(*step, state=state, lengths=lengths)  # "auto" resolves to "torch+c" on the CPU
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
        reference = module(*step, state=state, lengths=lengths, backend="torch")
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")
    return compiled, reference


def assert_same_step(compiled, reference, qk_tolerance=1e-6):
    (q, k, state), (q_ref, k_ref, state_ref) = compiled, reference
    assert q.dtype == q_ref.dtype and k.dtype == k_ref.dtype and q.shape == q_ref.shape and k.shape == k_ref.shape
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=qk_tolerance, atol=qk_tolerance)
    torch.testing.assert_close(k.float(), k_ref.float(), rtol=qk_tolerance, atol=qk_tolerance)
    assert state.keys() == state_ref.keys()
    for name in state_ref:
        assert state[name].dtype == state_ref[name].dtype == torch.float64 and state[name].is_contiguous(), name
        torch.testing.assert_close(state[name], state_ref[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_compiled_step_equals_torch_step(options, heads, param_dtype, monkeypatch, compiled_steps):
    """Every option set (projections, convolutions, gates, bias, temperatures, partial rotary, RoPE), from a cached
    state, for a pad token and from no state at all."""
    module = make_rotary(*heads, dtype=param_dtype, **options)
    state, step = step_inputs(module, heads)
    for cached, lengths in [(state, None), (state, torch.tensor([1, 0])), (None, None)]:
        compiled, reference = both_steps(module, step, cached, monkeypatch, lengths)
        assert_same_step(compiled, reference)
        if lengths is not None:  # the pad row keeps its phase and history
            for name in cached:
                torch.testing.assert_close(compiled[2][name][1], cached[name][1])
    assert compiled_steps.count == 3


@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@torch.no_grad()
def test_an_overwritten_state_equals_a_new_one(options, monkeypatch, compiled_steps):
    """``overwrite_state=True`` (the model's cache) writes the new phase and history into the given tensors, with the
    very values a new state gets, for a decoding step, a padded row and a prefill long enough for threads; without
    it the given state is never touched, and a state the C code cannot write (not contiguous) is not overwritten."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    state, step = step_inputs(module)
    long_x, long_q, long_k = torch.randn(2, 2100, HIDDEN), torch.randn(2, 2100, 4, 8), torch.randn(2, 2100, 2, 8)
    calls = [(step, torch.tensor([1, 0])), (step, None), ((long_x, long_q, long_k), torch.tensor([2100, 1500]))]
    for inputs, lengths in calls:
        given = {name: t.clone() for name, t in state.items()}
        q, k, new = module(*inputs, state=given, lengths=lengths)
        for name in state:  # not asked to: untouched
            assert torch.equal(given[name], state[name]) and new[name] is not given[name], name
        q_over, k_over, overwritten = module(*inputs, state=given, lengths=lengths, overwrite_state=True)
        assert torch.equal(q_over, q) and torch.equal(k_over, k)
        for name in state:
            assert overwritten[name] is given[name] and torch.equal(given[name], new[name]), name
    assert compiled_steps.count == 4 and compiled_steps.prefills == 3  # (one made the state)

    strided = {name: t.clone() for name, t in state.items()}
    strided["phase"] = state["phase"].transpose(0, -1).contiguous().transpose(0, -1)  # (2, Hk, R), not contiguous
    assert not strided["phase"].is_contiguous()
    before = {name: t.clone() for name, t in strided.items()}
    q_over, k_over, overwritten = module(*step, state=strided, overwrite_state=True)
    q, k, new = module(*step, state=state)
    assert torch.equal(q_over, q) and torch.equal(overwritten["phase"], new["phase"])
    assert overwritten["phase"] is not strided["phase"] and torch.equal(strided["phase"], before["phase"])


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_compiled_prefill_equals_torch_prefill(options, heads, param_dtype, monkeypatch, compiled_steps):
    """Every option set, 37 tokens (four blocks of 8 and a partial one): from no state, continuing a cached state
    with right-padded rows (the pads add nothing and keep the history), and with an empty row."""
    module = make_rotary(*heads, dtype=param_dtype, **options)
    x, q, k = torch.randn(2, 45, HIDDEN), torch.randn(2, 45, heads[0], 8), torch.randn(2, 45, heads[1], 8)
    with torch.no_grad():
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
        _, _, state = module(x[:, :8], q[:, :8], k[:, :8])
    prefill = (x[:, 8:], q[:, 8:], k[:, 8:])
    for cached, lengths in [(None, None), (state, torch.tensor([37, 20])), (state, torch.tensor([0, 37]))]:
        compiled, reference = both_steps(module, prefill, cached, monkeypatch, lengths)
        assert_same_step(compiled, reference)
        if lengths is not None and lengths[0] == 0:  # the empty row keeps its phase and history
            for name in cached:
                torch.testing.assert_close(compiled[2][name][0], cached[name][0], rtol=0, atol=0)
    assert compiled_steps.prefills == 3


@torch.no_grad()
@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_prefill_in_any_pieces_equals_decoding_exactly(options, monkeypatch, compiled_steps):
    """The compiled prefill and decoding step are one piece of C run over the tokens in order, so a sequence split
    anywhere (one call, chunks of 3, 8 or 13 tokens, token by token) gives bit-identical q, k and state, pads
    included. One call of 3 rows by 40 tokens reads its parameters widened to float64 first, the single-token
    steps read them as they are: the same numbers."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    seq_len = 40
    x, q, k = torch.randn(3, seq_len, HIDDEN), torch.randn(3, seq_len, 4, 8), torch.randn(3, seq_len, 2, 8)
    lengths = torch.tensor([seq_len, 29, 3])

    def run(chunk):
        state, outputs = None, []
        for start in range(0, seq_len, chunk):
            stop = min(start + chunk, seq_len)
            real = (lengths - start).clamp(0, stop - start)  # right-padded within the chunk
            q_out, k_out, state = module(x[:, start:stop], q[:, start:stop], k[:, start:stop], state=state,
                                         lengths=real)
            outputs.append(torch.cat([q_out, k_out], dim=2))
        return torch.cat(outputs, 1), state

    whole, state = run(seq_len)
    assert compiled_steps.prefills == 1
    for chunk in (13, 8, 3, 1):
        pieces, pieces_state = run(chunk)
        assert torch.equal(pieces, whole), chunk
        assert pieces_state.keys() == state.keys() and all(torch.equal(pieces_state[n], state[n]) for n in state)
    assert compiled_steps.count == seq_len + 2  # token by token, and the last token of the 13 and 3 chunkings


@torch.no_grad()
@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_long_prefill_on_threads_is_bit_identical(options, monkeypatch, compiled_steps):
    """A long row is split between torch's threads (each part's increments after the tokens before it, the phase at
    each part's start summed in order on one thread): the same q, k and state bit for bit with 1, 2 or 3 threads,
    continuing a cached state, with shorter padded rows (one of 300 tokens); and the torch path's values to rounding."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    seq_len = 1600  # parts of at least 128 real tokens: as many as threads for each row (the third: 2 at most)
    x, q, k = torch.randn(3, seq_len, HIDDEN), torch.randn(3, seq_len, 4, 8), torch.randn(3, seq_len, 2, 8)
    lengths = torch.tensor([seq_len, 1100, 300])
    _, _, state = module(x[:, :40], q[:, :40], k[:, :40])
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)  # (restored by conftest's autouse fixture)
        results.append(module(x, q, k, state=state, lengths=lengths))
    for q_out, k_out, new_state in results[1:]:
        assert torch.equal(q_out, results[0][0]) and torch.equal(k_out, results[0][1])
        assert all(torch.equal(new_state[name], results[0][2][name]) for name in state)
    assert compiled_steps.prefills == 4
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
    reference = module(x, q, k, state=state, lengths=lengths)
    assert_same_step(results[-1], reference, qk_tolerance=1e-5)


def mapped_openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes this process has mapped (Linux)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line or "libiomp" in line}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_long_rows_run_on_torchs_own_openmp_runtime(compiled_steps):
    """The library's threads are torch's: loading it maps no second OpenMP runtime next to the one torch brought."""
    before = mapped_openmp_runtimes()
    if not before:
        pytest.skip("torch runs without a loaded OpenMP runtime here")
    module = make_rotary(4, 2, dtype=torch.float32)
    with torch.no_grad():
        module(torch.randn(1, 1100, HIDDEN), torch.randn(1, 1100, 4, 8), torch.randn(1, 1100, 2, 8))
    assert compiled_steps.prefills == 1
    assert mapped_openmp_runtimes() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_on_one_thread_runs_long_rows(tmp_path):
    """After the parent ran long rows on torch's OpenMP threads, a forked child that sets one thread (as DataLoader
    workers do; OpenMP's pool does not survive fork) computes the same results instead of hanging."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from rotary_reference import HIDDEN, make_rotary
        torch.manual_seed(0)
        torch.set_num_threads(2)
        module = make_rotary(4, 2, dtype=torch.float32)
        x, q, k = torch.randn(1, 1600, HIDDEN), torch.randn(1, 1600, 4, 8), torch.randn(1, 1600, 2, 8)
        with torch.no_grad():
            parent = module(x, q, k)[0]
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            with torch.no_grad():
                child = module(x, q, k)[0]
            os._exit(0 if torch.equal(child, parent) else 3)
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SELECTIVE_ROPE_CPU_KERNEL": "1"})
    assert run.returncode == 0, run.stderr[-3000:]


@torch.no_grad()
def test_a_compiler_without_openmp_gives_a_one_thread_library_with_the_same_results(tmp_path, monkeypatch,
                                                                                   compiled_steps):
    """Where ``-fopenmp`` fails (e.g. clang without libomp) the build retries without it; that library runs a long
    row on one thread whatever torch's thread count, with the OpenMP library's numbers bit for bit."""
    no_openmp = tmp_path / "cc-without-openmp"
    real = rotary_cpu.find_compiler()
    no_openmp.write_text('#!/bin/sh\nfor arg in "$@"; do [ "$arg" = -fopenmp ] && exit 1; done\n'
                         f'exec {shlex.join(real)} "$@"\n')
    no_openmp.chmod(0o755)
    library = rotary_cpu.build(tmp_path / "cache", str(no_openmp))
    assert b"GOMP_parallel" not in library.read_bytes()
    assert b"GOMP_parallel" in rotary_cpu.build(rotary_cpu.cache_dir(), real).read_bytes()  # the usual build's
    serial = ctypes.CDLL(str(library)).selective_rope_rotary
    serial.argtypes, serial.restype = rotary_cpu._ARGTYPES, ctypes.c_int

    module = make_rotary(4, 2, dtype=torch.float32, phase_conv_type="learned")
    x, q, k = torch.randn(1, 1600, HIDDEN), torch.randn(1, 1600, 4, 8), torch.randn(1, 1600, 2, 8)
    torch.set_num_threads(2)  # (restored by conftest's autouse fixture)
    threaded = module(x, q, k)
    monkeypatch.setattr(rotary_cpu, "_kernel", serial)
    del module.__dict__["_cpu_plan"]  # planned again, with the serial library's function (the entry calls it too)
    one_thread = module(x, q, k)
    assert compiled_steps.prefills == 2
    assert torch.equal(one_thread[0], threaded[0]) and torch.equal(one_thread[1], threaded[1])
    assert all(torch.equal(one_thread[2][name], threaded[2][name]) for name in threaded[2])


def test_training_takes_the_compiled_training_path(monkeypatch, compiled_steps):
    """With autograd on, a sequence runs the compiled training path (rotary_cpu_train: this forward, and a C
    backward; its gradients are tested in test_rotary_cpu_train.py), and gradients reach the inputs and the phase
    parameters."""
    module = make_rotary(4, 2, dtype=torch.float32)
    x = torch.randn(2, 12, HIDDEN, requires_grad=True)
    q, k = torch.randn(2, 12, 4, 8), torch.randn(2, 12, 2, 8)
    q_out, k_out, _ = module(x, q, k)
    (q_out.square().sum() + k_out.square().sum() + (q_out * k_out.repeat_interleave(2, 2)).sum()).backward()
    assert compiled_steps.prefills == 1 and compiled_steps.count == 0
    assert type(q_out.grad_fn).__name__ == "CompiledRotaryTrainingBackward"
    assert x.grad.abs().sum() > 0 and module.phase_proj.down.grad.abs().sum() > 0


@pytest.mark.parametrize("options", [dict(), dict(position_embedding="rope"),
                                     dict(phase_conv_type="difference", phase_gate_type="channel")], ids=str)
def test_bfloat16_steps(options, monkeypatch, compiled_steps):
    """bf16 q, k and input (a bf16 model; the rotary parameters stay float32), a decoding step and a prefill: the
    rotation is computed in float32 and rounded to bf16 once, as the torch path does, so the two agree to one bf16
    rounding at most."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    state, step = step_inputs(module, dtype=torch.bfloat16)
    compiled, reference = both_steps(module, step, state, monkeypatch)
    assert compiled[0].dtype == torch.bfloat16
    assert_same_step(compiled, reference, qk_tolerance=2 ** -7)
    assert compiled_steps.count == 1
    prefill = (torch.randn(2, 20, HIDDEN), torch.randn(2, 20, 4, 8), torch.randn(2, 20, 2, 8))
    compiled, reference = both_steps(module, tuple(t.bfloat16() for t in prefill), state, monkeypatch)
    assert compiled[0].dtype == torch.bfloat16
    assert_same_step(compiled, reference, qk_tolerance=2 ** -7)
    assert compiled_steps.prefills == 2  # step_inputs' and this one


@torch.no_grad()
def test_many_steps_equal_torch_steps(monkeypatch, compiled_steps):
    """2048 steps each way from the same start, with a pad row: the phases never drift apart (both sum float64
    phases from the same float32 increments) and every rotated q and k agrees."""
    module = make_rotary(4, 2, dtype=torch.float32, phase_bias=True, phase_conv_activation="silu")
    steps = 2048
    x, q, k = torch.randn(2, steps, HIDDEN), torch.randn(2, steps, 4, 8), torch.randn(2, steps, 2, 8)
    lengths = torch.tensor([1, 1])
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, switch)
        state, outputs = None, []
        for t in range(steps):
            lengths[1] = int(t % 7 != 3)  # the second row sees a pad token every 7 steps
            q_t, k_t, state = module(x[:, t:t + 1], q[:, t:t + 1], k[:, t:t + 1], state=state, lengths=lengths)
            outputs.append(torch.cat([q_t, k_t], dim=2))
        results[switch] = torch.cat(outputs, 1), state
    assert compiled_steps.count == steps
    (compiled, state), (reference, state_ref) = results["1"], results["0"]
    assert state["phase"].abs().max() > 100
    torch.testing.assert_close(state["phase"], state_ref["phase"], rtol=0, atol=1e-9)
    torch.testing.assert_close(compiled, reference, rtol=0, atol=1e-5)


@torch.no_grad()
def test_the_torch_backend_by_name_stays_pure_pytorch(monkeypatch, compiled_steps):
    """``backend="torch"`` (config or ``SELECTIVE_ROPE_BACKEND``) is the pure-PyTorch reference; ``"auto"`` (the
    default) and ``"triton"`` (which falls back to PyTorch on the CPU) get the compiled step."""
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = step_inputs(module)
    monkeypatch.setenv("SELECTIVE_ROPE_BACKEND", "torch")
    module(*step, state=state)
    assert compiled_steps.count == 0
    monkeypatch.delenv("SELECTIVE_ROPE_BACKEND")
    module.backend = "torch"
    module(*step, state=state)
    assert compiled_steps.count == 0
    module.backend = "auto"
    module(*step, state=state)
    assert compiled_steps.count == 1


def test_hooks_adapters_and_unknown_tensors_take_the_torch_step(monkeypatch, compiled_steps):
    """Whatever must see the phase modules run, does: a forward hook on one of them, a global forward hook, a PEFT
    adapter on the phase gate. Tensors the C step does not read (fp16) go to the torch step too."""
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = step_inputs(module)
    calls = []
    handle = module.phase_proj.register_forward_hook(lambda *args: calls.append(1))
    compiled, reference = both_steps(module, step, state, monkeypatch)
    assert calls == [1, 1] and compiled_steps.count == 0
    handle.remove()
    both_steps(module, step, state, monkeypatch)
    assert compiled_steps.count == 1  # the hook is gone: compiled again

    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: calls.append(2))
    try:
        both_steps(module, step, state, monkeypatch)
    finally:
        handle.remove()
    assert calls.count(2) > 0 and compiled_steps.count == 1

    half = tuple(t.half() for t in step)
    with torch.no_grad():
        q, k, _ = module(*half, state=state, backend="torch+c")
    assert q.dtype == torch.float16 and compiled_steps.count == 1

    plain, _ = both_steps(module, step, state, monkeypatch)
    wrapped = inject_adapter_in_model(LoraConfig(target_modules=["phase_gate_proj"], init_lora_weights=False),
                                      module)
    compiled, reference = both_steps(wrapped, step, state, monkeypatch)
    assert compiled_steps.count == 2  # the step before the adapter was compiled, the one with it was not
    assert_same_step(compiled, reference)
    assert not torch.allclose(compiled[1], plain[1])  # the adapter changed the phase
    with torch.enable_grad():  # the general path, which always calls the modules
        general = wrapped(*step, state=state)
    torch.testing.assert_close(compiled[1], general[1].detach(), rtol=0, atol=1e-6)


@torch.no_grad()
def test_a_traced_step_is_the_torch_step(monkeypatch, compiled_steps):
    """``torch.jit.trace`` records tensor ops; the C call's writes would be invisible to it (a traced graph returning
    empty tensors), so tracing takes the torch step, and the traced function reproduces the module."""
    module = make_rotary(4, 2, dtype=torch.float32).requires_grad_(False)  # the trace holds them as constants
    state, step = step_inputs(module)
    other = tuple(torch.randn_like(t) for t in step)

    def rotate(x, q, k):
        q_out, k_out, _ = module(x, q, k, state=state)
        return q_out, k_out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace's deprecation and tracer warnings
        traced = torch.jit.trace(rotate, step, check_trace=False)
    assert compiled_steps.count == 0
    for got, expected in zip(traced(*other), rotate(*other)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert compiled_steps.count == 1  # the eager call


def test_swapped_replaced_and_cast_parameters_are_seen(monkeypatch, compiled_steps):
    """A plan reads parameters in place; a parameter swapped for another, a storage replaced (``.data =``), a module
    replaced or the whole module cast: the next step uses what the module holds now."""
    module = make_rotary(4, 2, dtype=torch.float32, phase_bias=True)
    state, step = step_inputs(module)
    both_steps(module, step, state, monkeypatch)
    with torch.no_grad():
        module.phase_proj.up.mul_(2.0)  # in place: the same storage
    assert_same_step(*both_steps(module, step, state, monkeypatch))
    module.phase_proj.down = torch.nn.Parameter(torch.randn_like(module.phase_proj.down))
    assert_same_step(*both_steps(module, step, state, monkeypatch))
    module.phase_bias.data = torch.randn_like(module.phase_bias)
    assert_same_step(*both_steps(module, step, state, monkeypatch))
    module.phase_gate_proj = copy.deepcopy(module.phase_gate_proj)
    with torch.no_grad():
        module.phase_gate_proj.bias.add_(1.0)
    assert_same_step(*both_steps(module, step, state, monkeypatch))
    module.double()
    assert_same_step(*both_steps(module, step, state, monkeypatch))
    assert compiled_steps.count == 6
    module.phase_proj.down.data = module.phase_proj.down.data.float()  # mixed dtypes: the torch step
    assert_same_step(*both_steps(module, step, state, monkeypatch))
    assert compiled_steps.count == 6


def test_a_bias_or_gate_added_after_planning_is_seen(monkeypatch, compiled_steps):
    """A module made without phase bias and gate holds them as plain ``None`` attributes (in no parameter or child
    dict); one set later (a parameter, a module) changes the phase, and the next step uses it."""
    module = make_rotary(4, 2, dtype=torch.float32, phase_bias=False, phase_gate=False)
    state, step = step_inputs(module)
    plain, _ = both_steps(module, step, state, monkeypatch)
    module.phase_bias = torch.nn.Parameter(torch.randn(2, module.rotary_pairs))
    with_bias, reference = both_steps(module, step, state, monkeypatch)
    assert_same_step(with_bias, reference)
    assert not torch.allclose(with_bias[1], plain[1])
    module.phase_gate_proj = PhaseLinear(HIDDEN, 2, bias=True)
    with_gate, reference = both_steps(module, step, state, monkeypatch)
    assert_same_step(with_gate, reference)
    assert not torch.allclose(with_gate[1], with_bias[1])
    assert compiled_steps.count == 3


def test_a_layer_added_to_a_sequential_gate_is_seen(monkeypatch, compiled_steps):
    """A two-layer gate is an ``nn.Sequential``, whose forward runs every child it has: one appended after planning
    changes the phase, and the step follows it (the C code knows no such gate: the torch step runs)."""
    module = make_rotary(4, 2, dtype=torch.float32, phase_gate_type="low_rank")
    state, step = step_inputs(module)
    plain, _ = both_steps(module, step, state, monkeypatch)
    assert compiled_steps.count == 1 and isinstance(module.phase_gate_proj, torch.nn.Sequential)
    module.phase_gate_proj.append(torch.nn.Tanh())
    compiled, reference = both_steps(module, step, state, monkeypatch)
    assert compiled_steps.count == 1
    assert_same_step(compiled, reference)
    assert not torch.allclose(compiled[1], plain[1])


def test_copies_and_pickles_hold_no_plan(monkeypatch, compiled_steps):
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = step_inputs(module)
    expected, _ = both_steps(module, step, state, monkeypatch)
    assert module.__dict__["_cpu_plan"].plan is not None
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(module), torch.load(buffer, weights_only=False)):
        assert clone.__dict__.get("_cpu_plan") is None
        compiled, reference = both_steps(clone, step, state, monkeypatch)
        assert_same_step(compiled, reference)
        assert_same_step(compiled, expected)
    assert compiled_steps.count == 3


def test_a_planned_module_is_freed_without_the_garbage_collector(monkeypatch, compiled_steps):
    """The cached plan refers to no module that refers back to it: deleting a model frees it at once (a reference
    cycle would keep its memory until the next collection)."""
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = step_inputs(module)
    both_steps(module, step, state, monkeypatch)
    assert compiled_steps.count == 1
    alive = weakref.ref(module)
    gc.disable()
    try:
        del module
        assert alive() is None
    finally:
        gc.enable()


def test_plan_rejects_inputs_that_do_not_fit():
    temperature = torch.rand(4)
    with pytest.raises(ValueError, match="disagree"):
        rotary_cpu.RotaryPlan(3, 2, 8, 16, temperature)  # Hq not a multiple of Hk
    with pytest.raises(ValueError, match="projection a"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature, projection=("low_rank", torch.rand(2, 3, 7),
                                                                        torch.rand(2, 4, 3)))
    with pytest.raises(ValueError, match="float32 or float64"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature.half())
    with pytest.raises(ValueError, match="convolution: missing"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature, conv=("learned", None, None))
    with pytest.raises(ValueError, match="unknown projection"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature, projection=("diagonal", None, None))
    with pytest.raises(ValueError, match="projection a: missing"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature, projection=("low_rank", None, torch.rand(2, 4, 3)))
    plan = rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature)
    x, q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8)
    with pytest.raises(ValueError, match="this plan takes"):
        plan.try_call(x, torch.randn(1, 1, 2, 8), k)
    with pytest.raises(ValueError, match="phase"):
        plan.try_call(x, q, k, phase=torch.zeros(1, 2, 4))  # float32
    assert plan.try_call(x, q.half(), k.half()) is None
    assert plan.try_call(x, q.transpose(2, 3).contiguous().transpose(2, 3), k) is None  # strided last dim
    q_out, k_out, phase, history = plan.try_call(x, q, k)  # RoPE from no state: rotated by τ · 1
    assert history is None
    torch.testing.assert_close(phase, torch.ones(1, 2, 4, dtype=torch.float64))
    ones = torch.ones(1, 1, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(q_out.double(), rotate_exactly(q, ones, temperature), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out.double(), rotate_exactly(k, ones[:, :, :2], temperature), rtol=0, atol=1e-6)



class Marked(torch.Tensor):
    """A tensor subclass that adds nothing: still not the plain tensor the C code may read (a subclass may keep its
    values anywhere)."""


def _unreadable(tensor, form):
    """``(tensor as the C code must not read it, the same values as a plain tensor)``."""
    if form == "negated":  # a lazy negation: the memory holds -values
        return torch._neg_view(tensor.neg()), tensor
    if form == "zero":  # an efficient zero tensor: no memory at all (data_ptr 0)
        return torch._efficientzerotensor(tensor.shape, dtype=tensor.dtype), torch.zeros_like(tensor)
    return tensor.as_subclass(Marked), tensor


@pytest.mark.parametrize("form", ["negated", "zero", "subclass"])
@pytest.mark.parametrize("where", ["x", "q", "k", "phase", "phase_conv", "lengths"])
@torch.no_grad()
def test_tensors_the_c_step_cannot_read_take_the_torch_step(where, form, monkeypatch, compiled_steps):
    """x, q, k, the cached phase and history and the lengths: a lazily negated view, a tensor without memory (an
    efficient zero tensor) or a subclass is never handed to the C code (before, the first two were read as the wrong
    values or at address 0, a segmentation fault): the step runs PyTorch and gives what the same values as plain
    tensors give."""
    if form == "zero" and where == "lengths":
        pytest.skip("torch has no integer zero tensors")
    module = make_rotary(4, 2, dtype=torch.float32, phase_conv_type="learned")
    state, (x, q, k) = step_inputs(module)
    lengths = torch.tensor([1, 0])
    inputs = dict(x=x, q=q, k=k, lengths=lengths, **state)
    odd, plain = _unreadable(inputs[where], form)
    given, expected_inputs = {**inputs, where: odd}, {**inputs, where: plain}

    def call(values, backend=None):
        return module(values["x"], values["q"], values["k"], lengths=values["lengths"], backend=backend,
                      state={"phase": values["phase"], "phase_conv": values["phase_conv"]})

    got = call(given)
    assert compiled_steps.count == 0
    assert_same_step(got, call(expected_inputs, backend="torch"))


@pytest.mark.parametrize("form", ["negated", "zero", "subclass", "sparse", "meta", "transposed"])
def test_plan_refuses_parameters_the_c_code_cannot_read(form):
    """Every parameter is checked when planned, structurally: a tensor of the right dtype and shape that is a
    subclass, a lazily negated view, without memory, not strided, not on the CPU or not contiguous is refused
    (the module then runs PyTorch)."""
    temperature, bias = torch.rand(4), torch.rand(2, 4)
    odd = {"negated": lambda: torch._neg_view(bias), "zero": lambda: torch._efficientzerotensor(2, 4),
           "subclass": lambda: bias.as_subclass(Marked), "sparse": lambda: bias.to_sparse(),
           "meta": lambda: bias.to("meta"), "transposed": lambda: torch.rand(4, 2).t()}[form]()
    assert odd.shape == bias.shape and odd.dtype == bias.dtype
    rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature, bias=bias)  # the plain one is planned
    with pytest.raises(ValueError, match="bias: expected a plain contiguous CPU"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, temperature, bias=odd)
    with pytest.raises(ValueError, match="temperature: expected a plain contiguous CPU"):
        rotary_cpu.RotaryPlan(4, 2, 8, 16, odd[0])


@torch.no_grad()
def test_a_torchao_quantized_phase_gate_takes_the_torch_step(monkeypatch, compiled_steps):
    """torchao's int8 weight-only quantization turns the phase gate (a ``Linear``) into an ``Int8Tensor``: float32
    and the gate's shape to anyone who asks, int8 data elsewhere, ``data_ptr()`` 0. Planned as a plain weight, the C
    code read address 0 (a segmentation fault, issue 41). The plan refuses it; the step runs PyTorch and equals the
    torch step of the same module with the dequantized weight."""
    torchao = pytest.importorskip("torchao.quantization")
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = step_inputs(module)  # (the prefill planned and ran the C code: the gate was plain then)
    served = compiled_steps.count, compiled_steps.prefills
    reference = copy.deepcopy(module)
    torchao.quantize_(module, torchao.Int8WeightOnlyConfig())
    weight = module.phase_gate_proj.weight
    assert type(weight) is not torch.nn.Parameter and weight.dtype == torch.float32 and weight.data_ptr() == 0
    with pytest.raises(ValueError, match="gate: expected a plain contiguous CPU"):
        rotary_cpu.RotaryPlan(4, 2, 8, HIDDEN, module.temperature, projection=("low_rank", module.phase_proj.down,
                              module.phase_proj.up), conv=("learned", module.phase_conv.weight, None),
                              gate=((weight, module.phase_gate_proj.bias),))
    reference.phase_gate_proj.weight.copy_(weight.dequantize())
    for lengths in (None, torch.tensor([1, 0])):
        got = module(*step, state=state, lengths=lengths)
        assert_same_step(got, reference(*step, state=state, lengths=lengths, backend="torch"))
    # A prefill: torchao computes its int8 product in its own order and precision (not the float64 of PhaseLinear's),
    # which over 40 tokens of phase moves q and k by ~4e-5
    prefill = tuple(torch.randn(2, 40, *shape) for shape in ((HIDDEN,), (4, 8), (2, 8)))
    q, k, new_state = module(*prefill)
    q_ref, k_ref, state_ref = reference(*prefill, backend="torch")
    torch.testing.assert_close((q, k), (q_ref, k_ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new_state, state_ref, rtol=1e-5, atol=1e-6)
    assert (compiled_steps.count, compiled_steps.prefills) == served


# The build cache: nothing it did not create is ever removed, and no half-written library is ever loaded.

def test_build_reuses_the_library_and_leaves_other_files_alone(tmp_path):
    compiler = rotary_cpu.find_compiler()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".rotary_0000.so").write_text("also mine")  # looks like a partial build; is not ours
    first = rotary_cpu.build(tmp_path, compiler)
    made = first.stat().st_mtime_ns
    assert rotary_cpu.build(tmp_path, compiler) == first and first.stat().st_mtime_ns == made
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, "notes.txt", ".rotary_0000.so"])
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / ".rotary_0000.so").read_text() == "also mine"


def test_failed_build_leaves_nothing_and_warns_once(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="exit code"):
        rotary_cpu.build(tmp_path, "false")  # a "compiler" that fails
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with pytest.raises(OSError):
        rotary_cpu.build(tmp_path / "notes.txt" / "cache", rotary_cpu.find_compiler())  # not a directory

    # $CC is a command, split as a shell would ("ccache gcc"): here `env` runs the real compiler
    monkeypatch.setenv("CC", "env " + shlex.join(rotary_cpu.find_compiler()))
    assert rotary_cpu.find_compiler()[0] == "env"
    library = rotary_cpu.build(tmp_path / "cc", rotary_cpu.find_compiler())
    assert library.exists()
    monkeypatch.delenv("CC")

    # The loader: a failure is one warning, then the torch step serves (and gives the same results).
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = step_inputs(module)
    with torch.no_grad():
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
        reference = module(*step, state=state)
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")
        monkeypatch.setattr(rotary_cpu, "_kernel", None)  # as in a fresh process: nothing loaded, nothing planned
        monkeypatch.setattr(rotary_cpu_entry, "_entry", None)
        del module.__dict__["_cpu_plan"]
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv(rotary_cpu.CACHE_ENV, str(tmp_path / "fresh"))
        with pytest.warns(RuntimeWarning, match="compiled CPU kernel is unavailable") as first_warnings:
            first = module(*step, state=state)
        with warnings.catch_warnings(record=True) as later_warnings:
            warnings.simplefilter("always")
            second = module(*step, state=state)
    assert len(first_warnings) == 1 and not later_warnings
    assert_same_step(first, reference)
    assert_same_step(second, reference)
    assert rotary_cpu._kernel is False and not any((tmp_path / "fresh").iterdir())  # no file left behind


def test_corrupt_library_is_not_loaded_nor_removed(tmp_path, monkeypatch):
    compiler = rotary_cpu.find_compiler()
    library = rotary_cpu.build(tmp_path, compiler)
    library.write_bytes(b"not a library")
    monkeypatch.setattr(rotary_cpu, "_kernel", None)
    monkeypatch.setenv(rotary_cpu.CACHE_ENV, str(tmp_path))
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert rotary_cpu.load_kernel() is None
    assert library.read_bytes() == b"not a library"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_build_publishes_no_partial_library(tmp_path, sig):
    """A build killed while its compiler writes: no library under the final name (a later build makes a whole one);
    an interrupt (SIGINT) also removes the build's own temporary files; other files stay."""
    slow = tmp_path / "slow-cc"
    started = tmp_path / "started"
    real = rotary_cpu.find_compiler()
    slow.write_text(f'#!/bin/sh\n{shlex.join(real)} "$@" && touch "{started}" && sleep 30\n')
    slow.chmod(0o755)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from selective_rope.kernels import rotary_cpu
        rotary_cpu.build(Path({str(cache)!r}), {str(slow)!r})
    """)
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the compiler never ran"
    process.send_signal(sig)
    process.wait(timeout=60)
    assert process.returncode != 0
    names = sorted(p.name for p in cache.iterdir())
    assert not any(name.startswith("rotary_") for name in names)  # nothing under a final name
    if sig == signal.SIGINT:
        assert names == ["notes.txt"]
    else:  # killed outright: its temporaries stay, hidden, under names no build reuses
        assert "notes.txt" in names and all(name.startswith(".rotary_") for name in names if name != "notes.txt")
    library = rotary_cpu.build(cache, real)
    assert library.exists() and (cache / "notes.txt").read_text() == "mine"
