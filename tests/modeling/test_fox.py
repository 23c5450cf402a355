"""FoX-specific properties: the Llama-family identity, bounded attention memory, the growing key timeline (cache
cropping: tests/modeling/test_cache.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from selective_rope import SelectiveRopeFoXConfig, SelectiveRopeFoXForCausalLM
from selective_rope.conversion.llama import fox_config_from_llama, fox_key_from_llama, llama_rope
from selective_rope.modeling import returned_cache

from families import FAMILIES

FOX = FAMILIES["fox"]
SHAPE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, pad_token_id=0)
SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict()),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(attention_bias=True)),
}


def as_fox(source):
    """Our FoX model carrying ``source``'s weights (the mapping the converter uses)."""
    fox = SelectiveRopeFoXForCausalLM(fox_config_from_llama(source.config)).eval()
    state = {fox_key_from_llama(name): tensor for name, tensor in source.state_dict().items()}
    for i in range(source.config.num_hidden_layers):
        state[f"model.layers.{i}.attn.rotary.temperature"] = llama_rope(source.config)[0]
    missing, unexpected = fox.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return fox


@pytest.mark.parametrize("architecture", sorted(SOURCES))
def test_llama_family_identity(architecture):
    config_class, model_class, extra = SOURCES[architecture]
    source = model_class(config_class(**SHAPE, **extra)).eval()
    with torch.no_grad():  # biases and norm weights that matter
        for name, param in source.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    fox = as_fox(source)
    assert fox.config.use_forget_gate is False and fox.config.position_embedding == "rope"
    ids = torch.randint(3, 61, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(fox(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)
    expected = source.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fox.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)


def test_unsupported_llama_sources_are_refused():
    with pytest.raises(ValueError, match="unsupported RoPE type 'dynamic'"):
        fox_config_from_llama(LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                    "factor": 2.0}))
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="unsupported source architecture 'gpt2'"):
        fox_config_from_llama(GPT2Config())


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("length", [2048, 16384])
@pytest.mark.parametrize("use_forget_gate", [True, False])
def test_prefill_never_materialises_all_scores(use_forget_gate, length):
    """A long prefill works on blocks of queries: no tensor holds the scores of every head for every pair."""
    config = SelectiveRopeFoXConfig(**{**FOX.tiny, "num_hidden_layers": 1, "use_forget_gate": use_forget_gate})
    model = SelectiveRopeFoXForCausalLM(config).eval()
    heads = config.num_attention_heads
    probe = LargestTensor()
    with torch.no_grad(), probe:
        model(torch.randint(3, 61, (1, length)), use_cache=False)
    assert probe.numel <= length * length * heads // 4, probe.numel


@pytest.mark.parametrize("position_embedding", ["selective_rope", "rope"])
def test_key_validity_is_cached_from_the_first_padding_on(position_embedding):
    """Without padding the cache keeps no per-slot validity (nothing to check, no device sync per layer). The first
    call with padding starts it, all real before it; then decoding goes on as the full forward over the same mask
    (RoPE's positions, counted from the cached slots until then, count real tokens from then on)."""
    torch.manual_seed(0)
    model = SelectiveRopeFoXForCausalLM(SelectiveRopeFoXConfig(**SHAPE, position_embedding=position_embedding)).eval()
    ids = torch.randint(1, SHAPE["vocab_size"], (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6] = 0  # row 1's seventh token is padding
    with torch.no_grad():
        out = model(ids[:, :6], use_cache=True)
        cache = returned_cache(out)
        assert all("valid" not in layer.states for layer in cache.layers)
        logits = [out.logits]
        for t in range(6, 9):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            cache = returned_cache(out)
            logits.append(out.logits)
        full = model(ids, attention_mask=mask).logits
    for layer in cache.layers:
        assert torch.equal(layer.states["valid"], mask.bool())
    stepped = torch.cat(logits, dim=1)
    real = mask.bool()
    torch.testing.assert_close(stepped[real], full[real], atol=1e-4, rtol=1e-4)


# -- attention weights (output_attentions) -----------------------------------------------------------------------------

def test_attention_weights_of_a_converted_llama_equal_llamas_eager_weights():
    config_class, model_class, extra = SOURCES["llama"]
    source = model_class(config_class(**SHAPE, **extra, attn_implementation="eager")).eval()
    fox = as_fox(source)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, output_attentions=True).attentions
        ours = fox(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(ours) == len(expected) == SHAPE["num_hidden_layers"]
    for layer, (a, b) in enumerate(zip(ours, expected)):
        # Llama's padded queries attend uniformly to nothing in particular; ours are zero: compare real queries
        torch.testing.assert_close(a * mask[:, None, :, None], b * mask[:, None, :, None], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, layer=layer: f"layer {layer}: {m}")


def fox_with_gate():
    torch.manual_seed(0)
    model = FOX.lm_class(FOX.config_class(**FOX.tiny)).eval()
    with torch.no_grad():  # forget gates far from 1, so the bias matters
        for layer in model.model.layers:
            layer.attn.f_proj.bias.fill_(-1.0)
    return model


def test_output_attentions_keeps_the_outputs_and_follows_the_config():
    model = fox_with_gate()
    ids = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        out = model(ids, output_attentions=True)
    assert plain.attentions is None
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=1e-5)  # eager path = blockwise op
    heads = FOX.tiny["num_attention_heads"]
    assert [tuple(a.shape) for a in out.attentions] == [(2, heads, 8, 8)] * FOX.tiny["num_hidden_layers"]
    for weights in out.attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, heads, 8))
        assert not weights.triu(1).any()  # causal
    model.config.output_attentions = True  # the config's default, as for transformers' models
    with torch.no_grad():
        from_config = model(ids).attentions
    for a, b in zip(from_config, out.attentions):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_attention_weights_with_padding_and_a_cache_equal_the_full_sequence():
    model = fox_with_gate()
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids[1:], output_attentions=True).attentions  # row 1 alone, (1, H, 9, 9)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        padded = model(ids, attention_mask=mask, output_attentions=True).attentions
        alone = model(ids[:1, 3:], output_attentions=True).attentions  # row 0's real tokens, (1, H, 6, 6)
        prefill = model(ids[1:, :6], use_cache=True)
        steps = model(ids[1:, 6:], past_key_values=returned_cache(prefill), output_attentions=True).attentions
    for layer in range(FOX.tiny["num_hidden_layers"]):
        torch.testing.assert_close(padded[layer][1:], full[layer], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(padded[layer][:1, :, 3:, 3:], alone[layer], atol=1e-6, rtol=1e-5)
        assert not padded[layer][0, :, :3].any() and not padded[layer][0, :, :, :3].any()  # padding: zero
        torch.testing.assert_close(steps[layer], full[layer][:, :, 6:], atol=1e-6, rtol=1e-5)  # (1, H, 3, 9)


def test_output_attentions_with_packed_sequences_is_refused():
    model = fox_with_gate()
    with pytest.raises(ValueError, match="packed sequences") as error:
        model(torch.randint(3, 61, (1, 6)), cu_seqlens=torch.tensor([0, 2, 6]), output_attentions=True)
    assert "\n" not in str(error.value)
