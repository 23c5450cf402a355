"""The CPython entry to the compiled CPU rotary kernel (kernels/rotary_cpu_entry.py): it serves the rotary module's
inference calls with the Python path's results bit for bit, declines (and the Python path decides) wherever that path
would convert, plan again, raise or run PyTorch, and its absence costs nothing but speed."""

from __future__ import annotations

import collections
import contextlib
import sysconfig
import warnings

import pytest
import torch
from torch import nn

from selective_rope.kernels import rotary_cpu, rotary_cpu_entry

from rotary_reference import HIDDEN, ROTATING_GRID, make_rotary

pytestmark = [
    pytest.mark.skipif(rotary_cpu.find_compiler() is None, reason="no C compiler"),
    pytest.mark.skipif(rotary_cpu_entry.python_include() is None, reason="no Python headers (Python.h)"),
]

OPTION_IDS = [",".join(f"{k}={v}" for k, v in o.items()) or "default" for o in ROTATING_GRID]


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")


def served() -> int:
    return sum(rotary_cpu_entry.served())


@contextlib.contextmanager
def python_path(module):
    """The module's calls through Python only (the entry switched off for its current plan)."""
    cached = module.__dict__["_cpu_plan"]
    saved = cached.entry_call
    cached.entry_call = None
    try:
        yield
    finally:
        cached.entry_call = saved


def planned(module, batch=2, heads=(4, 2), dtype=torch.float32, cached_tokens=5, entry=True):
    """Plans ``module`` with a prefill of ``cached_tokens`` (through Python: the first call plans) and returns the
    state it left and the next token's ``(x, q, k)``; the plan has an entry, or (``entry=False``) none."""
    x = torch.randn(batch, cached_tokens + 1, HIDDEN)
    q, k = torch.randn(batch, cached_tokens + 1, heads[0], 8), torch.randn(batch, cached_tokens + 1, heads[1], 8)
    with torch.no_grad():
        _, _, state = module(x[:, :cached_tokens], q[:, :cached_tokens], k[:, :cached_tokens])
    assert (module.__dict__["_cpu_plan"].entry_call is not None) == entry
    return state, (x[:, cached_tokens:], q[:, cached_tokens:].to(dtype), k[:, cached_tokens:].to(dtype))


def outcome(call, *args, **kwargs):
    """``("result", q, k, state)`` or ``("error", type, message)``: what ``call(*args, **kwargs)`` gave, for
    comparing two paths."""
    try:
        q, k, state = call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (any error: both paths must raise the same)
        return "error", type(error), str(error)
    return "result", q, k, state


def assert_same_outcome(got, expected):
    assert got[0] == expected[0], (got, expected)
    if got[0] == "error":
        assert got[1:] == expected[1:]
        return
    (_, q, k, state), (_, q_ref, k_ref, state_ref) = got, expected
    assert q.dtype == q_ref.dtype and torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert state.keys() == state_ref.keys()
    assert all(torch.equal(state[name], state_ref[name]) for name in state)


def copy_state(state):
    return None if state is None else type(state)((name, tensor.clone()) for name, tensor in state.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", ROTATING_GRID, ids=OPTION_IDS)
@torch.no_grad()
def test_the_entry_gives_the_python_paths_results_bit_for_bit(options, dtype):
    """Every option set: a decoding step from a cached state, a padded row, no state at all, a long prefill on
    threads, with and without the state overwritten; each served by the entry (counted), each equal to the same call
    through Python, and an overwritten state is the given tensor itself on both paths."""
    module = make_rotary(4, 2, dtype=torch.float32, **options)
    state, step = planned(module, dtype=dtype)
    long = (torch.randn(2, 2100, HIDDEN), torch.randn(2, 2100, 4, 8).to(dtype), torch.randn(2, 2100, 2, 8).to(dtype))
    calls = [(step, state, None), (step, state, torch.tensor([1, 0])), (step, None, None),
             (long, state, torch.tensor([2100, 1500]))]
    torch.set_num_threads(2)  # (restored by conftest)
    for inputs, given, lengths in calls:
        for overwrite in (False, True):
            before = served()
            entry_state = copy_state(given)
            got = module(*inputs, state=entry_state, lengths=lengths, overwrite_state=overwrite)
            assert served() == before + 1
            python_state = copy_state(given)
            with python_path(module):
                expected = module(*inputs, state=python_state, lengths=lengths, overwrite_state=overwrite)
            assert served() == before + 1
            assert_same_outcome(("result", *got), ("result", *expected))
            for returned, kept in ((got[2], entry_state), (expected[2], python_state)):
                if kept is not None:  # overwritten in place exactly where asked
                    assert returned.keys() == kept.keys()
                    assert all((returned[name] is kept[name]) == overwrite for name in kept)
            if given is not None and not overwrite:
                assert all(torch.equal(entry_state[name], given[name]) for name in given)  # untouched


def perturbations():
    """(name, change) pairs: ``change(module, state, step, lengths)`` returns the call's new ``(state, step,
    lengths)`` (after altering the module where it says so), or a context manager's factory as a fourth item."""
    def grad(module, state, step, lengths):
        return state, step, lengths, torch.enable_grad

    def phase_float32(module, state, step, lengths):
        return {**state, "phase": state["phase"].float()}, step, lengths

    def phase_strided(module, state, step, lengths):
        return {**state, "phase": state["phase"].transpose(1, 2).contiguous().transpose(1, 2)}, step, lengths

    def history_strided(module, state, step, lengths):
        history = state["phase_conv"]
        return {**state, "phase_conv": history.transpose(1, 2).contiguous().transpose(1, 2)}, step, lengths

    def lengths_int32(module, state, step, lengths):
        return state, step, torch.tensor([1, 1], dtype=torch.int32)

    def lengths_wrong(module, state, step, lengths):
        return state, step, torch.tensor([1, 1, 1])

    def half_inputs(module, state, step, lengths):
        x, q, k = step
        return state, (x, q.half(), k.half()), lengths

    def strided_query(module, state, step, lengths):
        x, q, k = step
        return state, (x, q.transpose(2, 3).contiguous().transpose(2, 3), k), lengths

    def wrong_width(module, state, step, lengths):
        x, q, k = step
        return state, (torch.cat([x, x], -1), q, k), lengths

    def no_tokens(module, state, step, lengths):
        x, q, k = step
        return state, (x[:, :0], q[:, :0], k[:, :0]), lengths

    def ordered_state(module, state, step, lengths):
        return collections.OrderedDict(state), step, lengths

    class Marked(torch.Tensor):
        pass

    def subclass_query(module, state, step, lengths):
        x, q, k = step
        return state, (x, q.as_subclass(Marked), k), lengths

    def negated_query(module, state, step, lengths):  # a lazy negation: the memory holds -q
        x, q, k = step
        return state, (x, torch._neg_view(q.neg()), k), lengths

    def zero_key(module, state, step, lengths):  # an efficient zero tensor: no memory at all (data_ptr 0)
        x, q, k = step
        return state, (x, q, torch._efficientzerotensor(k.shape)), lengths

    def storage_replaced(module, state, step, lengths):
        module.phase_proj.down.data = module.phase_proj.down.data.clone() * 2
        return state, step, lengths

    def parameter_replaced(module, state, step, lengths):
        module.phase_proj.down = nn.Parameter(module.phase_proj.down.detach() * 2)
        return state, step, lengths

    def bias_added(module, state, step, lengths):
        module.phase_bias = nn.Parameter(torch.full((2, module.rotary_pairs), -1.0))
        return state, step, lengths

    def phase_hook(module, state, step, lengths):
        module.phase_proj.register_forward_hook(lambda *args: None)
        return state, step, lengths

    def global_hook(module, state, step, lengths):
        return state, step, lengths, lambda: nn.modules.module.register_module_forward_pre_hook(lambda *a: None)

    def default_device(module, state, step, lengths):  # outputs on the CPU all the same
        return state, step, lengths, lambda: torch.device("meta")

    return [grad, phase_float32, phase_strided, history_strided, lengths_int32, lengths_wrong, half_inputs,
            strided_query, wrong_width, no_tokens, ordered_state, subclass_query, negated_query, zero_key,
            storage_replaced, parameter_replaced, bias_added, phase_hook, global_hook, default_device]


TAKEN = {"phase_strided", "default_device"}  # cases the entry serves (as the Python path: any phase strides)


@contextlib.contextmanager
def entered(factory):
    """``factory()``'s context (a hook handle is removed afterwards), or none."""
    if factory is None:
        yield
        return
    value = factory()
    if hasattr(value, "remove"):
        try:
            yield
        finally:
            value.remove()
    else:
        with value:
            yield


@pytest.mark.parametrize("change", perturbations(), ids=lambda f: f.__name__)
def test_the_entry_declines_wherever_the_python_path_decides(change):
    """Each case the entry does not take (autograd, a state to convert, unusual tensors, a changed or observed
    module, a shape the plan does not fit): it serves nothing, and the call gives exactly what the same call through
    Python gives (the same result, or the same error). The cases in ``TAKEN`` it serves, with the same results (a
    default device set by the user: outputs on the CPU all the same)."""
    options = dict(phase_conv_type="learned")  # (and the default gate: per head)
    calls = []
    for through_python in (False, True):
        torch.manual_seed(1)
        module = make_rotary(4, 2, dtype=torch.float32, **options)
        state, step = planned(module)
        state, step, lengths, *factory = change(module, state, step, None)
        before = served()
        context = python_path(module) if through_python else contextlib.nullcontext()
        with context, torch.no_grad(), entered(factory[0] if factory else None):
            calls.append(outcome(module, *step, state=copy_state(state), lengths=lengths))
        calls.append(served() - before)
    (got, got_served), (expected, _) = calls[:2], calls[2:]
    assert_same_outcome(got, expected)
    assert got_served == (change.__name__ in TAKEN)
    if got[0] == "result":
        assert got[1].device.type == "cpu" and got[3]["phase"].device.type == "cpu"


@torch.no_grad()
def test_a_replanned_module_is_served_again():
    """After a parameter's storage is replaced, the Python path plans again and the next call goes through the entry
    with the new values (equal to the torch path's)."""
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = planned(module)
    module.phase_proj.down.data = module.phase_proj.down.data.clone() * 2
    module(*step, state=state)  # declined: planned again
    before = served()
    got = module(*step, state=state)
    assert served() == before + 1
    expected = module(*step, state=state, backend="torch")
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2]["phase"], expected[2]["phase"], rtol=0, atol=1e-12)


@torch.no_grad()
def test_models_decode_through_the_entry(family):
    """A model of every family: its cached decoding steps go through the entry, and greedy decoding gives the tokens
    and logits the Python path gives."""
    config = family.config_class(**family.tiny, position_embedding="selective_rope", phase_conv_type="learned")
    model = family.lm_class(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    before = served()
    with_entry = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    assert served() - before >= 5 * config.num_hidden_layers
    before = served()
    with contextlib.ExitStack() as stack:
        for module in model.modules():
            if "_cpu_plan" in module.__dict__:
                stack.enter_context(python_path(module))
        without = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert served() == before
    assert torch.equal(with_entry.sequences, without.sequences)
    assert all(torch.equal(a, b) for a, b in zip(with_entry.logits, without.logits))


def test_no_python_headers_means_the_ctypes_call_without_a_warning(tmp_path, monkeypatch):
    """Without ``Python.h`` nothing is built, nothing warns, and the kernel serves through ctypes."""
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths, "include": str(tmp_path / "include")})
    monkeypatch.setattr(rotary_cpu_entry, "_entry", None)
    monkeypatch.setenv(rotary_cpu.CACHE_ENV, str(tmp_path / "cache"))
    module = make_rotary(4, 2, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, step = planned(module, entry=False)
        before = served()
        with torch.no_grad():
            module(*step, state=state)
    assert served() == before and module.__dict__["_cpu_plan"].plan is not None
    assert rotary_cpu_entry._entry is False
    assert not any(p.name.startswith("entry_") for p in (tmp_path / "cache").glob("*"))


def test_a_failed_build_warns_once_and_the_ctypes_call_serves(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("cc failed with exit code 1: boom")

    monkeypatch.setattr(rotary_cpu_entry, "build_entry", failing)
    monkeypatch.setattr(rotary_cpu_entry, "_entry", None)
    module = make_rotary(4, 2, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="CPython entry .* unavailable.*boom"):
        state, step = planned(module, entry=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = make_rotary(4, 2, dtype=torch.float32)
        planned(other, entry=False)
        with torch.no_grad():
            expected = module(*step, state=state, backend="torch")
            got = module(*step, state=state)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)


def test_the_build_is_cached_per_interpreter_and_leaves_other_files_alone(tmp_path):
    compiler, include = rotary_cpu.find_compiler(), rotary_cpu_entry.python_include()
    (tmp_path / "notes.txt").write_text("mine")
    first = rotary_cpu_entry.build_entry(tmp_path, compiler, include)
    made = first.stat().st_mtime_ns
    assert first.name.startswith("entry_") and first.name.endswith(sysconfig.get_config_var("EXT_SUFFIX"))
    assert rotary_cpu_entry.build_entry(tmp_path, compiler, include) == first and first.stat().st_mtime_ns == made
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, "notes.txt"])
    assert (tmp_path / "notes.txt").read_text() == "mine"


@torch.no_grad()
def test_a_malformed_spec_is_refused_without_a_crash():
    module = make_rotary(4, 2, dtype=torch.float32)
    state, step = planned(module)
    cached = module.__dict__["_cpu_plan"]
    with pytest.raises(TypeError, match="spec"):
        cached.entry_call(cached.entry_spec[:-1], *step, state, None, False)
    spec = list(cached.entry_spec)
    spec[-5] = ((1, 2),)  # bindings: not (container, key, item)
    assert cached.entry_call(tuple(spec), *step, state, None, False) is None
    assert cached.entry_call(cached.entry_spec, *step, state, None, False) is not None
