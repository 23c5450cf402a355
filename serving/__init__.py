"""Serving GLA, Gated DeltaNet and FoX with vLLM (``pip install "selective-rope[vllm]"``; design: docs/serving.md).

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point (pyproject.toml) in every process it
starts, before it reads a model's config: it registers our configs with transformers' ``AutoConfig`` (importing
``selective_rope`` does) and our causal-LM architectures, the names our saved ``config.json`` carries, with vLLM's
``ModelRegistry``. ``LLM(model=dir)`` and ``vllm serve dir`` then load a saved model without ``trust_remote_code``.

Nothing else in the package imports this sub-package, and it imports vLLM only inside :func:`register` and
:mod:`.models`: the core package keeps no vLLM dependency.
"""

from __future__ import annotations

# The families served: the hybrid family (Qwen3.5 / Qwen3-Next layouts) is not yet (its layers keep different states
# per layer type), so vLLM refuses its architecture as one it does not support.
SERVED_MODEL_TYPES = ("selective_rope_gla", "selective_rope_gated_deltanet", "selective_rope_fox")
# Families with attention (paged keys and values) besides their running states: vLLM "hybrid" models. The others are
# state-only. (Each served model checks this against what its mixer keeps: serving/models.py.)
HYBRID_MODEL_TYPES = ("selective_rope_fox",)


def served_families() -> list:
    """The families the plugin registers with vLLM."""
    from selective_rope.families import FAMILIES  # importing the package registered our configs with AutoConfig

    return [family for family in FAMILIES.values() if family.config_class.model_type in SERVED_MODEL_TYPES]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register every family's architecture with vLLM."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    config_hook = _model_config()
    for family in served_families():
        architecture = family.lm_class.__name__  # what save_pretrained writes in config.json's "architectures"
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"{__name__}.models:{architecture}")
        # The engine sizes state blocks only for architectures in this map.
        MODELS_CONFIG_MAP.setdefault(architecture, config_hook)


def _model_config() -> type:
    """vLLM's config hook for models with states (``MambaModelConfig``, which hybrids use too), with prefix caching
    off: a cached prefix would have to restore our states at block boundaries (vLLM's "align" mode, per-state copy
    functions), which the plugin does not provide."""
    from vllm.logger import init_logger
    from vllm.model_executor.models.config import MambaModelConfig

    class SelectiveRopeModelConfig(MambaModelConfig):
        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            if vllm_config.cache_config.enable_prefix_caching:
                init_logger(__name__).info("selective-rope: prefix caching is not supported, turned off")
                vllm_config.cache_config.enable_prefix_caching = False
            super().verify_and_update_config(vllm_config)

    return SelectiveRopeModelConfig
