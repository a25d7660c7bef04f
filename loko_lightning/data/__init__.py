"""Batch-size-1 streaming data for online fine-tuning, resumable mid-stream from a Lightning checkpoint.

The training split is read once, one sample per step, in a seeded permutation (the *stream*). Sample ``k`` of the
stream is a deterministic function of ``(seed, k)``, including the optional out-of-distribution (OOD) samples of
the paper's robustness experiment, so a run resumed with ``ckpt_path`` continues at the next unseen sample, neither
skipping nor repeating one.

- :mod:`~loko_lightning.data.sources`: the source families (:class:`Source`: loading, on-disk location, missing-data
  hint, options), one module per family, image and text, in memory or streamed: :data:`FAMILIES`.
- :mod:`~loko_lightning.data.transforms`: raw sample -> model ``inputs`` (timm image preprocessing, the network's
  tokenizer).
- :mod:`~loko_lightning.data.perturbations`: OOD samples inserted into the stream.
- :mod:`~loko_lightning.data.stream`: the stream datasets (held in memory, or read in order), its cursor and the
  resumable loader.
- :mod:`~loko_lightning.data.datamodule`: :class:`StreamDataModule`, the Lightning DataModule over all of these.

Batches carry ``inputs`` (what the model takes) and ``label``; training batches also ``position`` and ``ood``.
"""

from loko_lightning.data.datamodule import StreamDataModule
from loko_lightning.data.perturbations import PeriodicPerturbation, Perturbation, RotationJitter, ood_params
from loko_lightning.data.sources.base import (
    HOLDOUT_FRACTION,
    HOLDOUT_SEED,
    DataNotFoundError,
    ImageSource,
    OpenedSource,
    Source,
    Split,
    Splits,
    StreamSettings,
)
from loko_lightning.data.sources.bbc_news import BBCNews
from loko_lightning.data.sources.glue import GLUE_TASKS, Glue
from loko_lightning.data.sources.glyphs import Glyphs100
from loko_lightning.data.sources.hf_stream import HFStream
from loko_lightning.data.sources.imagefolder import ImageFolder
from loko_lightning.data.sources.mnist5k import MNIST5k
from loko_lightning.data.sources.rotten_tomatoes import RottenTomatoes
from loko_lightning.data.sources.text_source import TextDataset, TextSource
from loko_lightning.data.sources.textfile import TextFile
from loko_lightning.data.sources.torchvision_datasets import (
    CIFAR10,
    CIFAR100,
    FASHION_MNIST_DEBIAN_DIR,
    MNIST,
    FashionMNIST,
    TorchvisionSource,
)
from loko_lightning.data.sources.wordnet import WordNetNouns
from loko_lightning.data.stream import HeldOutDataset, StreamCursor, StreamDataLoader, StreamDataset
from loko_lightning.data.transforms import ImageTransform, TextTransform, build_transform

#: The built-in source families, image and text (``--data.source`` takes any :class:`Source` subclass).
FAMILIES: tuple[type[Source], ...] = (
    CIFAR10, CIFAR100, MNIST, FashionMNIST, ImageFolder, MNIST5k, Glyphs100, TextFile, Glue, RottenTomatoes, BBCNews,
    WordNetNouns, HFStream,
)  # fmt: skip

__all__ = [
    "BBCNews",
    "CIFAR10",
    "CIFAR100",
    "FAMILIES",
    "FASHION_MNIST_DEBIAN_DIR",
    "GLUE_TASKS",
    "HOLDOUT_FRACTION",
    "HOLDOUT_SEED",
    "MNIST",
    "MNIST5k",
    "DataNotFoundError",
    "FashionMNIST",
    "Glue",
    "Glyphs100",
    "HFStream",
    "HeldOutDataset",
    "ImageFolder",
    "ImageSource",
    "ImageTransform",
    "OpenedSource",
    "PeriodicPerturbation",
    "Perturbation",
    "RotationJitter",
    "RottenTomatoes",
    "Source",
    "Split",
    "Splits",
    "StreamCursor",
    "StreamDataLoader",
    "StreamDataModule",
    "StreamDataset",
    "StreamSettings",
    "TextDataset",
    "TextFile",
    "TextSource",
    "TextTransform",
    "TorchvisionSource",
    "WordNetNouns",
    "build_transform",
    "ood_params",
]
