"""transformers' common model tests on FoX (see testers.py): softmax attention, tested as transformers tests Llama
(attention weights included)."""

import unittest

from testers import ConformanceTest

from selective_rope import SelectiveRopeFoXConfig, SelectiveRopeFoXForCausalLM, SelectiveRopeFoXModel
from families import TINY


class SelectiveRopeFoXConformanceTest(ConformanceTest, unittest.TestCase):
    config_class, model_class, lm_class = SelectiveRopeFoXConfig, SelectiveRopeFoXModel, SelectiveRopeFoXForCausalLM
    config_kwargs = TINY["fox"]
