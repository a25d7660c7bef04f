"""The registry from dataset name to a :class:`~loko_lightning.data.sources.base.Source`.

The built-in families (:mod:`loko_lightning.data.sources`) are registered here; ``hf:<path>`` names a Hugging Face
dataset read in streaming mode, made on demand rather than registered. Adding a dataset is one
:func:`register_source` call.
"""

from __future__ import annotations

from torchvision import datasets

from loko_lightning.data.sources.base import Source
from loko_lightning.data.sources.bbc_news import BBCNewsSource
from loko_lightning.data.sources.glue import GLUE_TASKS, GlueSource
from loko_lightning.data.sources.glyphs import GlyphSource
from loko_lightning.data.sources.hf_stream import HF_PREFIX, HFStreamSource
from loko_lightning.data.sources.imagefolder import ImageFolderSource
from loko_lightning.data.sources.mnist5k import MNIST5kSource
from loko_lightning.data.sources.rotten_tomatoes import RottenTomatoesSource
from loko_lightning.data.sources.textfile import TextFileSource
from loko_lightning.data.sources.torchvision_datasets import FashionMNISTSource, TorchvisionSource
from loko_lightning.errors import ConfigError

SOURCES: dict[str, Source] = {}


def register_source(source: Source) -> Source:
    """Make ``source`` available by its name to :class:`~loko_lightning.data.StreamDataModule`.

    Args:
        source: the source; one with the same name is replaced.

    Returns:
        The source.
    """
    SOURCES[source.name] = source
    return source


def get_source(name: str) -> Source:
    """The registered source called ``name``, or for ``hf:<path>`` a Hugging Face dataset read in streaming mode.

    ``hf:`` sources (:class:`~loko_lightning.data.sources.hf_stream.HFStreamSource`) are made on demand, not
    registered.

    Raises:
        ConfigError: no source has that name (``field="dataset"``).
    """
    if name.startswith(HF_PREFIX):
        return HFStreamSource(name[len(HF_PREFIX) :])
    if name not in SOURCES:
        known = ", ".join(SOURCES)
        raise ConfigError(
            f"dataset={name!r} is not a known dataset; choose one of {known}, or hf:<name> for a Hugging Face "
            "dataset read in streaming mode.",
            field="dataset",
        )
    return SOURCES[name]


register_source(TorchvisionSource("cifar10", datasets.CIFAR10, 10, datasets.CIFAR10.base_folder))
register_source(TorchvisionSource("cifar100", datasets.CIFAR100, 100, datasets.CIFAR100.base_folder))
register_source(TorchvisionSource("mnist", datasets.MNIST, 10, "MNIST/raw"))
register_source(FashionMNISTSource())
register_source(MNIST5kSource())
register_source(GlyphSource())
register_source(ImageFolderSource())
register_source(TextFileSource())
for _task in GLUE_TASKS:
    register_source(GlueSource(_task))
register_source(RottenTomatoesSource())
register_source(BBCNewsSource())
