"""What the installed transformers calls things, for tests that run across the supported versions (pyproject.toml's
floor, 5.10.1, to the newest; scripts/test_minimum_versions.sh). transformers 5.23 renamed gradient checkpointing to
activation checkpointing; the old names remain as deprecated aliases until v6."""

from __future__ import annotations

from transformers import TrainingArguments

_RENAMED = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
CHECKPOINTING_ARGUMENT = "activation_checkpointing" if _RENAMED else "gradient_checkpointing"  # TrainingArguments'


def enable_activation_checkpointing(model) -> None:
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def is_activation_checkpointing(model) -> bool:
    return getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
