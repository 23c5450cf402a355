from .fox import SelectiveRopeFoXConfig
from .gated_deltanet import SelectiveRopeGatedDeltaNetConfig
from .gla import SelectiveRopeGLAConfig
from .position_embedding import PRESETS, SelectiveRopeConfigBase

__all__ = [
    "PRESETS",
    "SelectiveRopeConfigBase",
    "SelectiveRopeFoXConfig",
    "SelectiveRopeGLAConfig",
    "SelectiveRopeGatedDeltaNetConfig",
]
