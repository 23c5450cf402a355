"""The CUDA path checked on CPU: ``backend="triton"`` with flash-linear-attention's real kernels (and our Triton rotary
kernels), run by Triton's interpreter, against ``backend="torch"`` for every family.

Forward and parameter gradients with left padding, a training step on one-token calls, cached decoding (a multi-token
call continuing the cache, a step where one row's token is padding), ``generate``, and packed sequences kept packed
(``cu_seqlens`` given to the kernels, the cache each sequence ends with). Every test counts the fla calls, so a
silent fallback to the torch mixers fails it. Float32 only (bf16 is wrong in the 3.9 interpreter); what only a GPU
can check (bf16, TF32 tolerances, speed, realistic sizes) is in tests/test_cuda.py.

Shapes are tiny: an interpreted fla call costs ~0.2-2 s. ``-m slow`` adds the RoPE variants.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton path needs triton")

from selective_rope.kernels import dispatch  # noqa: E402
from selective_rope.kernels.forgetting_attention import forgetting_attention  # noqa: E402

from families import OPTION_VARIANTS  # noqa: E402
from triton_interpreter import fla_kernels_on_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; with a GPU, "
                                "tests/test_cuda.py runs the same comparisons on CUDA")

# The fla op each family's mixer calls for a whole sequence and for one decoding step.
CHUNK = {"gla": "chunk_gla", "gated_deltanet": "chunk_gated_delta_rule", "fox": "parallel_forgetting_attn"}
STEP = {"gla": "fused_recurrent_gla", "gated_deltanet": "fused_recurrent_gated_delta_rule", "fox": None}
TOL = 1e-4  # float32 through two layers; measured: ~5e-6 (logits), ~2e-5 of a gradient's largest entry


@pytest.fixture(scope="module")
def _interpreted_fla():
    with fla_kernels_on_cpu() as calls:  # module scope: each kernel's source is rewritten once for the module
        yield calls


@pytest.fixture
def fla_calls(_interpreted_fla, monkeypatch):
    """The calls of each fla op (and of our rotary op) made during the test."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    _interpreted_fla.clear()
    return _interpreted_fla


def use_backend(monkeypatch, backend: str) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, backend)


def tiny_model(family, **overrides):
    config = family.config_class(**{**family.tiny, "phase_bias": True, **overrides})
    model = family.lm_class(config)
    with torch.no_grad():  # make the phase bias, gate and convolution matter (their initial values are plain)
        for name, param in model.named_parameters():
            if "rotary" in name and "temperature" not in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def assert_close(actual, expected, name, tol=TOL):
    """Elementwise, with the absolute part relative to the tensor's scale: the embeddings' gradients reach ~80 here,
    where both float32 paths (torch and triton) sit ~5e-4 from a float64 run."""
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(actual: dict, expected: dict):
    assert actual.keys() == expected.keys() and expected
    for name in expected:
        assert_close(actual[name], expected[name], f"grad {name}")


def assert_same_caches(actual, expected):
    """Layer by layer, every state; the per-token histories (FoX's key timeline) on their valid slots only, since
    padding slots hold nothing anyone reads."""
    for index, (layer_a, layer_e) in enumerate(zip(actual.layers, expected.layers)):
        assert layer_a.states.keys() == layer_e.states.keys(), index
        valid = layer_e.states.get("valid")
        if valid is not None:
            assert torch.equal(layer_a.states["valid"], valid), f"layer {index}: valid slots"
        for name, state in layer_e.states.items():
            mine = layer_a.states[name]
            if name in layer_e.token_states and name != "valid":
                mine, state = mine[valid], state[valid]
            assert_close(mine.float(), state.float(), f"layer {index} cache {name}")


def weighted_sum(logits: torch.Tensor) -> torch.Tensor:
    """A loss that reaches every logit with a different weight (labels would drop the last position)."""
    weights = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    return (logits * weights).sum()


# --------------------------------------------------------------------------------------------------------------------
def test_forward_backward_with_left_padding(family, monkeypatch, fla_calls):
    model = tiny_model(family).train()
    ids = torch.randint(3, 61, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    results = {}
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        results[backend] = out.logits.detach(), grads_of(model)
    layers = model.config.num_hidden_layers
    assert fla_calls[CHUNK[family.name]] == layers and fla_calls["selective_rotary_triton"] == layers
    real = mask.bool()
    assert_close(results["triton"][0][real], results["torch"][0][real], "logits")
    assert any("rotary" in name for name in results["torch"][1])  # Selective RoPE's parameters are trained
    assert_same_grads(results["triton"][1], results["torch"][1])


def test_one_token_training_step(family, monkeypatch, fla_calls):
    """Gradients through one-token calls continuing a cache. fla's recurrent gated-delta kernel has no backward, so
    Gated DeltaNet takes its chunked kernel whenever a gradient is needed."""
    model = tiny_model(family).train()
    prompt, token = torch.randint(3, 61, (2, 4)), torch.randint(3, 61, (2, 1))
    results = {}
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        model.zero_grad()
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
        out = model(token, past_key_values=cache, use_cache=True)
        weighted_sum(out.logits).backward()
        results[backend] = out.logits.detach(), grads_of(model)
    layers = model.config.num_hidden_layers
    if family.name == "gla":  # fused_recurrent_gla has a backward
        assert fla_calls["chunk_gla"] == layers and fla_calls["fused_recurrent_gla"] == layers
    elif family.name == "gated_deltanet":
        assert fla_calls["chunk_gated_delta_rule"] == 2 * layers
        assert fla_calls["fused_recurrent_gated_delta_rule"] == 0
    else:  # FoX: the prompt through fla; the token continues a cached timeline, which the torch op serves
        assert fla_calls["parallel_forgetting_attn"] == layers
    assert_close(results["triton"][0], results["torch"][0], "logits")
    assert_same_grads(results["triton"][1], results["torch"][1])


@pytest.mark.parametrize("options", [dict(), pytest.param(dict(position_embedding="rope"), marks=pytest.mark.slow),
                                     OPTION_VARIANTS["official"]],
                         ids=["selective_rope", "rope", "official"])
def test_cached_decoding_and_generate(family, options, monkeypatch, fla_calls):
    """Left-padded prefill; a two-token call continuing the cache with a pad in one row; a step where one row's token
    is padding; a plain step. Same logits at real tokens and same caches on both paths; then ``generate``."""
    model = tiny_model(family, **options).eval()
    prompt = torch.randint(3, 61, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    calls = [(torch.randint(3, 61, (2, 2)), torch.tensor([[1, 1], [1, 0]])),
             (torch.randint(3, 61, (2, 1)), torch.tensor([[1], [0]])),
             (torch.randint(3, 61, (2, 1)), torch.tensor([[1], [1]]))]
    logits, caches = {}, {}
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        with torch.no_grad():
            out = model(prompt, attention_mask=mask, use_cache=True)
            seen, history = mask, [out.logits[mask.bool()]]
            for ids, call_mask in calls:
                seen = torch.cat([seen, call_mask], dim=1)
                out = model(ids, attention_mask=seen, past_key_values=out.past_key_values, use_cache=True)
                history.append(out.logits[call_mask.bool()])
        logits[backend], caches[backend] = history, out.past_key_values
    layers = model.config.num_hidden_layers
    if family.name == "fox":  # only the prefill has no cached keys before its queries
        assert fla_calls["parallel_forgetting_attn"] == layers
    else:
        assert fla_calls[CHUNK[family.name]] == 2 * layers and fla_calls[STEP[family.name]] == 2 * layers
    for i, (a, e) in enumerate(zip(logits["triton"], logits["torch"])):
        assert_close(a, e, f"logits of call {i}")
    assert_same_caches(caches["triton"], caches["torch"])

    fla_calls.clear()
    generated = {}
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        generated[backend] = out.sequences, torch.stack(out.logits)
    assert fla_calls[CHUNK[family.name]] == layers
    assert torch.equal(generated["triton"][0], generated["torch"][0])
    assert_close(generated["triton"][1], generated["torch"][1], "generate logits")


@pytest.mark.parametrize("options", [dict(), pytest.param(dict(position_embedding="rope"), marks=pytest.mark.slow)],
                         ids=["selective_rope", "rope"])
def test_packed_sequences_stay_packed(family, options, monkeypatch, fla_calls):
    """Packed training forward and backward with the cache each sequence ends with: the triton path hands
    ``cu_seqlens`` to fla's kernels and our rotary kernel (no padding to dense rows). Then a packed call continuing
    those caches (one row per sequence) and a decoding step."""
    model = tiny_model(family, **options).train()
    ids = torch.randint(3, 61, (1, 11))
    offsets = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    more_ids, more_offsets = torch.randint(3, 61, (1, 4)), torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    step = torch.randint(3, 61, (3, 1))
    results = {}
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        model.zero_grad()
        out = model(ids, cu_seqlens=offsets, use_cache=True)
        weighted_sum(out.logits).backward()
        logits = [out.logits.detach()]
        with torch.no_grad():
            out = model(more_ids, cu_seqlens=more_offsets, past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
            logits.append(model(step, past_key_values=out.past_key_values, use_cache=True).logits)
        results[backend] = logits, grads_of(model), out.past_key_values
    layers = model.config.num_hidden_layers
    # FoX: fla attends to whole sequences only; the call continuing a cached timeline goes through the torch op
    assert fla_calls[CHUNK[family.name] + "[packed]"] == (1 if family.name == "fox" else 2) * layers
    assert fla_calls["selective_rotary_triton[packed]"] == 2 * layers
    (logits_x, grads_x, cache_x), (logits_t, grads_t, cache_t) = results["triton"], results["torch"]
    selective = model.config.position_embedding == "selective_rope"
    assert selective == any("rotary" in name for name in grads_t)  # Selective RoPE's parameters are trained
    for name, a, e in zip(("packed", "packed continuing the cache", "decoding step"), logits_x, logits_t):
        assert_close(a, e, f"{name} logits")
    assert_same_grads(grads_x, grads_t)
    assert_same_caches(cache_x, cache_t)


def test_fox_outputs_at_pads_are_zero_on_both_paths(fla_calls):
    """Right-padded rows: fla's kernel and the torch op agree everywhere, pad positions included (zeros there)."""
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    log_fgate = torch.nn.functional.logsigmoid(torch.randn(2, 9, 4) + 2)
    valid = torch.arange(9) < torch.tensor([[6], [9]])
    outputs = {b: forgetting_attention(q, k, v, log_fgate, key_valid=valid, backend=b)
               for b in ("torch", "triton")}
    assert fla_calls["parallel_forgetting_attn"] == 1
    assert (outputs["torch"][0, 6:] == 0).all() and (outputs["triton"][0, 6:] == 0).all()
    assert_close(outputs["triton"], outputs["torch"], "attention outputs", tol=1e-5)

