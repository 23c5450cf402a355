"""On a CUDA GPU: the default backend (our Triton rotary kernels + flash-linear-attention's mixer kernels) against the
torch backend, for every family, in float32 and bfloat16: forward, backward, cached decoding and generate (float32
also: one-token training steps, packed training kept packed with the caches it ends with); and the Triton rotary ops
against the torch reference, eager and under torch.compile. The same comparisons at tiny sizes run on CPU, with fla's
kernels in Triton's interpreter, in tests/test_fla_interpreter.py (float32 only).

Marked ``cuda`` and skipped without a GPU. Comparisons use the relative RMS error ``rms(a - b) / rms(b)`` (as
flash-linear-attention's own tests do): fla's kernels use TF32 matmuls even for float32 inputs, so float32 agreement
is ~1e-3, not 1e-6. The tolerances below are first estimates, to be tightened from the first GPU run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():  # before importing fla: it registers its own models with transformers' Auto classes
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton", reason="the CUDA path needs triton")
pytest.importorskip("fla", reason="the CUDA path needs flash-linear-attention")

from collections import Counter  # noqa: E402

from transformers import AutoModelForCausalLM  # noqa: E402

from selective_rope.kernels import dispatch  # noqa: E402
from selective_rope.kernels.rotary import selective_rotary_decode  # noqa: E402
from selective_rope.kernels.rotary_torch import selective_rotary  # noqa: E402

from families import FAMILIES  # noqa: E402
from triton_interpreter import counting  # noqa: E402

DEVICE = "cuda"
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2}  # relative RMS error, models through two layers
OP_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # the rotary op alone: same float32 math

# Realistic head sizes (fla's kernels tile 16+ wide), two layers, GQA / grouped value heads, odd lengths.
CUDA_CONFIGS = {
    "gla": dict(hidden_size=256, num_heads=4, num_kv_heads=2, expand_k=1.0, expand_v=1.0, use_short_conv=True),
    "gated_deltanet": dict(hidden_size=256, num_heads=2, num_v_heads=4, head_dim=64, expand_v=1.0,
                           use_short_conv=True, allow_neg_eigval=True),
    "fox": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                qk_norm=True, use_output_gate=True, use_k_shift=True, use_v_shift=True),
}
COMMON = dict(vocab_size=512, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              phase_bias=True, initializer_range=0.05)


def err_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return (diff / expected.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def assert_ratio(actual, expected, name, tol):
    assert torch.isfinite(actual).all(), f"{name}: not finite"
    ratio = err_ratio(actual, expected)
    assert ratio <= tol, f"{name}: relative RMS error {ratio:.2e} > {tol:.0e}"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def fla_calls(monkeypatch):
    """Counts the calls of each fla kernel (packed ones also under ``"<name>[packed]"``), so that a silent fallback to
    the torch mixers fails the test."""
    ops = dispatch._import_fla()
    calls: Counter = Counter()
    for name, fn in vars(counting(ops, calls)).items():
        monkeypatch.setattr(ops, name, fn)
    return calls


def assert_caches_ratio(actual, expected, tol):
    """Every cached state; per-token histories (FoX's key timeline) on their valid slots only: padding slots hold
    nothing anyone reads."""
    for index, (layer_a, layer_e) in enumerate(zip(actual.layers, expected.layers)):
        assert layer_a.states.keys() == layer_e.states.keys(), index
        valid = layer_e.states.get("valid")
        if valid is not None:
            assert torch.equal(layer_a.states["valid"], valid), f"layer {index}: valid slots"
        for name, state in layer_e.states.items():
            mine = layer_a.states[name]
            if name in layer_e.token_states and name != "valid":
                mine, state = mine[valid], state[valid]
            if name != "valid":
                assert_ratio(mine, state, f"layer {index} cache {name}", tol)


def load_model(family_name: str, dtype: torch.dtype, tmp_path):
    """A float32 model saved and loaded in ``dtype`` (so the rotary module stays float32 in bf16, as for users)."""
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    model = family.lm_class(family.config_class(**COMMON, **CUDA_CONFIGS[family_name]))
    with torch.no_grad():  # make the phase bias and gate matter
        for name, param in model.named_parameters():
            if "rotary" in name and "temperature" not in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "model")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=dtype).to(DEVICE)


def inputs(batch=2, seq_len=100, vocab=512, pad=7):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, seq_len), generator=generator).to(DEVICE)
    mask = torch.ones(batch, seq_len, dtype=torch.long, device=DEVICE)
    mask[1, :pad] = 0  # left padding, as generate() produces
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family_name", sorted(CUDA_CONFIGS))
def test_family_forward_backward(family_name, dtype, tmp_path, monkeypatch, fla_calls):
    model = load_model(family_name, dtype, tmp_path).train()
    ids, mask = inputs()
    results = {}
    for backend in ("torch", "auto"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        results[backend] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}
    assert fla_calls, "the CUDA path did not reach flash-linear-attention"
    tol = TOLERANCE[dtype]
    real = mask.bool()
    assert_ratio(results["auto"][0][real], results["torch"][0][real], "logits", tol)
    grads_auto, grads_torch = results["auto"][1], results["torch"][1]
    assert grads_auto.keys() == grads_torch.keys()
    for name in grads_torch:
        assert_ratio(grads_auto[name], grads_torch[name], f"grad {name}", 4 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family_name", sorted(CUDA_CONFIGS))
def test_family_cached_decoding_and_generate(family_name, dtype, tmp_path, monkeypatch):
    model = load_model(family_name, dtype, tmp_path).eval()
    ids, mask = inputs(seq_len=70)
    steps = [(torch.randint(3, 512, (2, 1), device=DEVICE), torch.tensor([[1], [m]], device=DEVICE))
             for m in (1, 0, 1, 1)]  # the second step's token is padding in row 1
    results = {}
    for backend in ("torch", "auto"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            seen, logits = mask, [out.logits[mask.bool()]]
            for token, step_mask in steps:
                seen = torch.cat([seen, step_mask], dim=1)
                out = model(token, attention_mask=seen, past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[step_mask.bool()])
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True)
        results[backend] = logits, out.past_key_values, generated
    tol = TOLERANCE[dtype]
    for i, (a, e) in enumerate(zip(results["auto"][0], results["torch"][0])):
        assert_ratio(a, e, f"logits of call {i}", tol)
    assert_caches_ratio(results["auto"][1], results["torch"][1], tol)
    gen_auto, gen_torch = results["auto"][2], results["torch"][2]
    assert_ratio(gen_auto.logits[0], gen_torch.logits[0], "first generated logits", tol)
    if dtype == torch.float32:  # in bf16 a near tie may legitimately flip a greedy choice
        assert torch.equal(gen_auto.sequences, gen_torch.sequences)


@pytest.mark.parametrize("family_name", sorted(CUDA_CONFIGS))
def test_family_one_token_training_step(family_name, tmp_path, monkeypatch, fla_calls):
    """Gradients through a one-token call continuing a cache (fla's recurrent gated-delta kernel has no backward)."""
    model = load_model(family_name, torch.float32, tmp_path).train()
    prompt = torch.randint(3, 512, (2, 20), device=DEVICE)
    token = torch.randint(3, 512, (2, 1), device=DEVICE)
    weights = torch.randn(2, 1, 512, device=DEVICE)  # a loss reaching every logit
    results = {}
    for backend in ("torch", "auto"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        model.zero_grad()
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
        out = model(token, past_key_values=cache, use_cache=True)
        (out.logits * weights).sum().backward()
        results[backend] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}
    assert fla_calls and not fla_calls["fused_recurrent_gated_delta_rule"]
    tol = TOLERANCE[torch.float32]
    assert_ratio(results["auto"][0], results["torch"][0], "logits", tol)
    for name, grad in results["torch"][1].items():
        assert_ratio(results["auto"][1][name], grad, f"grad {name}", 4 * tol)


@pytest.mark.parametrize("family_name", sorted(CUDA_CONFIGS))
def test_family_packed_sequences(family_name, tmp_path, monkeypatch, fla_calls):
    """Packed training (forward, backward, the cache of each sequence) stays packed on the fla path; then a decoding
    step from those caches."""
    model = load_model(family_name, torch.float32, tmp_path).train()
    ids = torch.randint(3, 512, (1, 150), device=DEVICE)
    offsets = torch.tensor([0, 40, 41, 150], dtype=torch.int32, device=DEVICE)
    step = torch.randint(3, 512, (3, 1), device=DEVICE)
    weights = torch.randn(1, 150, 512, device=DEVICE)  # a loss reaching every logit
    results = {}
    for backend in ("torch", "auto"):
        monkeypatch.setenv(dispatch.ENV_VAR, backend)
        model.zero_grad()
        out = model(ids, cu_seqlens=offsets, use_cache=True)
        (out.logits * weights).sum().backward()
        with torch.no_grad():
            next_logits = model(step, past_key_values=out.past_key_values, use_cache=True).logits
        results[backend] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}, out.past_key_values, next_logits
    assert sum(n for name, n in fla_calls.items() if name.endswith("[packed]")) == model.config.num_hidden_layers
    tol = TOLERANCE[torch.float32]
    (logits_a, grads_a, cache_a, next_a), (logits_t, grads_t, cache_t, next_t) = results["auto"], results["torch"]
    assert_ratio(logits_a, logits_t, "packed logits", tol)
    for name, grad in grads_t.items():
        assert_ratio(grads_a[name], grad, f"grad {name}", 4 * tol)
    assert_caches_ratio(cache_a, cache_t, tol)
    assert_ratio(next_a, next_t, "logits after the packed prefill", tol)


# --------------------------------------------------------------------------------------------------------------------
# the rotary ops on CUDA
# --------------------------------------------------------------------------------------------------------------------
def rotary_inputs(dtype, batch=2, seq_len=1000, hq=8, hk=2, head_dim=128, half=48):
    def leaf(*shape, scale=1.0, dt=torch.float32):
        return (scale * torch.randn(*shape, device=DEVICE, dtype=dt)).requires_grad_()

    return (leaf(batch, seq_len, hq, head_dim, dt=dtype), leaf(batch, seq_len, hk, head_dim, dt=dtype),
            leaf(batch, seq_len, hk, half, scale=0.5), (0.5 + torch.rand(half, device=DEVICE)).requires_grad_(),
            leaf(batch, hk, half))


def op_grads(outputs, inputs):
    torch.manual_seed(3)
    loss = sum((o.float() * torch.randn_like(o.float())).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rotary_op_matches_torch(dtype, compiled):
    op = dispatch.triton_rotary().selective_rotary_triton
    if compiled:
        op = torch.compile(op, fullgraph=True)
    args = rotary_inputs(dtype)
    actual, expected = op(*args), selective_rotary(*args)
    tol = OP_TOLERANCE[dtype]
    for name, a, e in zip(("q", "k", "phase"), actual, expected):
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol * max(1.0, e.abs().max().item()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    for name, a, e in zip(("dq", "dk", "dincrement", "dtemperature", "dphase0"), op_grads(actual, args),
                          op_grads(expected, args)):
        assert_ratio(a, e, name, 1e-4 if dtype == torch.float32 else 1e-2)


def test_rotary_op_packed_on_cuda():
    op = dispatch.triton_rotary().selective_rotary_triton
    q, k, increment, temperature, _ = rotary_inputs(torch.float32, batch=1, seq_len=700)
    offsets = torch.tensor([0, 1, 300, 300, 700], dtype=torch.int32, device=DEVICE)
    out_q, out_k, final = op(q, k, increment, temperature, cu_seqlens=offsets)
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        ref_q, ref_k, ref_final = selective_rotary(q[:, start:end], k[:, start:end], increment[:, start:end],
                                                   temperature)
        torch.testing.assert_close(out_q[:, start:end], ref_q, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(out_k[:, start:end], ref_k, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(final[i], ref_final[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_decode_matches_torch(dtype):
    from selective_rope.kernels.conv_torch import causal_conv1d

    batch, hq, hk, head_dim, half, taps = 8, 16, 4, 128, 64, 4
    q = torch.randn(batch, hq, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, hk, head_dim, device=DEVICE, dtype=dtype)
    projection, phase = torch.randn(batch, hk, half, device=DEVICE), 100 * torch.randn(batch, hk, half, device=DEVICE)
    history = torch.randn(batch, taps - 1, hk * half, device=DEVICE)
    weight, bias = torch.randn(hk * half, taps, device=DEVICE), 0.3 * torch.randn(hk, half, device=DEVICE)
    gate = torch.randn(batch, hk, 1, device=DEVICE)
    valid = torch.rand(batch, device=DEVICE) > 0.3
    temperature = 500000.0 ** (-torch.arange(half, device=DEVICE) / half)
    actual = selective_rotary_decode(q, k, projection, temperature, phase, history, weight, "silu", bias,
                                              gate, valid)
    keep = valid.double()[:, None, None]  # the module's torch path: float64, the increment rounded to float32
    conv, new_history = causal_conv1d((projection.double() * keep).reshape(batch, 1, -1), weight, history.double(),
                                      valid.long(), "silu")
    increment = ((conv.view(batch, hk, half) + bias.double().exp()) * torch.sigmoid(gate.double()) * keep).float()
    ref_q, ref_k, ref_phase = selective_rotary(q[:, None], k[:, None], increment[:, None], temperature, phase)
    tol = OP_TOLERANCE[dtype]
    torch.testing.assert_close(actual[0].float(), ref_q[:, 0].float(), rtol=tol, atol=10 * tol)
    torch.testing.assert_close(actual[1].float(), ref_k[:, 0].float(), rtol=tol, atol=10 * tol)
    torch.testing.assert_close(actual[2], ref_phase, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(actual[3], new_history, rtol=0, atol=0)
