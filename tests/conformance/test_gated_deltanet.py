"""transformers' common model tests on Gated DeltaNet (see testers.py)."""

import unittest

from selective_rope import (
    SelectiveRopeGatedDeltaNetConfig,
    SelectiveRopeGatedDeltaNetForCausalLM,
    SelectiveRopeGatedDeltaNetModel,
)

from families import TINY
from testers import ConformanceTest


class SelectiveRopeGatedDeltaNetConformanceTest(ConformanceTest, unittest.TestCase):
    config_class = SelectiveRopeGatedDeltaNetConfig
    model_class, lm_class = SelectiveRopeGatedDeltaNetModel, SelectiveRopeGatedDeltaNetForCausalLM
    config_kwargs = TINY["gated_deltanet"]
    has_attentions = False  # linear attention has no attention weights: as transformers' Mamba2 tester
    # no num_attention_heads (the heads are num_heads, as fla names them): as Mamba2's ConfigTester
    config_common_properties = ["hidden_size", "num_hidden_layers"]
