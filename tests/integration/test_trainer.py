"""transformers' Trainer: gradient accumulation with `num_items_in_batch`, activation checkpointing, loss falls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments
from versions import CHECKPOINTING_ARGUMENT, is_activation_checkpointing

# Label counts per row: any split of these 4 rows into two micro-batches of 2 gives different token counts, so a
# per-micro-batch mean (the gradient-accumulation bug) would not match the full-batch gradient.
LABELLED = (11, 3, 7, 1)
LENGTH = 12


# Tiny tensors: intra-op threads only wait for each other on a shared 2-core machine (about 10x slower).
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family):
    torch.manual_seed(0)
    return family.lm_class(family.config_class(**family.tiny))


def _rows(family, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, family.tiny["vocab_size"], (len(LABELLED), LENGTH), generator=generator)
    labels = ids.clone()
    for row, count in enumerate(LABELLED):
        labels[row, : LENGTH - count] = -100  # `count` labelled positions (the first is never predicted)
    return ids, labels


def _args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    **{CHECKPOINTING_ARGUMENT: True}, use_cpu=True, report_to="none", save_strategy="no",
                    logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                    lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0)
    settings.update(overrides)
    return TrainingArguments(**settings)


def _dataset(ids, labels):
    return [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]


def test_loss_divides_by_num_items_in_batch(family):
    model = _model(family)
    ids, labels = _rows(family)
    out = model(ids, labels=labels)
    shifted = labels[:, 1:]
    token_losses = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(),
                                   shifted.reshape(-1), ignore_index=-100, reduction="none")
    total = token_losses.sum()
    torch.testing.assert_close(out.loss, total / (shifted != -100).sum())  # mean over labelled tokens
    for n in (5, torch.tensor(37)):  # Trainer passes a tensor: the count over all micro-batches (and ranks)
        loss = model(ids, labels=labels, num_items_in_batch=n).loss
        torch.testing.assert_close(loss, total / n)


def test_trainer_gradient_accumulation_equals_the_full_batch_step(family, tmp_path):
    """One optimizer step over 2 micro-batches x 2 rows (with activation checkpointing) moves every parameter
    exactly as one SGD step on the mean loss over all labelled tokens of the 4 rows."""
    model = _model(family)
    ids, labels = _rows(family)
    reference = _model(family)
    reference.train()
    reference(ids, labels=labels).loss.backward()
    lr = 0.5
    expected = {n: (p - lr * p.grad).detach() for n, p in reference.named_parameters() if p.grad is not None}

    calls = []
    model.model.layers[0].attn.register_forward_hook(lambda *_: calls.append(1))
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=1, optim="sgd", learning_rate=lr,
                                              max_grad_norm=0.0), train_dataset=_dataset(ids, labels))
    assert trainer.model_accepts_loss_kwargs  # forward takes **kwargs: Trainer passes num_items_in_batch
    trainer.train()
    assert is_activation_checkpointing(model)
    assert len(calls) == 4  # 2 micro-batches, each block recomputed in the backward pass
    for name, param in model.named_parameters():
        if name in expected:
            torch.testing.assert_close(param.detach(), expected[name], atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.filterwarnings("ignore:.*use_cache.*")
def test_trainer_memorises_a_batch(family, tmp_path):
    model = _model(family)
    ids, _ = _rows(family, seed=1)
    dataset = _dataset(ids, ids.clone())
    with torch.no_grad():
        before = model(ids, labels=ids).loss.item()
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=12, learning_rate=2e-2), train_dataset=dataset)
    result = trainer.train()
    model.eval()
    with torch.no_grad():
        after = model(ids, labels=ids).loss.item()
    assert result.global_step == 12
    assert after < 0.5 * before, (before, after)
