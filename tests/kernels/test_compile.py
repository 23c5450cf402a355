"""torch.compile: every family trains and decodes with a cache under ``torch.compile`` (dynamic shapes and the default),
with the eager results.

Compiling a whole model takes minutes on a small CPU, so the default run keeps one cheap check of what broke before:
FoX's attention op under dynamic shapes, at the shapes of training and of cached decoding (torch 2.13 failed there
with "sources must not be empty for symbol ..." while building guards). The whole-model checks are ``slow``:
``python -m pytest tests/kernels/test_compile.py -m slow``.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from selective_rope.kernels.forgetting_attention_torch import forgetting_attention
from selective_rope.modeling import returned_cache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or automatic-dynamic decisions carried between tests
    yield
    torch._dynamo.reset()


def _attention_inputs(batch, queries, keys, generator, requires_grad=False):
    """q (B, Tq, 4, 8), k/v (B, Tk, 2, 8), log forget gates (B, Tk, 4), a key mask with a hole in row 0."""
    q = torch.randn(batch, queries, 4, 8, generator=generator)
    k, v = (torch.randn(batch, keys, 2, 8, generator=generator) for _ in range(2))
    log_fgate = torch.nn.functional.logsigmoid(torch.randn(batch, keys, 4, generator=generator) + 2)
    key_valid = torch.ones(batch, keys, dtype=torch.bool)
    key_valid[0, 1] = False  # left padding leaves holes in a cached timeline
    tensors = [t.requires_grad_(requires_grad) for t in (q, k, v, log_fgate)]
    return (*tensors, key_valid)


def test_forgetting_attention_compiles_for_training_and_decoding_with_dynamic_shapes():
    """The FoX op compiles without a graph break (its blockwise paths are custom ops), matches eager in training
    (outputs and gradients) and in decoding, and a growing key timeline does not recompile it."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(forgetting_attention, backend=counter, dynamic=True, fullgraph=True)
    generator = torch.Generator().manual_seed(0)

    inputs = _attention_inputs(2, 7, 7, generator, requires_grad=True)  # training: a whole sequence
    expected = forgetting_attention(*inputs[:4], key_valid=inputs[4])
    actual = compiled(*inputs[:4], key_valid=inputs[4])
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    weights = torch.randn(expected.shape, generator=generator)
    grads = torch.autograd.grad((expected * weights).sum(), inputs[:4])
    compiled_grads = torch.autograd.grad((actual * weights).sum(), inputs[:4])
    for name, a, e in zip(("q", "k", "v", "log_fgate"), compiled_grads, grads):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6, msg=name)

    with torch.no_grad():  # decoding: one query against a key timeline one token longer each step
        for step, keys in enumerate(range(8, 12)):
            q, k, v, log_fgate, key_valid = _attention_inputs(2, 1, keys, generator)
            torch.testing.assert_close(compiled(q, k, v, log_fgate, key_valid=key_valid),
                                       forgetting_attention(q, k, v, log_fgate, key_valid=key_valid),
                                       atol=1e-6, rtol=1e-6)
            if step == 0:
                frames = counter.frame_count
        assert counter.frame_count == frames, "a longer key timeline recompiled the op"


def test_forgetting_attention_custom_ops_are_well_formed():
    """Schema, fake (meta) shapes and the registered autograd formula of the three ops (torch.library.opcheck)."""
    from selective_rope.kernels import forgetting_attention_torch as fox

    generator = torch.Generator().manual_seed(1)
    q, k, v, log_fgate, key_valid = _attention_inputs(2, 5, 5, generator)
    # as `forgetting_attention` passes them: heads-first views of (B, T, H, D) tensors, float32; gates float64
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    cum = log_fgate.double().cumsum(1).transpose(1, 2).contiguous()
    for cum_, valid in ((cum, key_valid), (None, None)):
        args = (q, k, v, cum_, valid, 8**-0.5, 2)
        torch.library.opcheck(fox._attention_inference_op, args)
        grad_args = tuple(x.clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
                          else x for x in args)
        torch.library.opcheck(fox._blockwise_forward_op, grad_args)
        o = fox._blockwise_forward_op(*args)
        do = torch.randn(o.shape, generator=generator)
        torch.library.opcheck(fox._blockwise_backward_op, (do, q, k, v, cum_, valid, o, 8**-0.5, 2))


# ------------------------------------------------------------------------------------------------- whole models


def _tiny(family):
    torch.manual_seed(0)
    return family.lm_class(family.config_class(**{**family.tiny, "num_hidden_layers": 1}))


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
def test_models_train_and_decode_under_torch_compile(family, dynamic):
    """model.compile(): a training step (loss and every gradient), cached decoding token by token (logits against the
    eager full forward) and generate() (tokens against eager generate), as users compile (inductor)."""
    import torch._inductor.config

    # Compile afresh: inductor's graph cache (kept across processes) does not key on our custom ops' fake
    # implementations, so a graph cached by an earlier version of the code would be reused unchecked.
    with torch._inductor.config.patch(fx_graph_cache=False):
        _train_decode_generate(family, dynamic)


def _train_decode_generate(family, dynamic) -> None:
    eager, model = _tiny(family), _tiny(family)
    ids = torch.randint(3, family.tiny["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = eager.eval()(ids).logits
        generated = eager.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.compile(dynamic=dynamic)

    eager.train(), model.train()
    expected, actual = eager(ids, labels=ids).loss, model(ids, labels=ids).loss
    expected.backward(), actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for (name, a), e in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-4, msg=name)

    model.eval()
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        logits = [out.logits]
        for t in range(5, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=returned_cache(out), use_cache=True)
            logits.append(out.logits)
        torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)
        assert torch.equal(model.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0), generated)



def test_a_training_forward_traces_without_graph_breaks(family):
    """The input checks and the Selective RoPE module trace as one graph: a value check (``.tolist()`` on the labels)
    and a class attribute read inside an autograd Function each broke the graph, with a warning at every compile.
    ``torch._dynamo.explain`` traces without compiling, so this stays cheap."""
    model = family.lm_class(family.config_class(**family.tiny, position_embedding="selective_rope")).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    explanation = torch._dynamo.explain(model)(ids, labels=ids)
    assert explanation.graph_break_count == 0, [reason.reason.splitlines()[0] for reason in explanation.break_reasons]


@pytest.mark.parametrize("name", ["fox", pytest.param("gla", marks=pytest.mark.slow),
                                  pytest.param("gated_deltanet", marks=pytest.mark.slow),
                                  pytest.param("hybrid", marks=pytest.mark.slow)])
def test_the_fused_rotary_op_traces_without_graph_breaks(name):
    """On ``"triton"`` (under the interpreter here) the default phase path is the fused op from the input
    (``rotary_fused_triton``): one custom op per layer in the traced graph, no graph break. Mixers stay on PyTorch
    on the CPU (fla serves CUDA tensors only)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from selective_rope.kernels import dispatch

    from families import FAMILIES

    if not dispatch.interpreting():
        pytest.skip("checked on CPU tensors: the Triton kernels run there under TRITON_INTERPRET=1")
    family = FAMILIES[name]
    model = family.lm_class(family.config_class(**family.tiny, position_embedding="selective_rope",
                                                backend="triton")).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    explanation = torch._dynamo.explain(model)(ids, labels=ids)
    assert explanation.graph_break_count == 0, [reason.reason.splitlines()[0] for reason in explanation.break_reasons]
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert sum("rotary_from_input" in target for target in targets) == model.config.num_hidden_layers

