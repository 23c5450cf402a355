"""Model cards from the templates in ``model_cards/`` (one per family, named after the ``model_type``).

The template's YAML header carries the static Hub metadata (``library_name``, ``pipeline_tag``, ``tags``); the
per-model metadata (``license``, ``base_model``, ``base_model_relation``) is set through ``huggingface_hub``'s
``ModelCard`` so the header stays valid YAML whatever the values.
"""

from __future__ import annotations

from importlib import resources

from huggingface_hub import ModelCard

# A saved model's flat copy of this module assigns its family's template here, at its end (see remote_code.py): only
# .py files travel with a model.
BUNDLED_TEMPLATES: dict[str, str] | None = None

POSITION_EMBEDDING_FIELDS = (
    "position_embedding", "phase_gate", "phase_gate_type", "phase_gate_rank", "phase_bias", "phase_proj",
    "phase_proj_rank", "phase_conv_type", "phase_conv_size", "phase_conv_activation", "temperature_type",
    "temperature_theta", "temperature_max", "temperature_trainable", "temperature_seed", "partial_rotary_factor",
)


def template_texts() -> dict[str, str]:
    """``{model_type: template text}``."""
    if BUNDLED_TEMPLATES is not None:
        return BUNDLED_TEMPLATES
    folder = resources.files("selective_rope.model_cards")  # wherever the package maps it (pyproject's package-dir)
    return {path.name.removesuffix(".md"): path.read_text() for path in sorted(folder.iterdir(), key=str)
            if path.name.endswith(".md")}


def _settings_table(config) -> str:
    rows = ["| field | value |", "| --- | --- |"]
    for field in POSITION_EMBEDDING_FIELDS:
        rows.append(f"| `{field}` | `{getattr(config, field)!r}` |")
    # A hybrid's layer types may set fields of their own (SelectiveRopeHybridConfig.layer_type_position_embedding).
    for layer_type, fields in sorted((getattr(config, "layer_type_position_embedding", None) or {}).items()):
        rows.extend(f"| `{field}` ({layer_type} layers) | `{value!r}` |" for field, value in sorted(fields.items()))
    return "\n".join(rows)


def _summary(config, num_parameters: int | None) -> str:
    parts = [f"{config.num_hidden_layers} layers", f"hidden size {config.hidden_size}",
             f"vocabulary {config.vocab_size}"]
    if num_parameters is not None:
        parts.insert(0, f"{num_parameters / 1e6:.1f}M parameters")
    return "Architecture: " + ", ".join(parts) + f" (`model_type` `{config.model_type}`)."


def render_model_card(
    config,
    *,
    repo_id: str = "path/to/model",
    model_name: str | None = None,
    license: str | None = None,
    base_model: str | None = None,
    base_model_relation: str | None = None,
    provenance: str | None = None,
    num_parameters: int | None = None,
) -> ModelCard:
    """The model card of a model with ``config``.

    Args:
        repo_id: where the model lives (shown in the loading snippet).
        license: the Hub license identifier. A model made from another one (``base_model``) is under that model's
            license, so it must be named then; otherwise the default is ``apache-2.0``.
        base_model, base_model_relation: Hub metadata for a model made from another one (a Hub repository id). The
            Hub knows the relations ``adapter``, ``merge``, ``quantized`` and ``finetune``; a retrofitted model (same
            weights, new position embedding, meant to be fine-tuned) is a ``finetune``, the default when
            ``base_model`` is set.
        provenance: the "How it was made" section (markdown).
    """
    if license is None:
        if base_model is not None:
            raise ValueError(f"license: a model made from {base_model!r} is under that model's license; name it "
                             "(license='apache-2.0', 'llama3.2', ...)")
        license = "apache-2.0"
    templates = template_texts()
    if config.model_type not in templates:
        raise ValueError(f"no model-card template for model_type {config.model_type!r}; have {sorted(templates)}")
    text = templates[config.model_type].format(
        model_name=model_name or repo_id.rstrip("/").split("/")[-1],
        repo_id=repo_id,
        model_summary=_summary(config, num_parameters),
        position_embedding_table=_settings_table(config),
        provenance=provenance or "Trained or initialised with the `selective-rope` library.",
    )
    card = ModelCard(text)
    card.data.license = license
    if base_model is not None:
        card.data.base_model = base_model
        card.data.base_model_relation = base_model_relation or "finetune"
    return card
