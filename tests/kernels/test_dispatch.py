"""Backend selection and whole models through the Triton rotary path.

Selection: the config field, ``SELECTIVE_ROPE_BACKEND`` (which wins), the device, and the fallbacks when triton or
flash-linear-attention cannot be imported (a warning, never a crash). Then, on CPU under Triton's interpreter, every
family with ``backend="triton"`` (our rotary kernels; the mixers stay PyTorch on CPU) against ``backend="torch"``:
forward and backward with padding, packed sequences, cached decoding with a padded step, and ``generate``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selective_rope.kernels import dispatch, rotary_cpu
from selective_rope.kernels.backends import RESOLVED
from selective_rope.kernels.forgetting_attention import forgetting_attention
from selective_rope.kernels.gated_delta import gated_delta_rule
from selective_rope.kernels.gla import gated_linear_attention
from selective_rope.kernels.rotary import selective_rotary
from selective_rope.modeling import returned_cache

from families import FAMILIES
from isolation import import_blocker

REPO = Path(__file__).resolve().parents[2]
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; "
                                       "tests/kernels/test_backend_parity.py compares the backends on the GPU")


@pytest.fixture(autouse=True)
def _clean_backend_state(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch._warned.clear()
    yield
    dispatch._warned.clear()


# --------------------------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["cuda", "fla", "Torch", None])
def test_config_backend_is_validated(family, value):
    with pytest.raises(ValueError, match="backend") as error:
        family.config_class(**{**family.tiny, "backend": value})
    assert repr(value) in str(error.value) and "'auto', 'torch', 'triton'" in str(error.value)


def test_config_backend_default_and_round_trip(family):
    assert family.config_class(**family.tiny).backend == "auto"
    config = family.config_class(**{**family.tiny, "backend": "torch"})
    assert family.config_class.from_dict(config.to_dict()).backend == "torch"


def test_auto_and_torch_use_torch_on_cpu(monkeypatch):
    """"auto" is PyTorch with the compiled rotary kernel ("torch+c") unless the kernel is switched off; "torch" by
    name is PyTorch alone, the reference."""
    monkeypatch.delenv(rotary_cpu.ENV_SWITCH, raising=False)
    assert dispatch.resolve_backend("auto", "cpu") == "torch+c"
    assert dispatch.resolve_backend(None, torch.device("cpu")) == "torch+c"
    assert dispatch.resolve_backend("torch", "cpu") == "torch"
    assert dispatch.resolve_backend("auto", "meta") == "torch"  # the C kernel takes CPU tensors only
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
    assert dispatch.resolve_backend("auto", "cpu") == "torch"
    assert set(RESOLVED) == {"torch", "torch+c", "triton"}


def test_the_c_kernel_is_not_chosen_under_torch_compile(monkeypatch):
    """A tracer cannot see into the C kernel's call (ctypes / a CPython entry): compiled, "auto" is PyTorch on the
    CPU (issue 45); "triton" under the interpreter stays Triton, whose kernels are custom ops."""
    monkeypatch.delenv(rotary_cpu.ENV_SWITCH, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []

    def resolve(x):
        seen.extend(dispatch.resolve_backend(value, x.device) for value in ("auto", "triton"))
        return x + 1

    torch._dynamo.reset()
    torch.compile(resolve, backend="eager", fullgraph=True)(torch.ones(1))
    torch._dynamo.reset()
    expected_triton = "triton" if dispatch.triton_rotary() is not None else "torch"
    assert seen == ["torch", expected_triton]
    assert dispatch.resolve_backend("auto", "cpu") == "torch+c"  # eagerly, the C kernel


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.resolve_backend("triton", "cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET"):
        assert dispatch.resolve_backend("triton", "cpu") == "torch+c"
    with warnings_as_errors():  # once
        assert dispatch.resolve_backend("triton", "cpu") == "torch+c"


def test_environment_overrides_config(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.resolve_backend("triton", "cpu") == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "Triton")  # case and spaces do not matter
    assert dispatch.resolve_backend("torch", "cpu") == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "")  # empty: not set
    assert dispatch.resolve_backend("torch", "cpu") == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=f"`{dispatch.ENV_VAR}`='cuda' is invalid: expected one of"):
        dispatch.resolve_backend("auto", "cpu")


def test_cuda_without_triton_falls_back_to_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_rotary", lambda: None)
    for requested in ("auto", "triton"):
        with pytest.warns(RuntimeWarning, match="triton cannot be imported"):
            dispatch._warned.clear()
            assert dispatch.resolve_backend(requested, torch.device("cuda")) == "torch"
    with warnings_as_errors():
        assert dispatch.resolve_backend("auto", "cuda") == "torch"
    assert dispatch.fla_ops("torch", torch.device("cuda")) is None


def test_mixers_never_reach_fla_on_cpu(monkeypatch):
    """On CPU tensors fla is never imported, whatever the backend (its kernels cannot run there)."""
    def refuse():
        raise AssertionError("fla must not be imported for CPU tensors")

    monkeypatch.setattr(dispatch, "_import_fla", refuse)
    q, k, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 6)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 5, 2, 4))
    gated_linear_attention(q, k, v, g, backend="triton")
    gated_delta_rule(q, k, v, g[..., 0], torch.rand(1, 5, 2), backend="triton")
    forgetting_attention(q, k, v, g[..., 0], backend="triton")
    # so packed sequences reach the torch mixers as dense rows; the torch ops refuse cu_seqlens
    assert not dispatch.keeps_packed("triton", "cpu")
    offsets = torch.tensor([0, 2, 5])
    for call in (lambda: gated_linear_attention(q, k, v, g, cu_seqlens=offsets, backend="triton"),
                 lambda: gated_delta_rule(q, k, v, g[..., 0], torch.rand(1, 5, 2), cu_seqlens=offsets),
                 lambda: forgetting_attention(q, k, v, g[..., 0], cu_seqlens=offsets, backend="triton"),
                 lambda: selective_rotary(q, k, g, torch.ones(4), cu_seqlens=offsets)):
        with pytest.raises(ValueError, match="cu_seqlens"):
            call()


def test_gated_delta_rule_groups_value_heads_for_the_torch_op():
    """The wrapper takes q, k with H heads and v with HV = G·H heads (fla's convention) on every backend."""
    from selective_rope.kernels.gated_delta_torch import chunk_gated_delta_rule

    q, k = (torch.nn.functional.normalize(torch.randn(2, 7, 2, 4), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(2, 7, 6, 3), -torch.rand(2, 7, 6), torch.rand(2, 7, 6)
    o, state = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    o_ref, state_ref = chunk_gated_delta_rule(q.repeat_interleave(3, 2), k.repeat_interleave(3, 2), v, g, beta,
                                              output_final_state=True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(state, state_ref)


class _FlaGatedDeltaStandIn:
    """fla's gated delta rule ops as the wrapper calls them, computed by our torch op; records the dtypes it got
    (fla's Triton kernels refuse to multiply a float32 q/k with a bf16 v, which the interpreter does not check)."""

    def __init__(self):
        self.calls = []

    def chunk_gated_delta_rule(self, q, k, v, *, g, beta, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens):
        from selective_rope.kernels.gated_delta_torch import chunk_gated_delta_rule

        self.calls.append((q.dtype, k.dtype, v.dtype))
        repeat = v.shape[2] // q.shape[2]
        q, k = (x.float().repeat_interleave(repeat, 2) for x in (q, k))
        o, state = chunk_gated_delta_rule(q, k, v.float(), g, beta, initial_state=initial_state,
                                          output_final_state=output_final_state)
        return o.to(v.dtype), state

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule


def _gated_delta_inputs(dtype=torch.float32, requires_grad=False):
    q, k = (torch.nn.functional.normalize(torch.randn(1, 6, 2, 4), dim=-1).requires_grad_(requires_grad)
            for _ in range(2))
    v = torch.randn(1, 6, 4, 3, dtype=dtype)
    return q, k, v, -torch.rand(1, 6, 4), torch.rand(1, 6, 4)


def test_gated_delta_rule_gives_fla_one_dtype(monkeypatch):
    """Under autocast or with bf16 weights the rotated q, k arrive in float32 beside a bf16 v; fla's kernels get all
    three in v's dtype (on an H200 the mixed call failed to compile: "Both operands must be same dtype")."""
    from selective_rope.kernels import gated_delta as gated_delta_module

    fla = _FlaGatedDeltaStandIn()
    monkeypatch.setattr(gated_delta_module, "fla_ops", lambda backend, device: fla)
    q, k, v, g, beta = _gated_delta_inputs(torch.bfloat16)
    o, _ = gated_delta_rule(q, k, v, g, beta, backend="triton")
    assert fla.calls == [(torch.bfloat16, torch.bfloat16, torch.bfloat16)] and o.dtype == torch.bfloat16


def test_gated_delta_training_leaves_fla_where_fla_refuses_its_backward(monkeypatch):
    """fla 0.6 raises in the gated delta rule's backward on Hopper with Triton < 3.7.1 (fla #640), after the forward
    ran: training takes our torch op there instead, with one warning; packed sequences (which the torch op cannot
    take) are refused before any work; inference keeps fla's forward, which is correct."""
    from selective_rope.kernels import gated_delta as gated_delta_module
    from selective_rope.kernels.gated_delta_torch import chunk_gated_delta_rule

    fla = _FlaGatedDeltaStandIn()
    monkeypatch.setattr(gated_delta_module, "fla_ops", lambda backend, device: fla)
    monkeypatch.setattr(gated_delta_module, "fla_refuses_gated_delta_backward", lambda: True)
    dispatch._warned.clear()
    q, k, v, g, beta = _gated_delta_inputs(requires_grad=True)
    with pytest.warns(RuntimeWarning, match="fla issue #640"):
        o, _ = gated_delta_rule(q, k, v, g, beta, backend="triton")
    assert fla.calls == []
    o.sum().backward()
    expected = chunk_gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta)[0]
    torch.testing.assert_close(o, expected)
    with pytest.raises(ValueError, match="packed sequences needs fla's backward"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 6]), backend="triton")
    with torch.no_grad():
        gated_delta_rule(q, k, v, g, beta, backend="triton")
    assert len(fla.calls) == 1


def test_fla_refuses_gated_delta_backward_only_on_hopper_with_an_old_triton(monkeypatch):
    import fla.utils

    for hopper, above_3_7_1, refused in ((True, False, True), (True, True, False), (False, False, False)):
        monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", hopper)
        monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", True)
        monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", above_3_7_1)
        assert dispatch.fla_refuses_gated_delta_backward() is (refused and importlib.util.find_spec("tilelang") is None)


def test_shipped_modules_do_not_require_triton_or_fla():
    """transformers' remote-code loader requires what a shipped file imports outside try/except: never triton/fla."""
    from transformers.dynamic_module_utils import get_imports

    for name in ("kernels/dispatch.py", "kernels/rotary.py", "kernels/rotary_triton.py", "kernels/gla.py",
                 "kernels/gated_delta.py", "kernels/forgetting_attention.py", "modeling/rotary.py", "modeling/gla.py",
                 "modeling/gated_deltanet.py", "modeling/fox.py"):
        assert not {"triton", "fla"} & set(get_imports(REPO / name)), name


def test_fallbacks_without_triton_and_fla():
    """In a process where triton and fla cannot be imported: models with backend='triton' run (torch, one warning),
    CUDA requests fall back to torch, fla is never imported."""
    code = import_blocker("triton", "fla") + """
import os, warnings
os.environ['TRITON_INTERPRET'] = '1'
import torch
from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM
from selective_rope.kernels import dispatch, rotary_cpu
from selective_rope.kernels.backends import RESOLVED
model = SelectiveRopeGLAForCausalLM(SelectiveRopeGLAConfig(vocab_size=11, hidden_size=16, num_hidden_layers=1,
                                                           num_heads=2, backend='triton'))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    model.generate(torch.tensor([[1, 2]]), max_new_tokens=2)
    assert dispatch.resolve_backend('auto', 'cuda') == 'torch'
    assert dispatch.fla_ops('triton', torch.device('cuda')) is None
messages = sorted({str(w.message)[:40] for w in caught if 'selective-rope' in str(w.message)})
assert len(messages) == 3, messages  # triton on cpu, triton on cuda, fla on cuda: each once
assert not any(m.split('.')[0] in ('fla', 'triton') for m in sys.modules)
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


# --------------------------------------------------------------------------------------------------------------------
# whole models: the Triton rotary path against the torch path (CPU, interpreter)
# --------------------------------------------------------------------------------------------------------------------
def tiny_model(family, **overrides):
    config = family.config_class(**{**family.tiny, "phase_bias": True, **overrides})
    return family.lm_class(config)


def assert_close(actual, expected, name, tol=1e-4):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the fused decode steps, from the phase inputs or from the input (so a silent fallback to the generic
    path would be noticed)."""
    rotary_triton = dispatch.triton_rotary()
    calls = []
    for name in ("selective_rotary_decode_triton", "selective_rotary_decode_from_input_triton"):
        fused = getattr(rotary_triton, name)
        monkeypatch.setattr(rotary_triton, name, lambda *a, fused=fused, **kw: calls.append(1) or fused(*a, **kw))
    return calls


# GLA by default, the other families with `-m slow`: tests/kernels/test_backend_parity.py's
# test_forward_backward_with_left_padding runs every family's forward and backward with left padding on the Triton
# path (our rotary op and fla's kernels) against the torch path, which this test does with the torch mixers.
@needs_interpreter
@pytest.mark.parametrize("family", [pytest.param(name, marks=[] if name == "gla" else [pytest.mark.slow])
                                    for name in sorted(FAMILIES)], ids=str, indirect=True)
def test_model_forward_backward_with_padding(family, monkeypatch):
    model = tiny_model(family).train()
    ids = torch.randint(3, 61, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        results[backend] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}
    (logits_t, grads_t), (logits_x, grads_x) = results["torch"], results["triton"]
    real = mask.bool()
    assert_close(logits_x[real], logits_t[real], "logits")
    assert grads_t.keys() == grads_x.keys() and any("rotary" in n for n in grads_t)
    for name in grads_t:
        assert_close(grads_x[name], grads_t[name], f"grad {name}")


@needs_interpreter
def test_model_packed_sequences(family, monkeypatch):
    model = tiny_model(family).eval()
    ids = torch.randint(3, 61, (1, 11))
    offsets = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    logits = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        with torch.no_grad():
            logits[backend] = model(ids, cu_seqlens=offsets).logits
    assert_close(logits["triton"], logits["torch"], "packed logits")


@needs_interpreter
@pytest.mark.parametrize("options", [dict(), pytest.param(dict(position_embedding="rope"), marks=pytest.mark.slow)],
                         ids=["selective_rope", "rope"])
def test_model_cached_decoding(family, options, monkeypatch, decode_calls):
    """Left-padded prefill, then decoding steps (one with a padding token in a row): same logits and cached states on
    both paths, the steps going through the fused decode kernel."""
    model = tiny_model(family, **options).eval()
    ids = torch.randint(3, 61, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    steps = [(torch.randint(3, 61, (2, 1)), torch.tensor([[1], [0]])),  # row 1's token is padding
             (torch.randint(3, 61, (2, 1)), torch.tensor([[1], [1]]))]
    logits, caches = {}, {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            seen, history = mask, [out.logits]
            for token, step_mask in steps:
                seen = torch.cat([seen, step_mask], dim=1)
                out = model(token, attention_mask=seen, past_key_values=returned_cache(out), use_cache=True)
                history.append(out.logits)
        logits[backend], caches[backend] = history, returned_cache(out)
    for i, (a, e) in enumerate(zip(logits["triton"], logits["torch"])):
        real = mask if i == 0 else steps[i - 1][1]
        assert_close(a[real.bool()], e[real.bool()], f"logits of call {i}")
    for layer_t, layer_x in zip(caches["torch"].layers, caches["triton"].layers):
        assert layer_t.states.keys() == layer_x.states.keys()
        for name in layer_t.states:
            assert_close(layer_x.states[name].float(), layer_t.states[name].float(), f"cache {name}")
    assert len(decode_calls) == len(steps) * model.config.num_hidden_layers  # Selective RoPE and RoPE alike


@needs_interpreter
@pytest.mark.parametrize("family_name", ["gla", pytest.param("gated_deltanet", marks=pytest.mark.slow),
                                         pytest.param("fox", marks=pytest.mark.slow)])
def test_model_generate(family_name, monkeypatch):
    model = tiny_model(FAMILIES[family_name]).eval()
    ids = torch.randint(3, 61, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    generated = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        generated[backend] = out.sequences, torch.stack(out.logits)
    assert torch.equal(generated["triton"][0], generated["torch"][0])
    assert_close(generated["triton"][1], generated["torch"][1], "generate logits")
