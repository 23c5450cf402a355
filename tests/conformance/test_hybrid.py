"""transformers' common model tests on the hybrid (see testers.py): Gated DeltaNet and FoX-style softmax-attention
layers by ``layer_types``, a sparse MoE block. Only the attention layers return weights, so the attention test counts
those layers, as transformers' Qwen3-Next tester does."""

import unittest

import torch

from selective_rope import SelectiveRopeHybridConfig, SelectiveRopeHybridForCausalLM, SelectiveRopeHybridModel

from families import TINY
from testers import ConformanceTest


class SelectiveRopeHybridConformanceTest(ConformanceTest, unittest.TestCase):
    config_class = SelectiveRopeHybridConfig
    model_class, lm_class = SelectiveRopeHybridModel, SelectiveRopeHybridForCausalLM
    config_kwargs = TINY["hybrid"]

    def test_attention_outputs(self):
        """Only the ``full_attention`` layers return weights: one tensor per such layer, ``(B, H, T, T)``, asked by
        the keyword or by the config, and last in the outputs. Overridden as transformers' Qwen3-Next tester does
        (tests/models/qwen3_next: it alternates attention and Gated DeltaNet layers)."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        seq_len = self.model_tester.seq_length
        num_attention_layers = sum(kind == "full_attention" for kind in config.layer_types)
        self.assertGreater(num_attention_layers, 0)  # the tiny config has attention layers to count
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            with torch.no_grad():
                attentions = model(**inputs, output_attentions=True).attentions
            self.assertEqual(len(attentions), num_attention_layers)

            config.output_attentions = True  # from the config
            model = model_class(config).eval()
            with torch.no_grad():
                outputs = model(**inputs)
            self.assertEqual(len(outputs.attentions), num_attention_layers)
            self.assertListEqual(list(outputs.attentions[0].shape[-3:]),
                                 [config.num_attention_heads, seq_len, seq_len])
            out_len = len(outputs)

            with torch.no_grad():  # attentions stay last, hidden states come before them
                outputs = model(**inputs, output_attentions=True, output_hidden_states=True)
            self.assertEqual(len(outputs), out_len + 1)
            self.assertEqual(len(outputs.attentions), num_attention_layers)
            self.assertListEqual(list(outputs.attentions[0].shape[-3:]),
                                 [config.num_attention_heads, seq_len, seq_len])
            config.output_attentions = False
