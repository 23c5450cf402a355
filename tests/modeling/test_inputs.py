"""What the models accept at their entry (issue 19): padding masks, transformers' packing conventions, keyword
arguments, and malformed inputs refused with a one-line ValueError naming the argument."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from selective_rope import SelectiveRopeCache
from selective_rope.modeling import returned_cache

from families import FAMILIES

TOL = dict(atol=1e-4, rtol=1e-4)


def build(family, **overrides):
    config = family.config_class(**{**family.tiny, **overrides})
    model = family.lm_class(config).eval()
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model


def tokens(batch, length, seed=0):
    return torch.randint(3, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


def one_line_error(error, *words):
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


# -- padding masks --------------------------------------------------------------------------------------------------

def test_masks_of_any_binary_dtype_agree_and_additive_masks_are_refused(family):
    model = build(family)
    ids = tokens(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        for same in (mask.bool(), mask.float(), mask.to(torch.bfloat16), mask.int()):
            torch.testing.assert_close(model(ids, attention_mask=same).logits, expected, rtol=0, atol=0)
    additive = torch.zeros(2, 6).masked_fill(mask == 0, float("-inf"))  # 0 keep, -inf pad: would read inverted
    with pytest.raises(ValueError, match="additive mask") as error:
        model(ids, attention_mask=additive)
    one_line_error(error, "attention_mask", "-inf")
    with pytest.raises(ValueError, match="zeros only"):  # an additive mask that keeps everything
        model(ids, attention_mask=torch.zeros(2, 6))
    for value in (0.5, 2, -1):  # not 0 or 1: refused, not rounded
        with pytest.raises(ValueError, match=f"got the value {value!r}"):
            model(ids, attention_mask=mask * value)


def test_mask_lengths_t_or_t_past_plus_t(family):
    model = build(family)
    ids = tokens(2, 7)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        with pytest.raises(ValueError, match=r"L = T=5 \(this call's tokens\); got shape \(2, 7\)") as error:
            model(ids[:, :5], attention_mask=mask)  # longer than T, and no cache: nothing to cover
        one_line_error(error, "attention_mask")
        cache = returned_cache(model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True))
        steps = []
        for t in (5, 6):  # generate's convention (the mask so far, T_past + T) and this call's columns only (T)
            so_far = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=copy.deepcopy(cache))
            step = model(ids[:, t:t + 1], attention_mask=mask[:, t:t + 1], past_key_values=cache, use_cache=True)
            torch.testing.assert_close(so_far.logits, step.logits, rtol=0, atol=0)
            steps.append(step.logits)
            cache = returned_cache(step)
        torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], **TOL)
        with pytest.raises(ValueError, match=r"T=1 \(this call's tokens\) or T_past \+ T = 8") as error:
            model(ids[:, :1], attention_mask=torch.ones(2, 9), past_key_values=cache)
        one_line_error(error, "attention_mask", "(2, 9)")


# -- transformers' packing conventions -------------------------------------------------------------------------------

def collate(lengths, **options):
    features = [{"input_ids": tokens(1, n, seed=i)[0].tolist()} for i, n in enumerate(lengths)]
    return DataCollatorWithFlattening(**options)(features, return_tensors="pt")


@pytest.mark.parametrize("options", [dict(), dict(return_flash_attn_kwargs=True),
                                     dict(return_flash_attn_kwargs=True, return_position_ids=False),
                                     dict(return_seq_idx=True, return_position_ids=False),
                                     dict(return_flash_attn_kwargs=True, return_seq_idx=True)],
                         ids=["position_ids", "flash+positions", "flash_kwargs", "seq_idx", "all"])
def test_data_collator_with_flattening_equals_sequences_alone(family, options):
    """DataCollatorWithFlattening's real output (every convention it offers) gives each sequence exactly its logits
    alone, and the loss of the sequences alone (its labels have -100 at each sequence start)."""
    model = build(family)
    lengths = [5, 1, 9, 3]
    batch = collate(lengths, **options)
    assert batch["input_ids"].shape == (1, sum(lengths))
    with torch.no_grad():
        packed = model(**batch)
        alone = [model(tokens(1, n, seed=i)).logits for i, n in enumerate(lengths)]
    torch.testing.assert_close(packed.logits, torch.cat(alone, 1), **TOL)
    logits = torch.cat(alone, 1)[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"][0, 1:], ignore_index=-100)
    torch.testing.assert_close(packed.loss, expected, **TOL)


def test_packing_markers_must_agree(family):
    model = build(family)
    batch = collate([3, 4], return_flash_attn_kwargs=True)
    with torch.no_grad():
        model(**batch, cu_seqlens=torch.tensor([0, 3, 7]))  # the same offsets: fine
        with pytest.raises(ValueError, match="mark different packed sequences") as error:
            model(**batch, cu_seqlens=torch.tensor([0, 2, 7]))
        one_line_error(error, "cu_seqlens", "[0, 2, 7]")
        with pytest.raises(ValueError, match="cu_seq_lens_q .* and cu_seq_lens_k .* differ"):
            model(batch["input_ids"], cu_seq_lens_q=torch.tensor([0, 3, 7]), cu_seq_lens_k=torch.tensor([0, 7]))
        with pytest.raises(ValueError, match="max_length_q=3 but the longest"):
            model(batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"],
                  max_length_q=3)
        with pytest.raises(ValueError, match=r"position_ids must either mark packed sequences \(a batch of 1"):
            model(tokens(2, 7), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2))
        with pytest.raises(ValueError, match="need a batch of 1"):
            model(tokens(2, 7), cu_seqlens=torch.tensor([0, 3, 7]))
        with pytest.raises(ValueError, match="not both"):
            model(batch["input_ids"], cu_seqlens=torch.tensor([0, 3, 7]),
                  attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]]))
        model(batch["input_ids"], cu_seqlens=torch.tensor([0, 3, 7]), attention_mask=torch.ones(1, 7))  # no padding


def test_packing_markers_must_agree_with_position_ids_that_say_one_sequence(family):
    """``position_ids`` ``arange(T)`` say one sequence; ``cu_seqlens`` (or transformers' markers) saying several
    contradict them, and used to be accepted silently (the packing won). Refused; an agreeing pair still runs."""
    model = build(family)
    ids, one = tokens(1, 7), torch.arange(7)[None]
    with torch.no_grad():
        with pytest.raises(ValueError, match="mark different packed sequences") as error:
            model(ids, cu_seqlens=torch.tensor([0, 3, 7]), position_ids=one)
        one_line_error(error, "cu_seqlens [0, 3, 7] and position_ids (as offsets [0, 7])")
        with pytest.raises(ValueError, match="mark different packed sequences"):
            model(ids, seq_idx=torch.tensor([[0, 0, 0, 1, 1, 1, 1]]), position_ids=one)
        with pytest.raises(ValueError, match="mark different packed sequences"):
            model(ids, cu_seq_lens_q=torch.tensor([0, 3, 7]), cu_seq_lens_k=torch.tensor([0, 3, 7]), position_ids=one)
        torch.testing.assert_close(model(ids, cu_seqlens=torch.tensor([0, 7]), position_ids=one).logits,
                                   model(ids).logits, rtol=0, atol=0)
        packed = model(ids, cu_seqlens=torch.tensor([0, 3, 7]), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
        torch.testing.assert_close(packed.logits, model(ids, cu_seqlens=torch.tensor([0, 3, 7])).logits, rtol=0,
                                   atol=0)


def test_position_ids_that_are_the_implicit_positions_are_accepted(family):
    model = build(family)
    ids = tokens(2, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # transformers' recipe for left padding
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=torch.arange(8)[None]).logits, model(ids).logits,
                                   rtol=0, atol=0)
        expected = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits, expected,
                                   rtol=0, atol=0)
        cache = returned_cache(model(ids[:, :6], attention_mask=mask[:, :6], position_ids=positions[:, :6],
                                     use_cache=True))
        step = model(ids[:, 6:], attention_mask=mask, position_ids=positions[:, 6:], past_key_values=cache)
        torch.testing.assert_close(step.logits, expected[:, 6:], **TOL)
        with pytest.raises(ValueError, match="position_ids must either mark packed sequences") as error:
            model(ids, position_ids=torch.arange(8)[None] + 5)  # shifted positions: not supported
        one_line_error(error, "leave position_ids out")


def test_generate_accepts_position_ids(family):
    model = build(family)
    ids = tokens(2, 5)
    plain = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with_positions = model.generate(ids, position_ids=torch.arange(5).expand(2, 5), max_new_tokens=4,
                                    do_sample=False, pad_token_id=0)
    assert torch.equal(plain, with_positions)


def test_generate_on_right_padding_and_a_row_of_padding_only_continues_each_rows_real_tokens(family):
    """generate builds no position_ids of its own (it would extend them from the last column, which after right
    padding is not the positions forward counts): pads are holes, so each row's new tokens continue its real tokens,
    as the row's tokens followed by its new ones, without padding, give; a row of padding only runs along. (The
    first new token of a right-padded row is read at a pad, as generate reads the last column: transformers warns.)"""
    model = build(family)
    rows = [tokens(1, n, seed=n)[0] for n in (6, 3, 0, 5)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    batch = model.generate(ids, attention_mask=mask, **options)
    steps = torch.stack(batch.logits)  # (new tokens, B, V)
    for i, r in enumerate(rows):
        new = batch.sequences[i, width:]
        with torch.no_grad():
            dense = model(torch.cat([r, new])[None]).logits[0]
        first = 0 if len(r) == width else 1  # the step whose logits come from the row's own tokens
        torch.testing.assert_close(steps[first:, i], dense[len(r) + first - 1:-1], **TOL)
    alone = model.generate(rows[0][None], **options)  # the row without padding: exactly the row alone
    assert torch.equal(batch.sequences[0], alone.sequences[0])


def test_position_ids_the_caller_passes_are_still_checked(family):
    """Only generate's own position_ids are left out: the caller's, to forward or to generate, are checked."""
    model = build(family)
    ids = tokens(2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    shifted = torch.arange(5).expand(2, 5) + 3
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        implicit = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]])  # pads' positions are not read
        torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=implicit).logits, expected,
                                   rtol=0, atol=0)
        for call in (lambda: model(ids, attention_mask=mask, position_ids=shifted),
                     lambda: model.generate(ids, attention_mask=mask, position_ids=shifted, max_new_tokens=2,
                                            do_sample=False, pad_token_id=0)):
            with pytest.raises(ValueError, match="position_ids must either mark packed sequences") as error:
                call()
            one_line_error(error, "leave position_ids out")


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), convention=st.sampled_from(
    ["cu_seqlens", "position_ids", "flash", "seq_idx"]))
def test_every_packing_convention_equals_sequences_alone(gla_model, lengths, convention):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.cat([tokens(1, n, seed=i) for i, n in enumerate(lengths)], 1)
    markers = {
        "cu_seqlens": dict(cu_seqlens=offsets.int()),
        "position_ids": dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None]),
        "flash": dict(cu_seq_lens_q=offsets.int(), cu_seq_lens_k=offsets.int(), max_length_q=max(lengths),
                      max_length_k=max(lengths)),
        "seq_idx": dict(seq_idx=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].int()),
    }[convention]
    with torch.no_grad():
        packed = gla_model(ids, **markers).logits
        alone = torch.cat([gla_model(tokens(1, n, seed=i)).logits for i, n in enumerate(lengths)], 1)
    torch.testing.assert_close(packed, alone, **TOL)


@pytest.fixture(scope="module")
def gla_model():
    torch.manual_seed(0)
    return build(FAMILIES["gla"], num_hidden_layers=1)


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(st.booleans(), min_size=5, max_size=5).filter(any), min_size=1, max_size=3))
def test_padding_anywhere_equals_rows_alone(gla_model, rows):
    mask = torch.tensor(rows)
    ids = tokens(mask.shape[0], 5, seed=1)
    with torch.no_grad():
        padded = gla_model(ids, attention_mask=mask).logits
        for row in range(mask.shape[0]):
            alone = gla_model(ids[row:row + 1, mask[row]]).logits[0]
            torch.testing.assert_close(padded[row, mask[row]], alone, **TOL)


# -- keyword arguments ---------------------------------------------------------------------------------------------

def test_unknown_keyword_arguments_are_refused(family):
    model = build(family)
    ids = tokens(1, 4)
    for misspelt in ("cu_seq_len", "attention_masks", "position_id", "token_type_ids"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{misspelt}'") as error:
            model(ids, **{misspelt: torch.tensor([0, 4])})
        one_line_error(error, f"{family.lm_class.__name__}.forward()")  # the class the user called
        with pytest.raises(TypeError, match=misspelt) as error:
            model.model(ids, **{misspelt: None})
        one_line_error(error, f"{family.model_class.__name__}.forward()")
    # linear attention only (the hybrid's mixers differ by layer: ask its layers, not the class)
    if not any(getattr(block.attn, "has_attention_weights", False) for block in model.model.layers):
        with pytest.raises(ValueError, match="no attention weights") as error:
            model(ids, output_attentions=True)
        one_line_error(error, "output_attentions", family.config_class.model_type)
    with pytest.raises(ValueError, match="causal only"):
        model(ids, is_causal=False)
    with torch.no_grad():  # what transformers' callers pass is accepted
        expected = model(ids, labels=ids).loss
        out = model(ids, labels=ids, num_items_in_batch=torch.tensor(3), output_attentions=False, is_causal=True,
                    cache_position=torch.arange(4), return_dict=True, output_router_logits=None)
    torch.testing.assert_close(out.loss, expected)  # 3 predicted tokens: the same mean
    torch.testing.assert_close(model(ids, labels=ids, num_items_in_batch=torch.tensor(6)).loss, expected / 2)


# -- malformed inputs -------------------------------------------------------------------------------------------------

def test_malformed_inputs_are_refused_naming_the_argument(family):
    model = build(family)
    ids = tokens(1, 6)
    hidden = family.tiny["hidden_size"]
    first = {"layer_types": family.tiny["layer_types"][:1]} if "layer_types" in family.tiny else {}  # (the hybrid)
    one_layer = family.config_class(**{**family.tiny, "num_hidden_layers": 1, **first})
    cases = [
        (dict(input_ids=ids[:, :0]), "input_ids", "at least one token"),
        (dict(input_ids=ids[:0]), "input_ids", "batch of at least 1"),
        (dict(input_ids=ids.float()), "input_ids", "int64 or int32 tensor"),
        (dict(input_ids=ids.to(torch.uint8)), "input_ids", "torch.uint8"),
        (dict(input_ids=ids[0]), "input_ids", "shape (B, T)"),
        (dict(input_ids=ids.tolist()), "input_ids", "got list"),
        (dict(input_ids=ids + 100), "input_ids", "[0, 61)"),
        (dict(inputs_embeds=torch.randn(1, 6, hidden + 1)), "inputs_embeds", f"(B, T, {hidden})"),
        (dict(inputs_embeds=torch.randn(1, 0, hidden)), "inputs_embeds", "at least one token"),
        (dict(input_ids=ids, cu_seqlens=torch.tensor([0.0, 2.5, 6.0])), "cu_seqlens", "integer tensor"),
        (dict(input_ids=ids, cu_seqlens=[0, 2, 6]), "cu_seqlens", "got list"),
        (dict(input_ids=ids, cu_seqlens=torch.tensor([0, 4, 2, 6])), "cu_seqlens", "non-decreasing"),
        (dict(input_ids=ids, cu_seqlens=torch.tensor([0, 5])), "cu_seqlens", "packed length 6"),
        (dict(input_ids=ids, attention_mask=[[1] * 6]), "attention_mask", "got list"),
        (dict(input_ids=ids, attention_mask=torch.ones(1, 1, 6, 6)), "attention_mask", "2-D padding mask"),
        (dict(input_ids=ids, position_ids=torch.arange(6.0)[None]), "position_ids", "integer tensor"),
        (dict(input_ids=ids, seq_idx=torch.tensor([[0, 0, 2, 2, 2, 2]])), "seq_idx", "0, 1, 2"),
        (dict(input_ids=ids, past_key_values=SelectiveRopeCache(one_layer)), "past_key_values", "1 layers"),
    ]
    for kwargs, name, words in cases:
        with pytest.raises(ValueError) as error:
            model(**kwargs)
        one_line_error(error, name, words)
    cache = returned_cache(model(tokens(2, 3), use_cache=True))
    with pytest.raises(ValueError, match="holds 2 sequences but the input has 1"):
        model(ids[:, :1], past_key_values=cache)
    # Another family's cache with the same layer and row counts: its states mean nothing here.
    other = next(f for f in FAMILIES.values() if f.name != family.name)
    other_model = other.lm_class(other.config_class(**{**other.tiny,
                                                       "num_hidden_layers": model.config.num_hidden_layers}))
    foreign = returned_cache(other_model(tokens(1, 3), use_cache=True))
    with pytest.raises(ValueError) as error:
        model(ids, past_key_values=foreign)
    one_line_error(error, "past_key_values", f"a {other.config_class.model_type} model",
                   f"this {model.config.model_type} model")


def test_inputs_embeds_take_the_dtype_input_ids_would_give(family):
    """Floating inputs_embeds are cast to the embedding weight's dtype at the entry (a Linear would refuse them deep
    in a layer); other dtypes are refused naming inputs_embeds."""
    hidden = family.tiny["hidden_size"]
    embeds = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(3))
    for model_dtype, embeds_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float64)):
        model = build(family).to(model_dtype)
        given = embeds.to(embeds_dtype)
        with torch.no_grad():
            expected = model(inputs_embeds=given.to(model_dtype)).logits
            out = model(inputs_embeds=given).logits
        assert out.dtype == expected.dtype == model_dtype
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for wrong in (embeds.long(), embeds.to(torch.complex64), embeds > 0):
        with pytest.raises(ValueError, match="must be a float tensor") as error:
            model(inputs_embeds=wrong)
        one_line_error(error, "inputs_embeds", str(wrong.dtype))


def test_malformed_labels_are_refused_before_the_forward(family, monkeypatch):
    model = build(family)
    ids = tokens(2, 6)
    ids[0, :2] = torch.tensor([3, 60])  # the vocabulary's ends (token ids 3..60 are drawn)
    embeds = model.get_input_embeddings()(ids).detach()
    monkeypatch.setattr(model.model, "forward", lambda *args, **kwargs: pytest.fail("the forward ran"))
    cases = [
        (ids[..., None], "got torch.int64 of shape (2, 6, 1)"),  # a NaN loss before
        (ids.flatten(), "got torch.int64 of shape (12,)"),  # targets shifted across rows before
        (ids[:, :3], "shape (2, 6)"),  # failed in cross_entropy, not naming labels
        (ids.float(), "got torch.float32"),
        (ids.to(torch.int16), "got torch.int16"),
        (ids.tolist(), "got list"),
        (ids.masked_fill(ids == ids[0, 2], 61), "[0, 61) (vocab_size); got values other than -100 in [3, 61]"),
        (ids.masked_fill(ids == ids[0, 2], -1), "got values other than -100 in [-1, 60]"),  # IndexErrors before
        (torch.full_like(ids, -100).index_fill(1, torch.tensor([4]), -7), "in [-7, -7]"),
    ]
    for labels, words in cases:
        for source in (dict(input_ids=ids), dict(inputs_embeds=embeds)):
            with pytest.raises(ValueError) as error:
                model(**source, labels=labels)
            one_line_error(error, "labels", words)


def test_valid_labels_give_the_loss_they_gave_before(family):
    """-100 anywhere is ignored and int32 labels are widened: the loss is exactly transformers' loss of the logits."""
    model = build(family)
    ids = tokens(2, 7)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 5] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
        expected = model.loss_function(logits=out.logits, labels=labels, vocab_size=model.config.vocab_size)
        torch.testing.assert_close(out.loss, expected, rtol=0, atol=0)
        shifted = labels[:, 1:].reshape(-1)
        manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), shifted)
        torch.testing.assert_close(out.loss, manual, **TOL)
        torch.testing.assert_close(model(ids, labels=labels.int()).loss, out.loss, rtol=0, atol=0)
        assert model(ids, labels=torch.full_like(ids, -100)).loss.isnan()  # nothing to predict: transformers' NaN
        # logits_to_keep: all of them (0, or the length) with labels; fewer is refused, naming both
        torch.testing.assert_close(model(ids, labels=labels, logits_to_keep=7).loss, out.loss, rtol=0, atol=0)
        for keep in (1, 6, torch.tensor([0, 2])):
            with pytest.raises(ValueError, match="labels need the logits of every position, but logits_to_keep="):
                model(ids, labels=labels, logits_to_keep=keep)


def test_shift_labels_reach_the_loss(family):
    """Trainer's ``shift_labels`` (context / sequence parallelism): the loss of the given targets, as transformers'
    causal LMs compute it; equal to the labels' loss when they are the labels shifted."""
    model = build(family)
    ids = tokens(2, 7)
    labels = ids.clone()
    labels[0, :2] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()  # as Trainer builds them
    other = tokens(2, 7, seed=5)  # targets unrelated to the labels: only shift_labels can give their loss
    with torch.no_grad():
        out = model(ids, labels=labels)
        torch.testing.assert_close(model(ids, labels=labels, shift_labels=shifted).loss, out.loss, rtol=0, atol=0)
        manual = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), other.reshape(-1))
        torch.testing.assert_close(model(ids, labels=labels, shift_labels=other).loss, manual, **TOL)
        torch.testing.assert_close(model(ids, labels=labels, shift_labels=other, num_items_in_batch=torch.tensor(7))
                                   .loss, manual * 2, **TOL)  # 14 targets counted as 7
    with pytest.raises(ValueError, match="shift_labels are given without labels") as error:
        model(ids, shift_labels=shifted)
    one_line_error(error)
    with pytest.raises(ValueError) as error:
        model(ids, labels=labels, shift_labels=shifted[:, :-1])
    one_line_error(error, "shift_labels must be", "shape (2, 7)")


def test_output_hidden_states_follows_the_config(family, tmp_path):
    """``config.output_hidden_states`` when the argument is None, as in transformers' models (feature extraction with
    ``from_pretrained(path, output_hidden_states=True)``); the argument still wins."""
    model = build(family)
    ids = tokens(2, 5)
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
        model.save_pretrained(tmp_path)
        loaded = family.lm_class.from_pretrained(tmp_path, output_hidden_states=True).eval()
        assert loaded.config.output_hidden_states
        for out in (loaded(ids), loaded.model(ids)):
            assert len(out.hidden_states) == family.tiny["num_hidden_layers"] + 1
            for a, b in zip(out.hidden_states, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert loaded(ids, output_hidden_states=False).hidden_states is None
