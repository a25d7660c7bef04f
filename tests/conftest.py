import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same global RNG state, so failures reproduce."""
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped (with the reason) where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
