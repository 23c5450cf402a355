"""The control: transformers' own Llama through the same harness (tester, mixin, generation checks). What fails here
is the harness's, not our models'."""

import unittest

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from families import TOKENS
from testers import ConformanceTest


class LlamaConformanceTest(ConformanceTest, unittest.TestCase):
    config_class, model_class, lm_class = LlamaConfig, LlamaModel, LlamaForCausalLM
    config_kwargs = dict(**TOKENS, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8)
