"""transformers' common model tests on FoX (see testers.py): softmax attention, tested as transformers tests Llama
(attention weights included)."""

import unittest

from selective_rope import SelectiveRopeFoXConfig, SelectiveRopeFoXForCausalLM, SelectiveRopeFoXModel

from families import TINY
from testers import ConformanceTest


class SelectiveRopeFoXConformanceTest(ConformanceTest, unittest.TestCase):
    config_class, model_class, lm_class = SelectiveRopeFoXConfig, SelectiveRopeFoXModel, SelectiveRopeFoXForCausalLM
    config_kwargs = TINY["fox"]
