from .base import SelectiveRopeDecoderBlock, SelectiveRopeForCausalLMBase, SelectiveRopeModelBase
from .cache import SelectiveRopeCache, SelectiveRopeCacheLayer
from .gla import GatedLinearAttention, SelectiveRopeGLAForCausalLM, SelectiveRopeGLAModel
from .rotary import SelectiveRotaryEmbedding, rotary_temperature

__all__ = [
    "GatedLinearAttention",
    "SelectiveRopeCache",
    "SelectiveRopeCacheLayer",
    "SelectiveRopeDecoderBlock",
    "SelectiveRopeForCausalLMBase",
    "SelectiveRopeGLAForCausalLM",
    "SelectiveRopeGLAModel",
    "SelectiveRopeModelBase",
    "SelectiveRotaryEmbedding",
    "rotary_temperature",
]
