"""transformers' common model tests on GLA (see testers.py)."""

import unittest

from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM, SelectiveRopeGLAModel

from families import TINY
from testers import ConformanceTest


class SelectiveRopeGLAConformanceTest(ConformanceTest, unittest.TestCase):
    config_class, model_class, lm_class = SelectiveRopeGLAConfig, SelectiveRopeGLAModel, SelectiveRopeGLAForCausalLM
    config_kwargs = TINY["gla"]
    has_attentions = False  # linear attention has no attention weights: as transformers' Mamba2 tester
    # no num_attention_heads (the heads are num_heads, as fla names them): as Mamba2's ConfigTester
    config_common_properties = ["hidden_size", "num_hidden_layers"]
