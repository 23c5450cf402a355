"""Backend parity: the fast path against ``backend="torch"`` for every family, one suite parametrised by device.

- ``cpu``: ``backend="triton"`` with flash-linear-attention's real kernels (and our Triton rotary kernels) run by
  Triton's interpreter (tests/triton_interpreter.py); float32 only (bf16 is wrong in the 3.9 interpreter), tiny shapes
  (an interpreted fla call costs ~0.2-2 s), elementwise tolerances. Skipped on a machine with a GPU.
- ``cuda``: ``backend="auto"`` (our Triton rotary kernels + fla's mixer kernels) on a GPU, float32 and bfloat16,
  realistic head sizes (fla's kernels tile 16+ wide), models saved and loaded in the dtype (so the rotary module
  stays float32 in bf16, as for users). Marked ``cuda`` and skipped without a GPU. Comparisons use the relative RMS
  error ``rms(a - b) / rms(b)`` (as fla's own tests do): fla's kernels use TF32 matmuls even for float32 inputs, so
  float32 agreement is ~1e-3, not 1e-6. Those tolerances are first estimates, to be tightened from the first GPU run.

The hybrid runs the same checks, its calls counted per layer type (fla's Gated DeltaNet kernels in its
``"linear_attention"`` layers, fla's forgetting attention in its ``"full_attention"`` layers, our rotary in both),
and once more with the attention layers' forget gate on (off in its tiny config, as in a port).

Forward and parameter gradients with left padding, a training step on one-token calls, cached decoding (steps where
one row's token is padding) and ``generate``, and packed sequences kept packed (``cu_seqlens`` given to the kernels,
the cache each sequence ends with). Every test counts the fla calls, so a silent fallback to the torch mixers fails
it. ``-m slow`` adds the RoPE variants on CPU. On CUDA also: the Triton rotary ops against the torch reference, eager
and under torch.compile.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the Triton path needs triton")

from transformers import AutoModelForCausalLM  # noqa: E402

from selective_rope.kernels import dispatch  # noqa: E402
from selective_rope.kernels import gated_delta as gated_delta_module  # noqa: E402
from selective_rope.kernels.forgetting_attention import forgetting_attention  # noqa: E402
from selective_rope.kernels.rotary_torch import selective_rotary  # noqa: E402
from selective_rope.kernels.rotary_triton import selective_rotary_decode_triton as selective_rotary_decode  # noqa: E402
from selective_rope.modeling import returned_cache  # noqa: E402

from families import FAMILIES, OPTION_VARIANTS  # noqa: E402
from triton_interpreter import counting, fla_kernels_on_cpu  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16

# The fla op each mixer calls for a whole sequence and for one decoding step (a family's own mixer, or the hybrid's:
# Gated DeltaNet in its "linear_attention" layers, FoX's attention in its "full_attention" layers).
CHUNK = {"gla": "chunk_gla", "gated_deltanet": "chunk_gated_delta_rule", "fox": "parallel_forgetting_attn"}
STEP = {"gla": "fused_recurrent_gla", "gated_deltanet": "fused_recurrent_gated_delta_rule", "fox": None}
HYBRID_MIXERS = {"linear_attention": "gated_deltanet", "full_attention": "fox"}

# Realistic head sizes on the GPU, two layers, GQA / grouped value heads, odd lengths.
CUDA_CONFIGS = {
    "gla": dict(hidden_size=256, num_heads=4, num_kv_heads=2, expand_k=1.0, expand_v=1.0, use_short_conv=True),
    "gated_deltanet": dict(hidden_size=256, num_heads=2, num_v_heads=4, head_dim=64, expand_v=1.0,
                           use_short_conv=True, allow_neg_eigval=True),
    "fox": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                qk_norm=True, use_output_gate=True, use_k_shift=True, use_v_shift=True),
    "hybrid": dict(hidden_size=256, layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=64, linear_value_head_dim=64, intermediate_size=512, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                   decoder_sparse_step=2, use_forget_gate=True,
                   layer_type_position_embedding={"full_attention": {"partial_rotary_factor": 0.5}}),
}
CUDA_COMMON = dict(vocab_size=512, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   phase_bias=True, initializer_range=0.05)
CUDA_TOLERANCE = {FP32: 5e-3, BF16: 5e-2}  # relative RMS error, models through two layers
CUDA_OP_TOLERANCE = {FP32: 1e-5, BF16: 1e-2}  # the rotary op alone: same float32 math
CPU_TOLERANCE = 1e-4  # float32 through two layers; measured: ~5e-6 (logits), ~2e-5 of a gradient's largest entry

needs_cpu_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; with a GPU the "
                                           "cuda parameters run the same comparisons on CUDA")
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@dataclass(frozen=True)
class Target:
    """Where the fast path runs, and how it is compared with the torch path there."""

    device: str
    dtype: torch.dtype = FP32

    @property
    def backend(self) -> str:
        """The backend compared with ``"torch"``."""
        return "triton" if self.device == "cpu" else "auto"

    @property
    def vocab_size(self) -> int:
        return 61 if self.device == "cpu" else CUDA_COMMON["vocab_size"]

    def tokens(self, *shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randint(3, self.vocab_size, shape, generator=generator).to(self.device)

    def model(self, family, tmp_path, **overrides):
        """A model whose phase bias, gate and convolution matter (their initial values are plain)."""
        if self.device == "cpu":
            config = family.config_class(**{**family.tiny, "phase_bias": True, **overrides})
        else:
            config = family.config_class(**CUDA_COMMON, **CUDA_CONFIGS[family.name], **overrides)
        model = family.lm_class(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "rotary" in name and "temperature" not in name:
                    param.add_(0.3 * torch.randn_like(param))
        if self.device == "cpu":
            return model
        # Saved in float32 and loaded in the dtype, as users load a checkpoint.
        model.save_pretrained(tmp_path / "model")
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=self.dtype).to(self.device)

    def assert_close(self, actual, expected, name, gradient=False):
        """CPU: elementwise, the absolute part relative to the tensor's scale (the embeddings' gradients reach ~80
        there, where both float32 paths sit ~5e-4 from a float64 run). CUDA: the relative RMS error, four times the
        tolerance for gradients."""
        if self.device == "cpu":
            scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
            torch.testing.assert_close(actual, expected, rtol=CPU_TOLERANCE, atol=CPU_TOLERANCE * scale,
                                       msg=lambda m: f"{name}: {m}")
        else:
            assert_ratio(actual, expected, name, (4 if gradient else 1) * CUDA_TOLERANCE[self.dtype])


def targets(cuda_dtypes=(FP32,), options=None):
    """``pytest.param`` s of ``target`` (or ``(target, options)``): the CPU interpreter in float32, then CUDA in each
    of ``cuda_dtypes``. ``options`` (``pytest.param`` s of config overrides) vary the CPU runs; CUDA runs the
    defaults."""
    params = []
    for option in options or [None]:
        values = [] if option is None else [option.values[0]]
        marks = [] if option is None else list(option.marks)
        suffix = "" if option is None else f"-{option.id}"
        params.append(pytest.param(Target("cpu"), *values, marks=[needs_cpu_interpreter, *marks], id=f"cpu{suffix}"))
    for dtype in cuda_dtypes:
        values, suffix = ([], "") if options is None else ([{}], "-selective_rope")
        name = {FP32: "fp32", BF16: "bf16"}[dtype]
        params.append(pytest.param(Target("cuda", dtype), *values, marks=needs_cuda, id=f"cuda-{name}{suffix}"))
    return params


def seeded(target: Target) -> torch.Generator | None:
    """The CUDA runs draw their prompts from a fixed generator (the CPU runs from the test's seeded global one)."""
    return None if target.device == "cpu" else torch.Generator().manual_seed(1)


@pytest.fixture(scope="module")
def _interpreted_fla():
    if torch.cuda.is_available():
        yield None
        return
    with fla_kernels_on_cpu() as calls:  # module scope: each kernel's source is rewritten once for the module
        yield calls


@pytest.fixture
def fla_calls(request, monkeypatch):
    """The calls of each fla op made during the test (on CPU also those of our rotary op); packed calls again under
    ``"<name>[packed]"``."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    if not torch.cuda.is_available():
        calls = request.getfixturevalue("_interpreted_fla")
        calls.clear()
        return calls
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ops = dispatch._import_fla()
    calls: Counter = Counter()
    for name, fn in vars(counting(ops, calls)).items():
        monkeypatch.setattr(ops, name, fn)
    return calls


def use_backend(monkeypatch, backend: str) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, backend)


def err_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return (diff / expected.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def assert_ratio(actual, expected, name, tol):
    assert torch.isfinite(actual).all(), f"{name}: not finite"
    ratio = err_ratio(actual, expected)
    assert ratio <= tol, f"{name}: relative RMS error {ratio:.2e} > {tol:.0e}"


def mixers(family, model) -> Counter:
    """How many layers run each mixer (named by its family): every layer a family's own, the hybrid's by
    ``layer_types``."""
    if family.name == "hybrid":
        return Counter(HYBRID_MIXERS[kind] for kind in model.config.layer_types)
    return Counter({family.name: model.config.num_hidden_layers})


def assert_calls(fla_calls: Counter, family, model, per_layer: dict[str, dict[str, int]], suffix: str = ""):
    """Each op's calls (``name + suffix``) equal the sum over the layers of what ``per_layer[mixer]`` says one layer
    of that mixer makes: the hybrid's Gated DeltaNet and attention layers are counted apart."""
    expected = Counter()
    for mixer, layers in mixers(family, model).items():
        for op, calls in per_layer[mixer].items():
            expected[op] += calls * layers
    for op, calls in expected.items():
        assert fla_calls[op + suffix] == calls, f"{op + suffix}: {fla_calls[op + suffix]} calls, expected {calls}"


def fla_trains_gated_delta() -> bool:
    """Whether fla's gated delta rule takes training calls here: not where fla refuses its backward (fla #640:
    Hopper with Triton < 3.7.1, as on the H200 of 28 Nov 2026), whose Gated DeltaNet layers then train with our
    PyTorch op (``kernels/gated_delta.py``)."""
    return not gated_delta_module.fla_refuses_gated_delta_backward()


def rotary_op_calls(calls: Counter, suffix: str = "") -> int:
    """Calls of our Triton rotary op: from the phase increments, or from the input (the default phase path)."""
    return calls["selective_rotary_triton" + suffix] + calls["selective_rotary_from_input_triton" + suffix]


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(target: Target, actual: dict, expected: dict):
    assert actual.keys() == expected.keys() and expected
    for name in expected:
        target.assert_close(actual[name], expected[name], f"grad {name}", gradient=True)


def assert_same_caches(target: Target, actual, expected):
    """Layer by layer, every state; the per-token histories (FoX's key timeline) on their valid slots only, since
    padding slots hold nothing anyone reads."""
    for index, (layer_a, layer_e) in enumerate(zip(actual.layers, expected.layers)):
        assert layer_a.states.keys() == layer_e.states.keys(), index
        valid = layer_e.states.get("valid")
        if valid is not None:
            assert torch.equal(layer_a.states["valid"], valid), f"layer {index}: valid slots"
        for name, state in layer_e.states.items():
            if name == "valid":
                continue
            mine = layer_a.states[name]
            if name in layer_e.token_states:
                mine, state = mine[valid], state[valid]
            target.assert_close(mine.float(), state.float(), f"layer {index} cache {name}")


def weighted_sum(logits: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """A loss that reaches every logit with a different weight (labels would drop the last position)."""
    if weights is None:
        weights = torch.linspace(-1, 1, logits.numel(), device=logits.device).view_as(logits)
    return (logits * weights).sum()


# --------------------------------------------------------------------------------------------------------------------
# whole models
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", targets(cuda_dtypes=(FP32, BF16)))
def test_forward_backward_with_left_padding(target, family, monkeypatch, fla_calls, tmp_path):
    check_forward_backward(target, family, target.model(family, tmp_path).train(), monkeypatch, fla_calls)


@needs_cpu_interpreter
def test_hybrid_with_forget_gate_in_the_other_layer_order(monkeypatch, fla_calls, tmp_path):
    """The hybrid's attention layers with their forget gate (off in a port, so off in the tiny config: fla's kernel
    then gets no gates), three layers starting with attention, a MoE block in each."""
    family = FAMILIES["hybrid"]
    model = Target("cpu").model(family, tmp_path, num_hidden_layers=3, use_forget_gate=True, decoder_sparse_step=1,
                                layer_types=["full_attention", "linear_attention", "full_attention"])
    assert all(layer.attn.f_proj is not None for layer in model.model.layers[::2])
    check_forward_backward(Target("cpu"), family, model.train(), monkeypatch, fla_calls)


def check_forward_backward(target, family, model, monkeypatch, fla_calls):
    """Logits and parameter gradients of a left-padded batch: the fast path equals the torch path."""
    length, pad = (7, 2) if target.device == "cpu" else (100, 7)
    ids = target.tokens(2, length, generator=seeded(target))
    mask = torch.ones(2, length, dtype=torch.long, device=target.device)
    mask[1, :pad] = 0  # left padding, as generate() produces
    results = {}
    for backend in ("torch", target.backend):
        use_backend(monkeypatch, backend)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        results[backend] = out.logits.detach(), grads_of(model)
    layers = model.config.num_hidden_layers
    chunk_calls = {name: {op: int(name != "gated_deltanet" or fla_trains_gated_delta())} for name, op in CHUNK.items()}
    assert_calls(fla_calls, family, model, chunk_calls)
    if target.device == "cpu":  # (our rotary op's calls are counted on CPU only)
        assert rotary_op_calls(fla_calls) == layers
    real = mask.bool()
    target.assert_close(results[target.backend][0][real], results["torch"][0][real], "logits")
    assert any("rotary" in name for name in results["torch"][1])  # Selective RoPE's parameters are trained
    assert_same_grads(target, results[target.backend][1], results["torch"][1])


@needs_cpu_interpreter
@pytest.mark.parametrize("name", ["gated_deltanet", "hybrid"])
def test_training_where_fla_refuses_the_gated_delta_backward(name, monkeypatch, fla_calls, tmp_path):
    """Where fla refuses the gated delta rule's backward (fla #640), a left-padded batch trains its Gated DeltaNet
    layers with our PyTorch op (the hybrid's attention layers keep fla's kernel) and equals the torch path, with one
    warning; packed training, which that op cannot take, is refused by name before any work."""
    monkeypatch.setattr(gated_delta_module, "fla_refuses_gated_delta_backward", lambda: True)
    dispatch._warned.clear()
    target, family = Target("cpu"), FAMILIES[name]
    model = target.model(family, tmp_path).train()
    with pytest.warns(RuntimeWarning, match="fla issue #640"):
        check_forward_backward(target, family, model, monkeypatch, fla_calls)
    check_packed_training_refused(target, model, monkeypatch)


def check_packed_training_refused(target, model, monkeypatch):
    use_backend(monkeypatch, target.backend)
    offsets = torch.tensor([0, 4, 11], dtype=torch.int32, device=target.device)
    with pytest.raises(ValueError, match="fla issue #640"):
        model(target.tokens(1, 11), cu_seqlens=offsets)


@pytest.mark.parametrize("target", targets())
def test_one_token_training_step(target, family, monkeypatch, fla_calls, tmp_path):
    """Gradients through one-token calls continuing a cache. fla's recurrent gated-delta kernel has no backward, so
    Gated DeltaNet takes its chunked kernel whenever a gradient is needed."""
    model = target.model(family, tmp_path).train()
    prompt, token = target.tokens(2, 4 if target.device == "cpu" else 20), target.tokens(2, 1)
    # a loss reaching every logit
    weights = None if target.device == "cpu" else torch.randn(2, 1, target.vocab_size, device=target.device)
    results = {}
    for backend in ("torch", target.backend):
        use_backend(monkeypatch, backend)
        model.zero_grad()
        with torch.no_grad():
            cache = returned_cache(model(prompt, use_cache=True))
        out = model(token, past_key_values=cache, use_cache=True)
        weighted_sum(out.logits, weights).backward()
        results[backend] = out.logits.detach(), grads_of(model)
    if target.device == "cuda":
        assert fla_calls and not fla_calls["fused_recurrent_gated_delta_rule"]
    else:
        assert_calls(fla_calls, family, model, {
            "gla": {"chunk_gla": 1, "fused_recurrent_gla": 1},  # fused_recurrent_gla has a backward
            "gated_deltanet": {"chunk_gated_delta_rule": 2, "fused_recurrent_gated_delta_rule": 0},
            # FoX: the prompt through fla; the token continues a cached timeline, which the torch op serves
            "fox": {"parallel_forgetting_attn": 1},
        })
    target.assert_close(results[target.backend][0], results["torch"][0], "logits")
    assert_same_grads(target, results[target.backend][1], results["torch"][1])


DECODING_OPTIONS = [pytest.param({}, id="selective_rope"),
                    pytest.param(dict(position_embedding="rope"), marks=pytest.mark.slow, id="rope"),
                    pytest.param(OPTION_VARIANTS["official"], id="official")]


def decoding_params():
    """Every family with each of ``targets(...)``, except that the paper's options run on CPU for GLA only by default
    (the others with ``-m slow``): they change only the rotary module, the same in every family (whose own code the
    default options' cases run), and the op-level tests run them under the interpreter too
    (tests/kernels/test_rotary_fused_triton.py, test_phase_triton.py)."""
    for param in targets(cuda_dtypes=(FP32, BF16), options=DECODING_OPTIONS):
        for name in sorted(FAMILIES):
            slow = param.id == "cpu-official" and name != "gla"
            yield pytest.param(name, *param.values, id=f"{name}-{param.id}",
                               marks=[*param.marks, pytest.mark.slow] if slow else param.marks)


@pytest.mark.parametrize("family,target,options", decoding_params(), indirect=["family"])  # conftest.py's `family`
def test_cached_decoding_and_generate(target, options, family, monkeypatch, fla_calls, tmp_path):
    """Left-padded prefill, then calls continuing the cache, among them steps where one row's token is padding (on
    CPU also a two-token call with a pad in one row). Same logits at real tokens and same caches on both paths; then
    ``generate``."""
    model = target.model(family, tmp_path, **options).eval()
    if target.device == "cpu":
        prompt = target.tokens(2, 6)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        calls = [(target.tokens(2, 2), torch.tensor([[1, 1], [1, 0]])),
                 (target.tokens(2, 1), torch.tensor([[1], [0]])),
                 (target.tokens(2, 1), torch.tensor([[1], [1]]))]
        new_tokens = 3
    else:
        prompt = target.tokens(2, 70, generator=seeded(target))
        mask = torch.ones(2, 70, dtype=torch.long, device=target.device)
        mask[1, :7] = 0
        calls = [(target.tokens(2, 1), torch.tensor([[1], [m]], device=target.device))
                 for m in (1, 0, 1, 1)]  # the second step's token is padding in row 1
        new_tokens = 8
    logits, caches = {}, {}
    for backend in ("torch", target.backend):
        use_backend(monkeypatch, backend)
        with torch.no_grad():
            out = model(prompt, attention_mask=mask, use_cache=True)
            seen, history = mask, [out.logits[mask.bool()]]
            for ids, call_mask in calls:
                seen = torch.cat([seen, call_mask], dim=1)
                out = model(ids, attention_mask=seen, past_key_values=returned_cache(out), use_cache=True)
                history.append(out.logits[call_mask.bool()])
        logits[backend], caches[backend] = history, returned_cache(out)
    if target.device == "cpu":
        # FoX: only the prefill has no cached keys before its queries; the recurrent mixers' two-token call is chunked
        assert_calls(fla_calls, family, model, {name: {CHUNK[name]: 1} if name == "fox" else
                                                {CHUNK[name]: 2, STEP[name]: 2} for name in CHUNK})
    for i, (a, e) in enumerate(zip(logits[target.backend], logits["torch"])):
        target.assert_close(a, e, f"logits of call {i}")
    assert_same_caches(target, caches[target.backend], caches["torch"])

    fla_calls.clear()
    generated = {}
    for backend in ("torch", target.backend):
        use_backend(monkeypatch, backend)
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        generated[backend] = out.sequences, torch.stack(out.logits)
    if target.device == "cpu":
        assert_calls(fla_calls, family, model, {name: {op: 1} for name, op in CHUNK.items()})
        # every step (on CUDA only the first: in bf16 a near tie may legitimately flip a greedy choice)
        target.assert_close(generated[target.backend][1], generated["torch"][1], "generate logits")
    else:
        target.assert_close(generated[target.backend][1][0], generated["torch"][1][0], "first generated logits")
    if target.dtype == FP32:
        assert torch.equal(generated[target.backend][0], generated["torch"][0])


PACKED_OPTIONS = [pytest.param({}, id="selective_rope"),
                  pytest.param(dict(position_embedding="rope"), marks=pytest.mark.slow, id="rope")]


@pytest.mark.parametrize("target,options", targets(options=PACKED_OPTIONS))
def test_packed_sequences_stay_packed(target, options, family, monkeypatch, fla_calls, tmp_path):
    """Packed training forward and backward with the cache each sequence ends with: the fast path hands
    ``cu_seqlens`` to fla's kernels and our rotary kernel (no padding to dense rows). Then (on CPU) a packed call
    continuing those caches (one row per sequence), and a decoding step."""
    model = target.model(family, tmp_path, **options).train()
    if "gated_deltanet" in mixers(family, model) and not fla_trains_gated_delta():
        check_packed_training_refused(target, model, monkeypatch)  # (all a GPU with fla #640 can check here)
        return
    if target.device == "cpu":
        ids, offsets = target.tokens(1, 11), torch.tensor([0, 4, 5, 11], dtype=torch.int32)
        more = target.tokens(1, 4), torch.tensor([0, 2, 2, 4], dtype=torch.int32)
        weights = None
    else:
        ids, offsets = target.tokens(1, 150), torch.tensor([0, 40, 41, 150], dtype=torch.int32, device=target.device)
        more = None
        weights = torch.randn(1, 150, target.vocab_size, device=target.device)
    step = target.tokens(3, 1)
    results = {}
    for backend in ("torch", target.backend):
        use_backend(monkeypatch, backend)
        model.zero_grad()
        out = model(ids, cu_seqlens=offsets, use_cache=True)
        weighted_sum(out.logits, weights).backward()
        logits = [out.logits.detach()]
        with torch.no_grad():
            if more is not None:
                out = model(more[0], cu_seqlens=more[1], past_key_values=returned_cache(out), use_cache=True)
                logits.append(out.logits)
            logits.append(model(step, past_key_values=returned_cache(out), use_cache=True).logits)
        results[backend] = logits, grads_of(model), returned_cache(out)
    layers = model.config.num_hidden_layers
    if target.device == "cpu":
        # FoX: fla attends to whole sequences only; the call continuing a cached timeline goes through the torch op
        assert_calls(fla_calls, family, model, {name: {op: 1 if name == "fox" else 2} for name, op in CHUNK.items()},
                     suffix="[packed]")
        assert rotary_op_calls(fla_calls, "[packed]") == 2 * layers
    else:
        assert sum(n for name, n in fla_calls.items() if name.endswith("[packed]")) == layers
    (logits_x, grads_x, cache_x), (logits_t, grads_t, cache_t) = results[target.backend], results["torch"]
    selective = model.config.position_embedding == "selective_rope"
    assert selective == any("rotary" in name for name in grads_t)  # Selective RoPE's parameters are trained
    names = ("packed", "packed continuing the cache", "decoding step") if more is not None else ("packed",
                                                                                                 "decoding step")
    for name, a, e in zip(names, logits_x, logits_t):
        target.assert_close(a, e, f"{name} logits")
    assert_same_grads(target, grads_x, grads_t)
    assert_same_caches(target, cache_x, cache_t)


@needs_cpu_interpreter
def test_fox_outputs_at_pads_are_zero_on_both_paths(fla_calls):
    """Right-padded rows: fla's kernel and the torch op agree everywhere, pad positions included (zeros there)."""
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    log_fgate = torch.nn.functional.logsigmoid(torch.randn(2, 9, 4) + 2)
    valid = torch.arange(9) < torch.tensor([[6], [9]])
    outputs = {b: forgetting_attention(q, k, v, log_fgate, key_valid=valid, backend=b)
               for b in ("torch", "triton")}
    assert fla_calls["parallel_forgetting_attn"] == 1
    assert (outputs["torch"][0, 6:] == 0).all() and (outputs["triton"][0, 6:] == 0).all()
    scale = max(outputs["torch"].abs().max().item(), 1.0)
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-5, atol=1e-5 * scale,
                               msg=lambda m: f"attention outputs: {m}")


# --------------------------------------------------------------------------------------------------------------------
# the rotary ops on CUDA (on CPU: tests/kernels/test_rotary_triton.py, under the interpreter)
# --------------------------------------------------------------------------------------------------------------------
DEVICE = "cuda"


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


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotary_op_matches_torch(dtype, compiled, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    op = dispatch.triton_rotary().selective_rotary_triton
    if compiled:
        op = torch.compile(op, fullgraph=True)
    args = rotary_inputs(dtype)
    actual, expected = op(*args), selective_rotary(*args)
    tol = CUDA_OP_TOLERANCE[dtype]
    for name, a, e in zip(("q", "k", "phase"), actual, expected):
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol * max(1.0, e.abs().max().item()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    for name, a, e in zip(("dq", "dk", "dincrement", "dtemperature", "dphase0"), op_grads(actual, args),
                          op_grads(expected, args)):
        assert_ratio(a, e, name, 1e-4 if dtype == FP32 else 1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotary_op_packed_on_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    op = dispatch.triton_rotary().selective_rotary_triton
    q, k, increment, temperature, _ = rotary_inputs(FP32, batch=1, seq_len=700)
    offsets = torch.tensor([0, 1, 300, 300, 700], dtype=torch.int32, device=DEVICE)
    out_q, out_k, final = op(q, k, increment, temperature, cu_seqlens=offsets)
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        ref_q, ref_k, ref_final = selective_rotary(q[:, start:end], k[:, start:end], increment[:, start:end],
                                                   temperature)
        torch.testing.assert_close(out_q[:, start:end], ref_q, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(out_k[:, start:end], ref_k, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(final[i], ref_final[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotary_decode_matches_torch(dtype, monkeypatch):
    from selective_rope.kernels.conv_torch import causal_conv1d

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
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
    tol = CUDA_OP_TOLERANCE[dtype]
    torch.testing.assert_close(actual[0].float(), ref_q[:, 0].float(), rtol=tol, atol=10 * tol)
    torch.testing.assert_close(actual[1].float(), ref_k[:, 0].float(), rtol=tol, atol=10 * tol)
    torch.testing.assert_close(actual[2], ref_phase, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(actual[3], new_history, rtol=0, atol=0)
