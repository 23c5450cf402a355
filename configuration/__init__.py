from .gla import SelectiveRopeGLAConfig
from .position_embedding import SelectiveRopeConfigBase

__all__ = ["SelectiveRopeConfigBase", "SelectiveRopeGLAConfig"]
