"""Retrofitting Selective RoPE onto existing checkpoints (SPEC §7): ``selective-rope convert`` and its Python API.

- :func:`convert` / :class:`RetrofitOptions` (:mod:`.convert`, :mod:`.retrofit`): the command's engine.
- :mod:`.llama`: transformers Llama / Mistral / Qwen2 / Qwen3 onto SelectiveRopeFoX.
- :mod:`.fla`: flash-linear-attention GLA / Gated DeltaNet / Forgetting Transformer onto our families.
- :mod:`.official`: checkpoints of the paper's own code (GLA / Gated DeltaNet / softmax attention) onto our families.
- :mod:`.output`: where a conversion writes: OUTPUT apart from the source, staging, publishing, stale partials.
"""

from .convert import SUPPORTED_SOURCES, ConversionError, ConversionReport, convert
from .retrofit import RetrofitOptions

__all__ = ["SUPPORTED_SOURCES", "ConversionError", "ConversionReport", "RetrofitOptions", "convert"]
