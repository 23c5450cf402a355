"""The decoding cache on its own: token-history appends, the per-layer state a mixer fills, what ``crop`` may cut."""

from __future__ import annotations

import pytest
import torch

from selective_rope.modeling.cache import SelectiveRopeCacheLayer, append_tokens
from selective_rope.modeling.mixer import LayerState


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


def commit(layer, states, tokens, histories=()):
    state = LayerState(layer.states, keep=True)
    for name, tensor in states.items():
        (state.extend if name in histories else state.set)(name, tensor)
    layer.commit(state.new, num_new_tokens=tokens, token_states=state.token_histories)


def test_crop_shortens_token_histories_and_refuses_running_states():
    layer = SelectiveRopeCacheLayer()
    keys = torch.randn(2, 6, 4)
    commit(layer, {"key": keys, "valid": torch.ones(2, 6, dtype=torch.bool)}, 6, histories={"key", "valid"})
    with torch.no_grad():
        commit(layer, {"key": torch.randn(2, 1, 4), "valid": torch.ones(2, 1, dtype=torch.bool)}, 1,
               histories={"key", "valid"})
    assert layer.get_seq_length() == 7
    layer.crop(-3)
    assert layer.get_seq_length() == 4 and torch.equal(layer.states["key"], keys[:, :4])
    assert layer.states["valid"].shape == (2, 4)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)

    running = SelectiveRopeCacheLayer()
    commit(running, {"key": keys, "rotary.phase": torch.zeros(2, 3)}, 6, histories={"key"})
    with pytest.raises(NotImplementedError, match="rotary.phase"):
        running.crop(-1)


def test_batch_operations_act_on_every_state_alike():
    layer = SelectiveRopeCacheLayer()
    recurrent, keys = torch.arange(3.0)[:, None], torch.arange(3.0)[:, None, None].expand(3, 2, 1)
    commit(layer, {"recurrent": recurrent, "key": keys}, 2, histories={"key"})
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert layer.states["recurrent"].flatten().tolist() == [2, 0, 1]
    assert layer.states["key"][:, 0, 0].tolist() == [2, 0, 1]
    layer.batch_repeat_interleave(2)
    assert layer.states["recurrent"].flatten().tolist() == [2, 2, 0, 0, 1, 1]
    layer.batch_select_indices(torch.tensor([0, 4]))
    assert layer.states["key"][:, 1, 0].tolist() == [2, 1]
