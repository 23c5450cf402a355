"""PEFT LoRA without naming target_modules (defaults registered by `import selective_rope`, see selective_rope/lora.py):
train, save and reload the adapter, merge back into our class."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import AutoModelForCausalLM
from versions import CHECKPOINTING_ARGUMENT

from selective_rope.lora import LORA_TARGET_MODULES

from families import FAMILIES

# PEFT itself calls transformers' deprecated `is_gradient_checkpointing`.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    # Tiny tensors: intra-op threads only wait for each other on a shared 2-core machine (about 10x slower).
    pytest.mark.usefixtures("one_thread"),
]

# Mixer projections each family builds in its tiny config (tests/families.py), plus the SwiGLU MLP.
EXPECTED_TARGETS = {
    "gla": {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"},
    "gated_deltanet": {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"},
    "fox": {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"},  # tiny FoX has use_output_gate
    # Both layer kinds: every projection (the attention's output gate is inside q_proj), and the shared expert's MLP.
    "hybrid": {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "a_proj", "b_proj"},
}
MLP = {"gate_proj", "up_proj", "down_proj"}
# Never adapted by default: the Selective RoPE module and the per-head decay / forget / shift gates (except in the
# hybrid, whose default is every projection of both layer kinds); the hybrid's routers and stacked experts are not
# Linear modules.
NOT_ADAPTED = ("rotary", "gk_proj", "a_proj", "b_proj", "f_proj", "k_shift_proj", "v_shift_proj", "embeddings",
               "lm_head")
HYBRID_ADAPTED = ("a_proj", "b_proj")


def not_adapted(model_type: str) -> tuple[str, ...]:
    skip = HYBRID_ADAPTED if model_type == "selective_rope_hybrid" else ()
    return (*(part for part in NOT_ADAPTED if part not in skip), "gate", "experts")




def _model(family):
    torch.manual_seed(0)
    return family.lm_class(family.config_class(**family.tiny))


def _batch(family, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, family.tiny["vocab_size"], (2, 12), generator=generator)


def _train(model, ids, steps=6, lr=2e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def test_defaults_are_registered_for_every_model_type():
    for model_type, targets in LORA_TARGET_MODULES.items():
        assert TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type] == targets
        assert not any("rotary" in t or t in not_adapted(model_type) for t in targets)


def test_lora_without_target_modules_trains_saves_reloads_and_merges(family, tmp_path):
    model = _model(family)
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8))  # no target_modules

    adapted = {name.rsplit(".", 1)[0] for name, _ in peft_model.named_parameters() if ".lora_A." in name}
    suffixes = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name in adapted}
    assert suffixes == EXPECTED_TARGETS[family.name] | MLP
    assert not any(part in name.split(".") for name in adapted for part in not_adapted(family.config_class.model_type))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)

    ids = _batch(family)
    frozen_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    losses = _train(peft_model, ids)
    assert losses[-1] < losses[0] - 0.1, losses
    for name, param in peft_model.named_parameters():
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), f"frozen parameter {name} changed"
    assert any(not torch.equal(p, lora_before[n]) for n, p in peft_model.named_parameters() if n in lora_before)

    with torch.no_grad():
        adapted_logits = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    saved_targets = set(reloaded.peft_config["default"].target_modules)
    assert saved_targets == set(LORA_TARGET_MODULES[family.config_class.model_type])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted_logits, atol=0, rtol=0)

    merged = reloaded.merge_and_unload()
    assert type(merged) is family.lm_class
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-5, rtol=1e-5)

    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(again) is family.lm_class
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, merged_logits)


@pytest.mark.parametrize("family_name", ["fox"])
def test_modules_to_save_rotary_trains_the_phases(family_name, tmp_path):
    """The documented recipe for learning Selective RoPE's phases under LoRA: train `rotary` in full."""
    from families import FAMILIES

    family = FAMILIES[family_name]
    model = _model(family)
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, modules_to_save=["rotary"]))
    rotary = {n: p.detach().clone() for n, p in peft_model.named_parameters() if ".rotary." in n and p.requires_grad}
    temperatures = {n: t.clone() for n, t in peft_model.state_dict().items() if n.endswith(".temperature")}
    assert any(".phase_proj." in n for n in rotary)
    ids = _batch(family)
    losses = _train(peft_model, ids)
    assert losses[-1] < losses[0]
    changed = [n for n, p in peft_model.named_parameters() if n in rotary and not torch.equal(p, rotary[n])]
    assert any(".phase_proj." in n for n in changed)
    # PEFT turns on the gradient of every parameter of the trained copy; a fixed temperature (the default) is a
    # buffer and stays as it was.
    assert not family.tiny.get("temperature_trainable", False)
    assert any("modules_to_save" in n for n in temperatures)
    assert not any(n.endswith(".temperature") for n, _ in peft_model.named_parameters())
    for name, tensor in peft_model.state_dict().items():
        if name in temperatures:
            assert torch.equal(tensor, temperatures[name]), name
    for name, param in peft_model.named_parameters():
        if ".rotary." in name and "modules_to_save" in name:
            assert param.dtype == torch.float32

    with torch.no_grad():
        adapted_logits = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted_logits, atol=0, rtol=0)
        merged = reloaded.merge_and_unload()
        assert type(merged) is family.lm_class
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted_logits, atol=1e-5, rtol=1e-5)


def test_trainer_with_lora_and_activation_checkpointing(tmp_path):
    """The usual fine-tuning recipe: Trainer + LoRA defaults + gradient accumulation + activation checkpointing.
    Every adapter (inside the checkpointed blocks too) must learn."""
    from transformers import Trainer, TrainingArguments

    from families import FAMILIES

    family = FAMILIES["gated_deltanet"]
    peft_model = get_peft_model(_model(family), LoraConfig(r=4, lora_alpha=8))
    ids = torch.cat([_batch(family, seed) for seed in range(2)])
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        loss_before = peft_model(input_ids=ids, labels=ids).loss.item()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             **{CHECKPOINTING_ARGUMENT: True}, max_steps=8, learning_rate=2e-2, use_cpu=True,
                             report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True)
    Trainer(model=peft_model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in ids]).train()
    peft_model.eval()
    with torch.no_grad():
        loss_after = peft_model(input_ids=ids, labels=ids).loss.item()
    assert loss_after < loss_before - 0.1, (loss_before, loss_after)
    unchanged = [n for n, p in peft_model.named_parameters() if n in before and torch.equal(p, before[n])]
    assert not unchanged, f"adapters that did not learn: {unchanged[:4]}"


def test_the_documented_lora_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/training.md's LoRA block, executed as it stands: the adapter is a causal-LM one, so AutoPeftModelForCausalLM
    reloads it onto the recorded base model, and merging gives our class back (equal to the base: nothing trained)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "AutoPeftModelForCausalLM" in b]
    assert len(blocks) == 1
    family = FAMILIES["gla"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # AutoPeftModel would also look for "adapter" on the Hub
    _model(family).save_pretrained("my-model")
    namespace: dict = {}
    exec(blocks[0], namespace)
    assert PeftConfig.from_pretrained("adapter").task_type == "CAUSAL_LM"
    assert type(namespace["merged"]) is family.lm_class
    ids = _batch(family)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained("my-model")
        torch.testing.assert_close(namespace["merged"](ids).logits, base(ids).logits)
