import atexit
import os
import shutil
import signal
import tempfile
import warnings

import torch

if not torch.cuda.is_available():
    # No GPU: Triton kernels (ours, and fla's in kernels/test_backend_parity.py) run on CPU in Triton's interpreter.
    # Triton reads the setting when it is first imported, which transformers does through torch._dynamo: so before
    # anything else is imported.
    os.environ["TRITON_INTERPRET"] = "1"

# The compiled CPU decoding step (kernels/rotary_cpu.py) builds into this session's own cache, not the user's; only
# the directory made here is removed at exit.
_STEP_CACHE = tempfile.mkdtemp(prefix="selective-rope-test-cache-")
os.environ.setdefault("SELECTIVE_ROPE_CACHE", _STEP_CACHE)
atexit.register(shutil.rmtree, _STEP_CACHE, True)

import pytest  # noqa: E402

from selective_rope.kernels import rotary_cpu, rotary_cpu_entry  # noqa: E402

from families import FAMILIES  # noqa: E402

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

# Tests interrupt child processes with SIGINT and expect Python's handling of it. A suite started in the background by
# a non-interactive shell (`pytest &` in a script) inherits SIGINT ignored, and so would every child: they would sleep
# through the signal. A handler here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


if torch.cuda.is_available():
    from autotuning import few_autotuning_candidates  # noqa: E402

    @pytest.fixture(autouse=True, scope="session")
    def _few_autotuning_candidates():
        """On a GPU, fla's kernels time a few configurations, not ~300 (``tests/autotuning.py``)."""
        with few_autotuning_candidates():
            yield


@pytest.fixture(params=sorted(FAMILIES), ids=str)
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _restore_threads():
    """Scripts run in-process (e.g. examples/synthetic/phase_drift.py) set torch's thread count for good; a later
    test comparing bit for bit with a subprocess (which starts with the default count) would then see the CPU
    attention kernels split work differently."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["compiled", "compiled-ctypes", "torch"])
def decode_step(request, monkeypatch):
    """Decode with the compiled CPU step (``kernels/rotary_cpu.py``; skipped without a C compiler), called through
    its CPython entry where it can be built (``rotary_cpu_entry``) or through ctypes only, or with it switched off
    (the torch step)."""
    if request.param != "torch" and rotary_cpu.find_compiler() is None:
        pytest.skip("no C compiler for the compiled CPU decoding step")
    if request.param == "compiled-ctypes":
        monkeypatch.setattr(rotary_cpu_entry, "_entry", False)  # modules planned in the test get no entry
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0" if request.param == "torch" else "1")
    return request.param
