"""Model directories vLLM must refuse with a message that names the problem."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINE, TINY, TOKENS, save_tiny, tokenizer
from vllm import LLM

import selective_rope


def _rewrite_config(directory, **fields) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def test_unknown_architecture_is_refused(tmp_path):
    save_tiny("gla", tmp_path)
    _rewrite_config(tmp_path, architectures=["SelectiveRopeMambaForCausalLM"])
    with pytest.raises(Exception, match=r"Model architectures \['SelectiveRopeMambaForCausalLM'\] are not supported"):
        LLM(model=str(tmp_path), **ENGINE)


def test_another_familys_model_is_refused(tmp_path):
    """A GLA model whose config.json names FoX's architecture: FoX's class refuses the GLA config."""
    save_tiny("gla", tmp_path)
    _rewrite_config(tmp_path, architectures=["SelectiveRopeFoXForCausalLM"])
    with pytest.raises(Exception, match="SelectiveRopeFoXForCausalLM serves selective_rope_fox models, but this "
                                        "model's config has model_type 'selective_rope_gla'"):
        LLM(model=str(tmp_path), **ENGINE)


def test_fox_head_dim_the_attention_backend_does_not_take_is_refused(tmp_path):
    """FoX's keys and values live in vLLM's K/V pages, which its CPU attention backend lays out only for some head
    dims: a FoX model with head_dim 16 is refused when the engine builds the model, not at its first step."""
    lm_class, options = TINY["fox"]
    lm_class(lm_class.config_class(**{**options, "head_dim": 16})).save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    with pytest.raises(Exception, match=r"attention backend, which keeps FoX's keys and values, does not take "
                                        r"head_dim=16; it takes \[32, 64"):
        LLM(model=str(tmp_path), **ENGINE)


def test_a_hybrid_model_is_refused_as_not_yet_served(tmp_path):
    """The hybrid family is not served yet: vLLM refuses its architecture instead of serving it as a state model."""
    config = selective_rope.SelectiveRopeHybridConfig(
        **TOKENS, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)
    selective_rope.SelectiveRopeHybridForCausalLM(config).save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    with pytest.raises(Exception, match=r"Model architectures \['SelectiveRopeHybridForCausalLM'\] are not supported"):
        LLM(model=str(tmp_path), **ENGINE)
