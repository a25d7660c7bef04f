"""Tiny datasets written in torchvision's on-disk formats, whose samples encode their own index in their colour, so
that the stream order can be read back through the real loaders; shared by the data tests."""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from loko_lightning.data import StreamDataModule
from loko_lightning.models import TimmClassifier

N_TRAIN, N_TEST = 20, 8  # CIFAR folders: 5 training batches of 4 images, one test batch
TEST_ID0 = 30  # test images encode ids 30..37 (training ids are 0..19)
RESNET18_MEAN, RESNET18_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
RESNET18 = TimmClassifier("resnet18", pretrained=False).preprocessing()  # what a resnet18 network needs


def colour(i: int) -> tuple[int, int, int]:
    """Sample i is one uniform colour that encodes i, so the stream order can be read back from the images."""
    return 10 + 5 * i, 200 - 3 * i, (37 * i) % 256


def decode(image: torch.Tensor, mean=RESNET18_MEAN, std=RESNET18_STD) -> int:
    red = image[..., 0, :, :].mean() * std[0] + mean[0]
    return round((float(red) * 255 - 10) / 5)


def cifar_rows(indices) -> np.ndarray:
    rows = np.empty((len(indices), 3, 32, 32), np.uint8)
    for row, i in enumerate(indices):
        rows[row] = np.asarray(colour(i), np.uint8)[:, None, None]
    return rows.reshape(len(indices), 3072)


def write_cifar(root: Path, kind: str = "cifar10", n_train: int = N_TRAIN, label_offset: int = 0) -> Path:
    """CIFAR-10/100 pickles (str keys, as OFFLINE.md describes); torchvision's loader needs its MD5 check patched."""

    def dump(path: Path, obj: dict) -> None:
        path.write_bytes(pickle.dumps(obj))

    if kind == "cifar10":
        folder, label_key = root / "cifar-10-batches-py", "labels"
        folder.mkdir(parents=True)
        dump(folder / "batches.meta", {"label_names": [f"class{c}" for c in range(10)]})
        per_batch = n_train // 5
        for b in range(5):
            ids = range(b * per_batch, (b + 1) * per_batch)
            dump(
                folder / f"data_batch_{b + 1}",
                {"data": cifar_rows(ids), label_key: [i % 10 + label_offset for i in ids]},
            )
        dump(
            folder / "test_batch",
            {"data": cifar_rows(range(TEST_ID0, TEST_ID0 + N_TEST)), label_key: [i % 10 for i in range(N_TEST)]},
        )
    else:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        dump(folder / "meta", {"fine_label_names": [f"fine{c}" for c in range(100)], "coarse_label_names": ["c"]})
        ids = range(n_train)
        labels = [(7 * i) % 100 for i in ids]
        dump(folder / "train", {"data": cifar_rows(ids), "fine_labels": labels, "coarse_labels": [0] * n_train})
        ids = range(TEST_ID0, TEST_ID0 + N_TEST)
        dump(folder / "test", {"data": cifar_rows(ids), "fine_labels": list(range(N_TEST)), "coarse_labels": [0] * 8})
    return folder


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray, compress: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    image_bytes = struct.pack(">IIII", 0x0803, *images.shape) + images.astype(np.uint8).tobytes()
    label_bytes = struct.pack(">II", 0x0801, len(labels)) + labels.astype(np.uint8).tobytes()
    for name, payload in ((f"{prefix}-images-idx3-ubyte", image_bytes), (f"{prefix}-labels-idx1-ubyte", label_bytes)):
        if compress:
            (folder / f"{name}.gz").write_bytes(gzip.compress(payload))
        else:
            (folder / name).write_bytes(payload)


def write_mnist(root: Path) -> None:
    rng = np.random.default_rng(0)
    raw = root / "MNIST" / "raw"
    write_idx(raw, "train", rng.integers(0, 256, (12, 28, 28)), np.arange(12) % 10)
    write_idx(raw, "t10k", rng.integers(0, 256, (5, 28, 28)), np.arange(5))


def write_imagefolder(folder: Path, per_class: int, classes=("cat", "dog", "eel")) -> None:
    for c, name in enumerate(classes):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (12, 10), colour(10 * c + i)).save(folder / name / f"{i}.png")


def make(source, **kwargs) -> StreamDataModule:
    """A prepared and set-up DataModule over ``source`` (resnet18 preprocessing unless told otherwise)."""
    kwargs.setdefault("preprocessing", RESNET18)
    dm = StreamDataModule(source, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def stream_ids(dm: StreamDataModule) -> list[int]:
    return [decode(batch["inputs"][0]) for batch in dm.train_dataloader()]
