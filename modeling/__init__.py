from .base import SelectiveRopeDecoderBlock, SelectiveRopeForCausalLMBase, SelectiveRopeModelBase
from .cache import SelectiveRopeCache, SelectiveRopeCacheLayer, SelectiveRopeStaticCache, SelectiveRopeStaticCacheLayer
from .fox import ForgettingAttention, SelectiveRopeFoXForCausalLM, SelectiveRopeFoXModel
from .gated_deltanet import GatedDeltaNet, SelectiveRopeGatedDeltaNetForCausalLM, SelectiveRopeGatedDeltaNetModel
from .gla import GatedLinearAttention, SelectiveRopeGLAForCausalLM, SelectiveRopeGLAModel
from .hybrid import SelectiveRopeHybridForCausalLM, SelectiveRopeHybridModel
from .inputs import CACHE_FIELD, returned_cache
from .rotary import SelectiveRotaryEmbedding, rotary_temperature

__all__ = [
    "CACHE_FIELD",
    "ForgettingAttention",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "SelectiveRopeCache",
    "SelectiveRopeCacheLayer",
    "SelectiveRopeStaticCache",
    "SelectiveRopeStaticCacheLayer",
    "SelectiveRopeDecoderBlock",
    "SelectiveRopeFoXForCausalLM",
    "SelectiveRopeFoXModel",
    "SelectiveRopeForCausalLMBase",
    "SelectiveRopeGLAForCausalLM",
    "SelectiveRopeGLAModel",
    "SelectiveRopeGatedDeltaNetForCausalLM",
    "SelectiveRopeGatedDeltaNetModel",
    "SelectiveRopeHybridForCausalLM",
    "SelectiveRopeHybridModel",
    "SelectiveRopeModelBase",
    "SelectiveRotaryEmbedding",
    "returned_cache",
    "rotary_temperature",
]
