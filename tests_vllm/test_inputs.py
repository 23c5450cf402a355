"""Model directories vLLM must refuse with a message that names the problem."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINE, save_tiny
from vllm import LLM


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
