"""The decoding cache (modeling/cache.py): per-layer named states, the batch operations beam search and
``num_return_sequences`` use, and ``crop`` (per-token histories roll back, running states refuse)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from selective_rope import SelectiveRopeCache, SelectiveRopeFoXConfig, SelectiveRopeFoXForCausalLM
from selective_rope.kernels import rotary_cpu
from selective_rope.modeling import returned_cache
from selective_rope.modeling.cache import SelectiveRopeCacheLayer, append_tokens
from selective_rope.modeling.mixer import LayerState

from families import FAMILIES

FOX = FAMILIES["fox"]


def filled_layer(token_states=("keys",)) -> tuple[SelectiveRopeCacheLayer, dict[str, torch.Tensor]]:
    """A layer after a 5-token call: a per-token history ``keys`` (B, T, H, D) and a running ``recurrent`` state."""
    states = {"keys": torch.randn(3, 5, 2, 4), "recurrent": torch.randn(3, 2, 4, 4)}
    layer = SelectiveRopeCacheLayer()
    layer.commit(dict(states), num_new_tokens=5, token_states=token_states)
    return layer, states


def test_commit_counts_tokens_and_reports_transformers_sizes():
    layer, states = filled_layer()
    assert layer.is_initialized and layer.get_seq_length() == 5
    assert layer.get_mask_sizes(query_length=2) == (7, 0)  # (key length, offset) for the next 2-token call
    layer.commit({"recurrent": torch.zeros(3, 2, 4, 4)}, num_new_tokens=1, token_states=("keys",))
    assert layer.get_seq_length() == 6 and torch.equal(layer.states["keys"], states["keys"])  # others kept
    layer.reset()
    assert not layer.states and layer.get_seq_length() == 0 and not layer.is_initialized


def test_batch_operations_act_on_every_state():
    beams = torch.tensor([2, 0, 0])
    for operation, expected in [
        (lambda layer: layer.reorder_cache(beams), lambda t: t[beams]),
        (lambda layer: layer.batch_repeat_interleave(2), lambda t: torch.cat([t[i:i + 1].repeat(2, *[1] * (t.dim() - 1))
                                                                              for i in range(3)])),
        (lambda layer: layer.batch_select_indices(torch.tensor([1, 2])), lambda t: t[1:3]),
    ]:
        layer, states = filled_layer()
        operation(layer)
        assert layer.states.keys() == states.keys()
        for name, original in states.items():
            assert torch.equal(layer.states[name], expected(original)), name
        assert layer.get_seq_length() == 5  # the batch changes, the tokens seen do not


def test_crop_shortens_token_histories_and_refuses_running_states():
    layer, states = filled_layer(token_states=("keys", "recurrent"))  # as if both were per-token
    layer.states["recurrent"] = torch.randn(3, 5, 4)
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and torch.equal(layer.states["keys"], states["keys"][:, :3])
    layer.crop(-10)  # more than seen: everything goes, never a negative count
    assert layer.get_seq_length() == 0 and layer.states["keys"].shape[1] == 0
    running, _ = filled_layer(token_states=("keys",))
    with pytest.raises(NotImplementedError, match=r"cannot be rolled back \(recurrent\)"):
        running.crop(-1)
    with pytest.raises(ValueError, match="negative"):
        running.crop(2)
    running.crop(0)  # nothing to remove: allowed whatever the cache holds
    assert running.get_seq_length() == 5


def test_cache_has_one_layer_per_model_layer_and_reads_the_first_layers_length(family):
    config = family.config_class(**family.tiny)
    cache = SelectiveRopeCache(config)
    assert len(cache.layers) == config.num_hidden_layers and not cache.is_initialized
    assert cache.get_seq_length() == 0 and cache.get_seq_length(layer_idx=config.num_hidden_layers) == 0
    model = family.lm_class(config).eval()
    with torch.no_grad():
        returned = returned_cache(model(torch.randint(3, 61, (2, 4)), past_key_values=cache, use_cache=True))
    assert returned is cache and cache.is_initialized and cache.get_seq_length() == 4
    with pytest.raises(NotImplementedError, match="named states"):
        cache.layers[0].update(torch.zeros(1), torch.zeros(1))


@torch.no_grad()
def test_a_call_mutates_only_a_cache_that_keeps_its_state(family):
    """The compiled CPU rotary step overwrites the cached Selective RoPE state in place (``overwrite_state``), but
    only for a call that keeps its state: ``use_cache=False`` leaves a given cache exactly as it was, and a
    ``copy.deepcopy`` taken before a call (how to branch) keeps the old state."""
    model = family.lm_class(family.config_class(**family.tiny)).eval()
    ids = torch.randint(3, 61, (2, 6))
    cache = returned_cache(model(ids[:, :5], use_cache=True))
    branch = copy.deepcopy(cache)
    before = copy.deepcopy(cache)
    phase = cache.layers[0].states["rotary.phase"]

    untouched = model(ids[:, 5:], past_key_values=cache, use_cache=False).logits
    for layer, old in zip(cache.layers, before.layers):
        assert layer.states.keys() == old.states.keys() and layer.seen_tokens == old.seen_tokens
        for name, tensor in old.states.items():
            assert torch.equal(layer.states[name], tensor), name

    kept = model(ids[:, 5:], past_key_values=cache, use_cache=True).logits
    assert torch.equal(kept, untouched)
    if rotary_cpu.available():  # overwritten in place (with the next phase), not replaced
        assert cache.layers[0].states["rotary.phase"] is phase
        assert not torch.equal(phase, before.layers[0].states["rotary.phase"])
    for layer, old in zip(branch.layers, before.layers):  # the deep copy did not move
        for name, tensor in old.states.items():
            assert torch.equal(layer.states[name], tensor), name
    assert torch.equal(model(ids[:, 5:], past_key_values=branch, use_cache=True).logits, kept)


# -- crop through a whole model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("position_embedding", ["rope", "nope"])
def test_crop_rolls_the_attention_cache_back(position_embedding):
    config = SelectiveRopeFoXConfig(**{**FOX.tiny, "position_embedding": position_embedding,
                                       "use_k_shift": False, "use_v_shift": False})
    model = SelectiveRopeFoXForCausalLM(config).eval()
    ids = torch.randint(3, 61, (2, 12))
    other = torch.randint(3, 61, (2, 3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: holes in the key timeline survive the crop
    with torch.no_grad():
        cache = returned_cache(model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True))
        for t in range(9, 12):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
        cache.crop(-3)
        assert cache.get_seq_length() == 9
        steps = [model(other[:, j:j + 1], attention_mask=mask[:, :10 + j], past_key_values=cache,
                       use_cache=True).logits for j in range(3)]
        full = model(torch.cat([ids[:, :9], other], 1), attention_mask=mask).logits[:, 9:]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family_name,overrides", [("fox", {}), ("fox", {"position_embedding": "rope"}),
                                                   ("gla", {}), ("gated_deltanet", {})])
def test_crop_refuses_states_it_cannot_roll_back(family_name, overrides):
    family = FAMILIES[family_name]
    model = family.lm_class(family.config_class(**{**family.tiny, **overrides})).eval()
    with torch.no_grad():
        cache = returned_cache(model(torch.randint(3, 61, (1, 5)), use_cache=True))
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)


# -- token-history appends and the per-layer state the mixers fill ----------------------------------------------------

@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_append_tokens_grows_a_buffer_in_place_and_equals_cat(mode):
    first, steps = torch.randn(2, 5, 3, 4), [torch.randn(2, 1, 3, 4) for _ in range(4)]
    with mode():
        timeline = append_tokens(first, steps[0])  # copied once into a buffer with spare room
        address = timeline.data_ptr()
        for step in steps[1:]:
            timeline = append_tokens(timeline, step)
            assert timeline.data_ptr() == address  # written in place, no copy of the timeline
        assert torch.equal(timeline, torch.cat([first, *steps], dim=1))
        cropped = append_tokens(timeline[:, :6], steps[3])  # after crop(-3): the freed slots are reused
        assert cropped.data_ptr() == address and torch.equal(cropped, torch.cat([first, steps[0], steps[3]], 1))
        reordered = timeline.index_select(0, torch.tensor([1, 0]))  # beam search: a fresh tensor, a new buffer
        regrown = append_tokens(reordered, steps[0])
        assert regrown.data_ptr() != address and torch.equal(regrown, torch.cat([reordered, steps[0]], 1))
        assert torch.equal(cropped, torch.cat([first, steps[0], steps[3]], 1))  # the old buffer is untouched
    leaf = torch.randn(2, 5, 3, 4, requires_grad=True)
    grown = append_tokens(leaf[:, :4], steps[0])  # with autograd: a plain cat, nothing written in place
    assert torch.equal(grown, torch.cat([leaf[:, :4], steps[0]], dim=1)) and torch.equal(leaf[:, 4], leaf[:, 4])


@pytest.mark.parametrize("inner", [(), (3,), (3, 4)], ids=["valid (B, T)", "gates (B, T, H)", "keys (B, T, H, D)"])
def test_append_tokens_buffers_keep_each_heads_rows_together_in_time(inner):
    """Every history shape grows in place and equals the concatenation; keys and values ``(B, T, H, D)`` sit head by
    head in memory, so each head's ``(T, D)`` keys are one dense matrix for attention's matrix products."""
    first, steps = torch.randn(2, 5, *inner), [torch.randn(2, 1, *inner) for _ in range(3)]
    with torch.inference_mode():
        timeline = append_tokens(append_tokens(first, steps[0]), steps[1])
        address = timeline.data_ptr()
        timeline = append_tokens(timeline, steps[2])
        assert timeline.data_ptr() == address
        assert torch.equal(timeline, torch.cat([first, *steps], dim=1))
        if len(inner) == 2:
            heads_first = timeline.transpose(1, 2)  # (B, H, T, D)
            assert all(heads_first[b, h].is_contiguous() for b in range(2) for h in range(inner[0]))
        else:  # time-major, as before
            assert timeline.stride(1) == math.prod(inner) and timeline[0].is_contiguous()


def test_layer_state_scopes_write_prefixed_names_and_read_their_own():
    state = LayerState({"recurrent": torch.zeros(2, 1), "rotary.phase": torch.ones(2, 3)}, keep=True)
    rotary = state.scope("rotary")
    assert "phase" in rotary and "recurrent" not in rotary and "recurrent" in state
    assert rotary.previous().keys() == {"phase"} and torch.equal(rotary.get("phase"), torch.ones(2, 3))
    rotary.set("phase", torch.full((2, 3), 2.0))
    state.set("recurrent", torch.ones(2, 1))
    assert state.new.keys() == {"recurrent", "rotary.phase"} and not state.token_histories
    assert torch.equal(state.get("recurrent"), torch.zeros(2, 1))  # reads stay the cached values of before the call


def test_extend_appends_to_the_cached_history_and_marks_it_croppable():
    first, step = torch.randn(2, 5, 3), torch.randn(2, 1, 3)
    state = LayerState({"key": first}, keep=True)
    with torch.no_grad():
        history = state.extend("key", step)
    assert torch.equal(history, torch.cat([first, step], dim=1)) and state.new["key"] is history
    assert state.token_histories == {"key"}
    fresh = LayerState(keep=False)  # a sequence start: the history is the new tokens
    assert fresh.extend("value", step) is step
