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
