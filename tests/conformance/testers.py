"""One conformance tester per model family, after transformers' ``tests/causal_lm_tester.py`` (which its sdist does not
ship): a tiny config, inputs as that tester makes them, and transformers' ``ModelTesterMixin`` + ``ConfigTester``
(from the installed version's sdist, see ``upstream.py``) plus our generation checks.

A family's test module is one small class::

    class TestGLA(ConformanceTest, unittest.TestCase):
        config_class, model_class, lm_class = GLAConfig, GLAModel, GLAForCausalLM
        config_kwargs = dict(...)  # tiny
        has_attentions = False  # linear attention, as transformers' Mamba2 tester

Every skip or switched-off test names the transformers precedent it follows.
"""

from __future__ import annotations

import torch
from transformers import set_seed

import upstream
from generation_checks import GenerationChecks

common = upstream.load(generation_mixin=GenerationChecks)


class CausalLMTester:
    """Config and inputs for the mixin, as ``causal_lm_tester.CausalLMModelTester`` makes them: random token ids and a
    lower-triangular attention mask (row i keeps its first i + 1 tokens: right padding of every length)."""

    batch_size = 2
    seq_length = 7
    is_training = True

    def __init__(self, parent, config_class, config_kwargs: dict):
        self.parent = parent
        self.config_class = config_class
        self.config_kwargs = config_kwargs
        config = self.get_config()
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.num_attention_heads = getattr(config, "num_attention_heads", getattr(config, "num_heads", None))

    def get_config(self):
        return self.config_class(**self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.test_modeling_common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class ConformanceTest(common.ModelTesterMixin, GenerationChecks):
    """transformers' common model tests for one family (``config_class``, ``model_class``, ``lm_class``,
    ``config_kwargs``); mix with ``unittest.TestCase``."""

    config_class: type
    model_class: type
    lm_class: type
    config_kwargs: dict
    # ConfigTester's attributes every config must have; None: its default (hidden_size, num_attention_heads,
    # num_hidden_layers)
    config_common_properties: list[str] | None = None

    # Models whose layers carry state that cannot be rolled back (recurrences, the Selective RoPE phase) are
    # "stateful" for transformers (`_is_stateful`, as Mamba2 and the other linear-attention models); the mixin reads
    # this flag from the model classes themselves.

    @classmethod
    def setUpClass(cls):
        cls.all_model_classes = (cls.model_class, cls.lm_class)
        model_type = cls.config_class.model_type
        upstream.register_names(model_type, cls.model_class, cls.lm_class)

    def setUp(self):
        set_seed(0)  # each test draws the same inputs and weights in every run: the suite is deterministic
        self.model_tester = CausalLMTester(self, self.config_class, self.config_kwargs)
        self.config_tester = common.ConfigTester(self, config_class=self.config_class,
                                                 common_properties=self.config_common_properties, **self.config_kwargs)

    def test_config(self):
        self.config_tester.run_common_tests()
