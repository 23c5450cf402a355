"""The backend names and the Triton-interpreter switch, defined once (the config, the dispatcher and the Triton
kernels read them from here). Imports nothing: it travels with every saved model's remote code."""

import os

#: ``config.backend`` / ``SELECTIVE_ROPE_BACKEND`` values: who runs the kernels (see ``dispatch.resolve_backend``).
BACKENDS = ("auto", "torch", "triton")
#: What ``dispatch.resolve_backend`` returns, once per model call: PyTorch only (the reference); PyTorch with the
#: rotary module compiled, inference and training (``rotary_cpu``, ``rotary_cpu_train``: ``"auto"`` on the CPU); our
#: Triton kernels (and fla's).
RESOLVED = ("torch", "torch+c", "triton")
ENV_VAR = "SELECTIVE_ROPE_BACKEND"


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, read when triton is first
    imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
