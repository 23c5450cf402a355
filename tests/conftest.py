import warnings

import pytest
import torch

from families import FAMILIES

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")


@pytest.fixture(params=sorted(FAMILIES), ids=str)
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
