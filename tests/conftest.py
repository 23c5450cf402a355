import os
import warnings

import torch

if not torch.cuda.is_available():
    # No GPU: Triton kernels (ours, and fla's in kernels/test_backend_parity.py) run on CPU in Triton's interpreter.
    # Triton reads the setting when it is first imported, which transformers does through torch._dynamo: so before
    # anything else is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from families import FAMILIES  # noqa: E402

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")


@pytest.fixture(params=sorted(FAMILIES), ids=str)
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _keep_thread_count():
    """Restore torch's intra-op thread count after each test: code under test may set it (the benchmark runner does),
    and results compared bit for bit with another process (remote code) need the same count there and here."""
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
