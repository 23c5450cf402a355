from .fox import SelectiveRopeFoXConfig
from .gated_deltanet import SelectiveRopeGatedDeltaNetConfig
from .gla import SelectiveRopeGLAConfig
from .position_embedding import SelectiveRopeConfigBase

__all__ = [
    "SelectiveRopeConfigBase",
    "SelectiveRopeFoXConfig",
    "SelectiveRopeGLAConfig",
    "SelectiveRopeGatedDeltaNetConfig",
]
