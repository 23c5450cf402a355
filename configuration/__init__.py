from .fox import SelectiveRopeFoXConfig
from .gated_deltanet import SelectiveRopeGatedDeltaNetConfig
from .gla import SelectiveRopeGLAConfig
from .hybrid import SelectiveRopeHybridConfig
from .position_embedding import PRESETS, SelectiveRopeConfigBase

__all__ = [
    "PRESETS",
    "SelectiveRopeConfigBase",
    "SelectiveRopeFoXConfig",
    "SelectiveRopeGLAConfig",
    "SelectiveRopeGatedDeltaNetConfig",
    "SelectiveRopeHybridConfig",
]
