"""The decoding cache (modeling/cache.py): per-layer named states, the batch operations beam search and
``num_return_sequences`` use, and ``crop`` (per-token histories roll back, running states refuse)."""

from __future__ import annotations

import pytest
import torch

from selective_rope import SelectiveRopeCache, SelectiveRopeFoXConfig, SelectiveRopeFoXForCausalLM
from selective_rope.modeling.cache import SelectiveRopeCacheLayer

from families import FAMILIES

FOX = FAMILIES["fox"]


def filled_layer(token_states=("keys",)) -> tuple[SelectiveRopeCacheLayer, dict[str, torch.Tensor]]:
    """A layer after a 5-token call: a per-token history ``keys`` (B, T, H, D) and a running ``recurrent`` state."""
    states = {"keys": torch.randn(3, 5, 2, 4), "recurrent": torch.randn(3, 2, 4, 4)}
    layer = SelectiveRopeCacheLayer()
    layer.set(dict(states), num_new_tokens=5, token_states=token_states)
    return layer, states


def test_set_counts_tokens_and_reports_transformers_sizes():
    layer, states = filled_layer()
    assert layer.is_initialized and layer.get_seq_length() == 5
    assert layer.get_mask_sizes(query_length=2) == (7, 0)  # (key length, offset) for the next 2-token call
    layer.set({"recurrent": torch.zeros(3, 2, 4, 4)}, num_new_tokens=1, token_states=("keys",))
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
        returned = model(torch.randint(3, 61, (2, 4)), past_key_values=cache, use_cache=True).past_key_values
    assert returned is cache and cache.is_initialized and cache.get_seq_length() == 4
    with pytest.raises(NotImplementedError, match="named states"):
        cache.layers[0].update(torch.zeros(1), torch.zeros(1))


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
        cache = model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True).past_key_values
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
        cache = model(torch.randint(3, 61, (1, 5)), use_cache=True).past_key_values
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)


