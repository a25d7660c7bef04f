"""Shared fixtures: a seeded global RNG, CIFAR folders in the real on-disk format, GPU-only tests skipped."""

import os

# No test reaches the Hugging Face hub: without this, a model missing offline fails only after ~30 s of retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from data_files import write_cifar  # noqa: E402


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


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): tiny models gain nothing from more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cifar_ok(monkeypatch):
    """Accept hand-written CIFAR files: torchvision's real loader, without its MD5 check."""
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *args, **kwargs: True)


@pytest.fixture
def cifar10(tmp_path, cifar_ok):
    """A tiny CIFAR-10 folder (``data_files.N_TRAIN`` training images, each encoding its index) under tmp_path."""
    write_cifar(tmp_path)
    return tmp_path
