"""selective-rope: Selective RoPE for GLA, Gated DeltaNet and FoX as Hugging Face Transformers models.

Importing the package registers the configs and models with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, and registers PEFT's default LoRA target modules for our model types
(:mod:`selective_rope.lora`). It never imports triton or flash-linear-attention.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import (
    SelectiveRopeConfigBase,
    SelectiveRopeFoXConfig,
    SelectiveRopeGatedDeltaNetConfig,
    SelectiveRopeGLAConfig,
)
from .lora import register_lora_defaults
from .modeling import (
    SelectiveRopeCache,
    SelectiveRopeFoXForCausalLM,
    SelectiveRopeFoXModel,
    SelectiveRopeGatedDeltaNetForCausalLM,
    SelectiveRopeGatedDeltaNetModel,
    SelectiveRopeGLAForCausalLM,
    SelectiveRopeGLAModel,
    SelectiveRotaryEmbedding,
)

__version__ = "0.1.0"

_FAMILIES = [
    (SelectiveRopeGLAConfig, SelectiveRopeGLAModel, SelectiveRopeGLAForCausalLM),
    (SelectiveRopeGatedDeltaNetConfig, SelectiveRopeGatedDeltaNetModel, SelectiveRopeGatedDeltaNetForCausalLM),
    (SelectiveRopeFoXConfig, SelectiveRopeFoXModel, SelectiveRopeFoXForCausalLM),
]
for _config, _model, _lm in _FAMILIES:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)
register_lora_defaults()

__all__ = [
    "SelectiveRopeCache",
    "SelectiveRopeConfigBase",
    "SelectiveRopeFoXConfig",
    "SelectiveRopeFoXForCausalLM",
    "SelectiveRopeFoXModel",
    "SelectiveRopeGLAConfig",
    "SelectiveRopeGLAForCausalLM",
    "SelectiveRopeGLAModel",
    "SelectiveRopeGatedDeltaNetConfig",
    "SelectiveRopeGatedDeltaNetForCausalLM",
    "SelectiveRopeGatedDeltaNetModel",
    "SelectiveRotaryEmbedding",
]
