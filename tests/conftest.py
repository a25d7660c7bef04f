import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same global RNG state, so failures reproduce."""
    torch.manual_seed(0)
    yield
