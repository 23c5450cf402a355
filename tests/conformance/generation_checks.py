"""Generation checks in the spirit of transformers' ``GenerationTesterMixin`` (whose ``tests/generation/`` the sdist
does not ship): our own tests, run by every conformance tester, transformers' Llama included as the control.

Each check compares two ways of producing the same thing, so that it fails if either is wrong: decoding with the cache
against decoding without it (logits, not only tokens: identical greedy tokens can hide a drift), left-padded rows
against the same rows alone, a continued cache against one long call, ``inputs_embeds`` against ``input_ids``.
The tester supplies ``model_tester.prepare_config_and_inputs_for_common()`` and ``all_generative_model_classes``.
"""

from __future__ import annotations

import copy

import torch

from selective_rope.modeling.inputs import CACHE_FIELD

TOL = dict(atol=1e-4, rtol=1e-4)
NEW_TOKENS = 4


class GenerationChecks:
    def _generative_models(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_generative_model_classes:
            torch.manual_seed(0)
            model = model_class(copy.deepcopy(config)).eval()
            # no padding, bos or eos token in the prompts (ids 0-2 in every tester): generate would read a pad token
            # as padding when it infers the attention mask from input_ids, but not from inputs_embeds
            yield model, inputs["input_ids"] % (config.vocab_size - 3) + 3

    @staticmethod
    def _generate(model, input_ids, **kwargs):
        # eos never ends a row early, so every call gives NEW_TOKENS tokens; pad_token_id silences generate's notice
        options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=model.config.pad_token_id,
                       eos_token_id=None, return_dict_in_generate=True, output_scores=True, output_logits=True)
        with torch.no_grad():
            return model.generate(input_ids, **{**options, **kwargs})

    def _assert_same_generation(self, out, expected, scores=True):
        self.assertTrue(torch.equal(out.sequences, expected.sequences), f"{out.sequences} != {expected.sequences}")
        for a, b in zip(out.logits, expected.logits):
            torch.testing.assert_close(a, b, **TOL)
        if scores:
            for a, b in zip(out.scores, expected.scores):
                torch.testing.assert_close(a, b, **TOL)

    def test_greedy_generate_dict_outputs_with_and_without_cache(self):
        for model, input_ids in self._generative_models():
            cached = self._generate(model, input_ids, do_sample=False, use_cache=True)
            uncached = self._generate(model, input_ids, do_sample=False, use_cache=False)
            self.assertEqual(cached.sequences.shape, (input_ids.shape[0], input_ids.shape[1] + NEW_TOKENS))
            self.assertTrue(torch.equal(cached.sequences[:, : input_ids.shape[1]], input_ids))
            self.assertEqual(len(cached.scores), NEW_TOKENS)
            self.assertEqual(len(cached.logits), NEW_TOKENS)
            self._assert_same_generation(cached, uncached)
            # each greedy token is the argmax of its step's logits, which are the full forward's logits
            with torch.no_grad():
                full = model(cached.sequences[:, :-1]).logits[:, input_ids.shape[1] - 1 :]
            torch.testing.assert_close(torch.stack(cached.logits, dim=1), full, **TOL)
            self.assertTrue(torch.equal(full.argmax(-1), cached.sequences[:, input_ids.shape[1] :]))

    def test_sample_generate_with_and_without_cache(self):
        for model, input_ids in self._generative_models():
            outs = []
            for use_cache in (True, False):
                torch.manual_seed(7)
                outs.append(self._generate(model, input_ids, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                           num_return_sequences=2, use_cache=use_cache))
            self.assertEqual(outs[0].sequences.shape[0], 2 * input_ids.shape[0])
            # the same draws from the same distributions give the same tokens, with or without the cache
            self._assert_same_generation(*outs)

    def test_beam_search_generate_with_and_without_cache(self):
        for model, input_ids in self._generative_models():
            kwargs = dict(do_sample=False, num_beams=3, num_return_sequences=2, output_scores=True)
            cached = self._generate(model, input_ids, use_cache=True, **kwargs)
            uncached = self._generate(model, input_ids, use_cache=False, **kwargs)
            self.assertEqual(cached.sequences.shape[0], 2 * input_ids.shape[0])
            self.assertTrue(torch.equal(cached.sequences, uncached.sequences))
            torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, **TOL)
            # beams reorder the cache (reorder_cache): the best beam's score is the log-probability of its tokens
            # under a plain forward pass, divided by the number of new tokens (generate's length_penalty of 1)
            with torch.no_grad():
                logits = model(cached.sequences).logits.float()
            prompt = input_ids.shape[1]
            steps = torch.log_softmax(logits[:, prompt - 1 : -1], dim=-1)
            chosen = steps.gather(-1, cached.sequences[:, prompt:, None]).squeeze(-1).sum(-1)
            torch.testing.assert_close(cached.sequences_scores, chosen / NEW_TOKENS, **TOL)

    def test_left_padding_with_position_ids_equals_rows_alone(self):
        for model, input_ids in self._generative_models():
            pad = model.config.pad_token_id
            padded = input_ids.clone()
            padded[0, :2] = pad  # row 0 keeps its last T - 2 tokens, left-padded
            mask = torch.ones_like(padded)
            mask[0, :2] = 0
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # positions counting real tokens, as generate makes
            out = self._generate(model, padded, attention_mask=mask, position_ids=position_ids, do_sample=False)
            for row in range(padded.shape[0]):
                alone = self._generate(model, padded[row : row + 1, mask[row].bool()], do_sample=False)
                self.assertTrue(torch.equal(out.sequences[row, -NEW_TOKENS:], alone.sequences[0, -NEW_TOKENS:]))
                for a, b in zip(out.logits, alone.logits):
                    torch.testing.assert_close(a[row : row + 1], b, **TOL)

    def test_generate_continues_from_a_returned_cache(self):
        for model, input_ids in self._generative_models():
            once = self._generate(model, input_ids, do_sample=False, max_new_tokens=2 * NEW_TOKENS,
                                  min_new_tokens=2 * NEW_TOKENS)
            first = self._generate(model, input_ids, do_sample=False)
            cache = getattr(first, CACHE_FIELD)  # `cache` from transformers 5.24 on, `past_key_values` before
            self.assertIsNotNone(cache)
            # An explicit mask: a generated token equal to pad_token_id would otherwise read as right-padding.
            mask = torch.ones_like(first.sequences)
            second = self._generate(model, first.sequences, attention_mask=mask, do_sample=False,
                                    **{CACHE_FIELD: cache})
            self.assertTrue(torch.equal(second.sequences, once.sequences))
            for a, b in zip(first.logits + second.logits, once.logits):
                torch.testing.assert_close(a, b, **TOL)

    def test_generate_from_inputs_embeds(self):
        for model, input_ids in self._generative_models():
            embeds = model.get_input_embeddings()(input_ids).detach()
            from_ids = self._generate(model, input_ids, do_sample=False)
            from_embeds = self._generate(model, None, inputs_embeds=embeds, do_sample=False)
            # decoder-only generate returns only the new tokens when it starts from embeddings
            self.assertTrue(torch.equal(from_embeds.sequences, from_ids.sequences[:, input_ids.shape[1] :]))
            for a, b in zip(from_embeds.logits, from_ids.logits):
                torch.testing.assert_close(a, b, **TOL)

    def test_logits_to_keep(self):
        for model, input_ids in self._generative_models():
            with torch.no_grad():
                full = model(input_ids).logits
                for keep in (1, 3):
                    torch.testing.assert_close(model(input_ids, logits_to_keep=keep).logits, full[:, -keep:], **TOL)
                indices = torch.tensor([0, 2])
                torch.testing.assert_close(model(input_ids, logits_to_keep=indices).logits, full[:, indices], **TOL)
                torch.testing.assert_close(model(input_ids, logits_to_keep=0).logits, full, rtol=0, atol=0)
