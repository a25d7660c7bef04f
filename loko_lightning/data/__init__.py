"""Batch-size-1 streaming data for online fine-tuning, resumable mid-stream from a Lightning checkpoint.

The training split is read once, one sample per step, in a seeded permutation (the *stream*). Sample ``k`` of the
stream is a deterministic function of ``(seed, k)``, including the optional out-of-distribution (OOD) samples of
the paper's robustness experiment, so a run resumed with ``ckpt_path`` continues at the next unseen sample, neither
skipping nor repeating one.

- :mod:`~loko_lightning.data.sources`: dataset name -> :class:`Source` (loading, on-disk location, missing-data hint),
  one module per family of sources, image and text, in memory or streamed; :mod:`~loko_lightning.data.registry`
  names them.
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
from loko_lightning.data.registry import SOURCES, get_source, register_source
from loko_lightning.data.sources.base import (
    HOLDOUT_FRACTION,
    HOLDOUT_SEED,
    DataNotFoundError,
    OpenedSource,
    Source,
    Split,
    Splits,
    StreamSettings,
)
from loko_lightning.data.sources.glue import GLUE_TASKS, GlueSource
from loko_lightning.data.sources.rotten_tomatoes import RottenTomatoesSource
from loko_lightning.data.sources.text_source import TextDataset
from loko_lightning.data.sources.textfile import TextFileSource
from loko_lightning.data.sources.torchvision_datasets import FASHION_MNIST_DEBIAN_DIR
from loko_lightning.data.stream import HeldOutDataset, StreamCursor, StreamDataLoader, StreamDataset
from loko_lightning.data.transforms import ImageTransform, TextTransform, build_transform

DATASETS = tuple(SOURCES)  # the built-in dataset names, image and text

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DEBIAN_DIR",
    "GLUE_TASKS",
    "GlueSource",
    "HOLDOUT_FRACTION",
    "HOLDOUT_SEED",
    "SOURCES",
    "DataNotFoundError",
    "HeldOutDataset",
    "ImageTransform",
    "OpenedSource",
    "PeriodicPerturbation",
    "Perturbation",
    "RotationJitter",
    "RottenTomatoesSource",
    "Source",
    "Split",
    "Splits",
    "StreamCursor",
    "StreamDataLoader",
    "StreamDataModule",
    "StreamDataset",
    "StreamSettings",
    "TextDataset",
    "TextFileSource",
    "TextTransform",
    "build_transform",
    "get_source",
    "ood_params",
    "register_source",
]
