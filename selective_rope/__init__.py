"""selective-rope: Selective RoPE for GLA, Gated DeltaNet, FoX and their hybrid as Hugging Face Transformers models.

Importing the package registers the configs and models of every family (:mod:`selective_rope.families`) with
``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``, and registers PEFT's default LoRA target modules for our
model types (:mod:`selective_rope.lora`). It never imports triton or flash-linear-attention.
"""

from pathlib import Path

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

try:
    from .configuration import (
        SelectiveRopeConfigBase,
        SelectiveRopeFoXConfig,
        SelectiveRopeGatedDeltaNetConfig,
        SelectiveRopeGLAConfig,
        SelectiveRopeHybridConfig,
    )
except ModuleNotFoundError as error:
    # The sub-packages live at the repository root and pip maps them into the package (pyproject's package-dir):
    # a source checkout that is on sys.path but not installed editable (e.g. `python` started in the checkout after
    # `pip install .`) shadows the installed package without them.
    if error.name != f"{__name__}.configuration":
        raise
    raise ModuleNotFoundError(
        f"{__name__} was imported from {Path(__file__).parent}, a source tree that is not installed: its "
        "sub-packages (configuration/, modeling/, ...) sit at the repository root and only an install maps them into "
        "the package. Run `pip install -e .` in the checkout, or start Python outside it to use the installed "
        "package", name=error.name) from None
from .families import FAMILIES
from .lora import register_lora_defaults
from .modeling import (
    SelectiveRopeCache,
    SelectiveRopeFoXForCausalLM,
    SelectiveRopeFoXModel,
    SelectiveRopeGatedDeltaNetForCausalLM,
    SelectiveRopeGatedDeltaNetModel,
    SelectiveRopeGLAForCausalLM,
    SelectiveRopeGLAModel,
    SelectiveRopeHybridForCausalLM,
    SelectiveRopeHybridModel,
    SelectiveRopeStaticCache,
    SelectiveRotaryEmbedding,
)

__version__ = "0.1.0"

for _family in FAMILIES.values():
    AutoConfig.register(_family.model_type, _family.config_class, exist_ok=True)
    AutoModel.register(_family.config_class, _family.model_class, exist_ok=True)
    AutoModelForCausalLM.register(_family.config_class, _family.lm_class, exist_ok=True)
register_lora_defaults()

__all__ = [
    "SelectiveRopeCache",
    "SelectiveRopeStaticCache",
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
    "SelectiveRopeHybridConfig",
    "SelectiveRopeHybridForCausalLM",
    "SelectiveRopeHybridModel",
    "SelectiveRotaryEmbedding",
]
