"""The static cache and the compiled decoding step (issue 45), for every family, on the torch backend and on our
Triton kernels (under Triton's interpreter on CPU).

The compiled checks use ``backend="eager"``: dynamo captures the whole step (``fullgraph=True`` turns any graph break
into an error) and installs its guards, without inductor's code generation, which takes many minutes on a small CPU.
What is asserted of a one-token step with a static cache: one graph and no break (``torch._dynamo.explain``, and
``fullgraph=True``, which makes a break an error), no host
synchronisation in it (no ``.item()`` / ``nonzero`` / ``tolist`` node, and dynamo's defaults turn any data-dependent
Python branch into a break), no recompilation as the cache fills, the same tensors (objects and addresses) in the
cache after every step, and the logits of eager decoding with the dynamic cache.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import CompileConfig

from selective_rope import SelectiveRopeStaticCache
from selective_rope.modeling import returned_cache
from selective_rope.modeling.cache import SelectiveRopeStaticCacheLayer

from families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

NO_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
# Every family on the torch backend; on Triton the hybrid by default, the others with `-m slow`. Without a GPU the
# Triton backend changes only the rotary step (the mixers' steps stay torch), the same module in every family, and
# the hybrid has it in both a recurrent and an attention layer; each family's own states are the torch cases'.
FAMILY_BACKENDS = [pytest.param(name, "torch", id=f"{name}-torch") for name in sorted(FAMILIES)] + [
    pytest.param(name, "triton", id=f"{name}-triton", marks=[NO_TRITON] if name == "hybrid" else [NO_TRITON,
                                                                                                 pytest.mark.slow])
    for name in sorted(FAMILIES)]
HOST_READS = {"item", "tolist", "nonzero", "_local_scalar_dense"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or automatic-dynamic decisions carried between tests
    yield
    torch._dynamo.reset()


def _model(family, backend="auto", **overrides):
    return family.lm_class(family.config_class(**{**family.tiny, "backend": backend, **overrides})).eval()


def _padded_prompt(batch=3, length=6):
    ids = torch.randint(3, 61, (batch, length))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding, as generate gives a batch of prompts
    mask[-1, :1] = 0
    return ids, mask


def _states(cache):
    return {(i, name): tensor for i, layer in enumerate(cache.layers) for name, tensor in layer.states.items()}


class _GraphRecorder:
    """A dynamo backend that keeps every graph it is given and runs it as it is (the "eager" backend)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def host_reads(self):
        return [str(node.target) for gm in self.graphs for node in gm.graph.nodes
                if getattr(node.target, "__name__", str(node.target)).split(".")[-1] in HOST_READS]


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS, indirect=["family"])  # conftest.py's `family`
@torch.no_grad()
def test_compiled_step_has_one_graph_no_host_read_and_keeps_the_cache_tensors(family, backend):
    model = _model(family, backend)
    ids, mask = _padded_prompt()
    steps = 4
    dynamic = returned_cache(model(ids, attention_mask=mask, use_cache=True))
    cache = SelectiveRopeStaticCache(model.config, max_cache_len=ids.shape[1] + steps, max_batch_size=3)
    prefill = model(ids, attention_mask=mask, cache=cache)
    tensors = _states(cache)
    addresses = {key: t.data_ptr() for key, t in tensors.items()}
    assert any(name == "rotary.phase" for _, name in tensors) and cache.layers[0].position.item() == ids.shape[1]

    token = prefill.logits[:, -1:].argmax(-1)
    one = torch.ones(3, 1, dtype=torch.long)
    if backend == "torch":  # (a second trace: under the interpreter, fullgraph=True below shows the same, faster)
        explained = torch._dynamo.explain(model)(token, attention_mask=one, cache=copy.deepcopy(cache))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons

    recorder = _GraphRecorder()
    step = torch.compile(model, backend=recorder, fullgraph=True)
    for _ in range(steps):
        expected = model(token, attention_mask=one, cache=dynamic).logits
        logits = step(token, attention_mask=one, cache=cache).logits
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
        assert _states(cache).keys() == tensors.keys()  # no state allocated while decoding
        for key, tensor in _states(cache).items():
            assert tensor is tensors[key] and tensor.data_ptr() == addresses[key], key
        token = logits[:, -1:].argmax(-1)
    assert len(recorder.graphs) == 1  # one compilation for every step: no recompilation as the cache fills
    assert recorder.host_reads() == []
    assert not torch._dynamo.config.capture_scalar_outputs  # (so any .item() would have broken the graph)


# FoX's token-shift states (the last key and value) are set by the mixer itself, not by a kernel: the cache's
# ``commit`` copies them into its tensors.
COPIED_BY_THE_CACHE = {"k_shift", "v_shift"}


def _record_commits(monkeypatch) -> list[tuple[str, bool]]:
    """``(name, whether the tensor handed over is the layer's own)`` for every running state a static layer's
    ``commit`` receives after the prefill: the layer's own tensor means a kernel wrote it, and the cache copies
    nothing."""
    seen = []
    commit = SelectiveRopeStaticCacheLayer.commit

    def recording(self, states, num_new_tokens, token_states=()):
        if self.is_initialized:
            seen.extend((name, tensor is self.states[name]) for name, tensor in states.items()
                        if name not in token_states)
        return commit(self, states, num_new_tokens, token_states)

    monkeypatch.setattr(SelectiveRopeStaticCacheLayer, "commit", recording)
    return seen


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS, indirect=["family"])  # conftest.py's `family`
@torch.no_grad()
def test_decoding_kernels_write_into_the_static_cache_tensors(family, backend, monkeypatch):
    """An eager one-token step with a static cache: the kernels (the rotary step, torch or fused Triton, and the
    torch recurrent and short-convolution steps) write the new running states into the cache's tensors and hand
    those back, so ``commit`` copies none of them; the states and logits are the dynamic cache's, with a padding
    token in one row and without."""
    model = _model(family, backend)
    ids, mask = _padded_prompt()
    dynamic = returned_cache(model(ids, attention_mask=mask, use_cache=True))
    cache = SelectiveRopeStaticCache(model.config, max_cache_len=ids.shape[1] + 2, max_batch_size=3)
    token = model(ids, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
    tensors = _states(cache)
    addresses = {key: t.data_ptr() for key, t in tensors.items()}
    written = _record_commits(monkeypatch)
    for step_mask in (torch.tensor([[1], [0], [1]]), torch.ones(3, 1, dtype=torch.long)):
        expected = model(token, attention_mask=step_mask, cache=dynamic).logits
        logits = model(token, attention_mask=step_mask, cache=cache).logits
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
        for (i, name), tensor in _states(cache).items():
            assert tensor is tensors[i, name] and tensor.data_ptr() == addresses[i, name], name
            if name not in cache.layers[i].token_states:
                torch.testing.assert_close(tensor, dynamic.layers[i].states[name], atol=2e-5, rtol=1e-5)
        token = logits.argmax(-1)
    running = {name for name, _ in written} - COPIED_BY_THE_CACHE
    assert "rotary.phase" in running and (family.name == "fox" or "recurrent" in running)
    assert sorted(name for name, own in written if not own) == sorted(
        name for name, _ in written if name in COPIED_BY_THE_CACHE)


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS, indirect=["family"])  # conftest.py's `family`
@torch.no_grad()
def test_aot_compiled_step_with_in_place_kernels_gives_the_dynamic_logits(family, backend):
    """Under AOTAutograd (``backend="aot_eager"``: functionalization, which the Triton step's custom op passes its
    writes to the cache through, declared with ``mutates_args``), one graph for every step, no break, the cache's
    tensors kept and the dynamic cache's logits."""
    model = _model(family, backend)
    ids, mask = _padded_prompt()
    dynamic = returned_cache(model(ids, attention_mask=mask, use_cache=True))
    cache = SelectiveRopeStaticCache(model.config, max_cache_len=ids.shape[1] + 2, max_batch_size=3)
    token = model(ids, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
    tensors = _states(cache)
    compilations = []
    step = torch.compile(model, backend=lambda gm, inputs: compilations.append(gm) or torch._dynamo.backends.
                         debugging.aot_eager(gm, inputs), fullgraph=True)
    one = torch.ones(3, 1, dtype=torch.long)
    for _ in range(2):
        expected = model(token, attention_mask=one, cache=dynamic).logits
        logits = step(token, attention_mask=one, cache=cache).logits
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
        assert all(tensor is tensors[key] for key, tensor in _states(cache).items())
        for (i, name), tensor in _states(cache).items():
            if name not in cache.layers[i].token_states:
                torch.testing.assert_close(tensor, dynamic.layers[i].states[name], atol=2e-5, rtol=1e-5)
        token = logits.argmax(-1)
    assert len(compilations) == 1


@torch.no_grad()
def test_generate_with_a_compiled_static_cache_gives_the_eager_dynamic_tokens(family):
    """Greedy, 64 steps, a left-padded batch: the compiled step with the static cache, the eager step with it and the
    eager dynamic cache give the same tokens. On CPU transformers compiles only with ``_compile_all_devices``."""
    model = _model(family)
    ids, mask = _padded_prompt()
    options = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(ids, **options)
    assert torch.equal(model.generate(ids, cache_implementation="static", **options), expected)

    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    counted = []
    compile_call = model.get_compiled_call
    model.get_compiled_call = lambda compile_config: counted.append(compile_config) or compile_call(compile_config)
    compiled = model.generate(ids, cache_implementation="static", compile_config=config, **options)
    assert counted == [config]  # generate did compile the step
    assert torch.equal(compiled, expected)


@torch.no_grad()
def test_static_cache_equals_the_dynamic_one_for_a_second_chunk_and_padded_steps(family):
    """Eager calls with a static cache: a prefill, a 3-token continuation and one-token steps with a padding token
    in one row give the dynamic cache's logits (pads included: zeros)."""
    model = _model(family)
    ids, mask = _padded_prompt(batch=2, length=9)
    dynamic, static = None, SelectiveRopeStaticCache(model.config, max_cache_len=12)
    for start, stop in ((0, 5), (5, 8), (8, 9)):
        step_mask = mask[:, start:stop].clone()
        if start == 8:
            step_mask[1] = 0  # a padding token while decoding
        out = model(ids[:, start:stop], attention_mask=step_mask, cache=dynamic, use_cache=True)
        dynamic = returned_cache(out)
        torch.testing.assert_close(model(ids[:, start:stop], attention_mask=step_mask, cache=static).logits,
                                   out.logits, atol=2e-5, rtol=1e-5)
    assert static.get_seq_length() == dynamic.get_seq_length() == 9


@torch.no_grad()
def test_static_cache_refuses_a_step_past_its_length_and_a_larger_batch():
    model = _model(FAMILIES["fox"])
    ids, mask = _padded_prompt(batch=2, length=4)
    cache = SelectiveRopeStaticCache(model.config, max_cache_len=5, max_batch_size=2)
    model(ids, attention_mask=mask, cache=cache)
    model(ids[:, :1], cache=cache)  # the 5th token: the last slot
    with pytest.raises(RuntimeError, match="static cache is full"):
        model(ids[:, :1], cache=cache)
    step = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="static cache is full"):  # compiled alike
        step(ids[:, :1], cache=cache)

    with pytest.raises(ValueError, match="built for at most 2"):
        model(torch.randint(3, 61, (3, 4)), cache=SelectiveRopeStaticCache(model.config, 8, max_batch_size=2))
    with pytest.raises(ValueError, match="holds at most 3"):
        model(ids, cache=SelectiveRopeStaticCache(model.config, max_cache_len=3))
    with pytest.raises(ValueError, match="holds 2 sequences but the input has 1"):
        model(ids[:1, :1], cache=cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(NotImplementedError, match="keeps its batch"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        SelectiveRopeStaticCache(model.config, max_cache_len=0)


@torch.no_grad()
def test_generate_refuses_beam_search_with_a_static_cache():
    model = _model(FAMILIES["gla"])
    with pytest.raises(ValueError, match="does not support beam search"):
        model.generate(torch.randint(3, 61, (1, 4)), num_beams=2, max_new_tokens=2, cache_implementation="static")


@torch.no_grad()
def test_reset_keeps_the_tensors_and_starts_a_new_sequence(family):
    model = _model(family)
    ids = torch.randint(3, 61, (2, 5))
    cache = SelectiveRopeStaticCache(model.config, max_cache_len=8)
    first = model(ids, cache=cache).logits
    tensors = _states(cache)
    cache.reset()
    again = model(ids, cache=cache).logits
    torch.testing.assert_close(again, first, atol=2e-5, rtol=1e-5)
    assert all(tensor is tensors[key] for key, tensor in _states(cache).items())


@pytest.mark.slow
@torch.no_grad()
def test_generate_with_an_inductor_compiled_step_gives_the_eager_tokens(family):
    """The same with inductor's code generation (many minutes per family on a loaded 2-core CPU):
    ``python -m pytest tests/modeling/test_static_cache.py -m slow``."""
    model = _model(family)
    ids, mask = _padded_prompt()
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    compiled = model.generate(ids, cache_implementation="static", compile_config=config, **options)
    assert torch.equal(compiled, model.generate(ids, **options))
