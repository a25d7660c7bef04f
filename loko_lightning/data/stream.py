"""The training stream: one sample per step in a seeded order, resumable at any position.

Stream position ``p`` is a deterministic function of the order, the seed and ``p``, perturbed samples included (see
:mod:`loko_lightning.data.perturbations`), so a checkpoint needs to save only the next position
(:class:`StreamCursor`). The stream is modality-neutral: a source gives raw samples, a transform turns them into the
model's ``inputs``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from loko_lightning.data.perturbations import Perturbation
from loko_lightning.errors import ConfigError


class StreamDataset(Dataset):
    """The training stream: index = stream position, one sample (a dict) per position.

    Items are ``{"inputs": transform(raw sample), "label": int64, "position": int64, "ood": bool}``; ``ood`` marks
    a sample inserted by the perturbation. The stream has ``len(order) + perturbation.inserted(len(order))``
    positions.

    Args:
        base: a dataset of ``(raw sample, label)`` pairs.
        order: indices into ``base``: the normal samples in stream order.
        transform: preprocessing of a raw sample into the model's inputs.
        seed: stream seed; with the position it determines each perturbed sample.
        perturbation: inserts perturbed samples (``None``: none).
        drift: relabels each sample from its stream position (:class:`LabelDrift`; ``None``: labels as they are).
    """

    def __init__(
        self,
        base: Dataset,
        order: Sequence[int],
        transform: Callable[[Any], Any],
        seed: int = 0,
        perturbation: Perturbation | None = None,
        drift: LabelDrift | None = None,
    ) -> None:
        self.base = base
        self.order = [int(i) for i in order]
        self.transform = transform
        self.seed = seed
        self.perturbation = perturbation
        self.drift = drift

    def __len__(self) -> int:
        n = len(self.order)
        return n + (self.perturbation.inserted(n) if self.perturbation is not None else 0)

    def locate(self, position: int) -> tuple[int, bool]:
        """Which normal sample a stream position shows, and whether it is a perturbed copy.

        Args:
            position: 0-based stream position.

        Returns:
            ``(k, perturbed)``: the position shows normal sample ``k`` (an index into ``order``).
        """
        if not 0 <= position < len(self):
            raise IndexError(f"stream position {position} out of range [0, {len(self)})")
        if self.perturbation is None:
            return position, False
        return self.perturbation.locate(position)

    def __getitem__(self, position: int) -> dict[str, Any]:
        k, perturbed = self.locate(position)
        sample, label = self.base[self.order[k]]
        if perturbed:
            sample = self.perturbation(sample, position, self.seed)
        if self.drift is not None:
            label = self.drift(int(label), position)
        return {
            "inputs": self.transform(sample),
            "label": torch.tensor(int(label), dtype=torch.int64),
            "position": torch.tensor(position, dtype=torch.int64),
            "ood": torch.tensor(perturbed),
        }


class LabelDrift:
    """A stream whose class-to-label mapping changes every ``every`` positions (a concept drift of known timing).

    Positions ``[0, every)`` show the dataset's own labels; segment ``s = position // every`` (``s >= 1``) shows
    label ``mapping_s[c]`` for class ``c``, where ``mapping_s`` is a permutation of the ``num_classes`` labels drawn
    from ``seed`` and ``s`` alone (a fresh generator per segment), so any position's label is known without
    replaying the stream and a resumed run sees the same labels. A new mapping that happens to equal the previous
    one is drawn again, so every change point changes at least two labels.

    Args:
        every: positions per segment (``>= 1``).
        num_classes: the number of labels permuted.
        seed: the stream seed.
    """

    def __init__(self, every: int, num_classes: int, seed: int) -> None:
        self.every, self.num_classes, self.seed = every, num_classes, seed
        self._mappings: dict[int, list[int]] = {0: list(range(num_classes))}

    def mapping(self, segment: int) -> list[int]:
        """``mapping[c]``: the label class ``c`` has in ``segment``."""
        if segment not in self._mappings:
            previous = self.mapping(segment - 1)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + segment)
            drawn = previous
            while drawn == previous and self.num_classes > 1:
                drawn = torch.randperm(self.num_classes, generator=generator).tolist()
            self._mappings[segment] = drawn
        return self._mappings[segment]

    def __call__(self, label: int, position: int) -> int:
        """The label class ``label`` shows at stream ``position``."""
        return self.mapping(position // self.every)[label]


class HeldOutDataset(Dataset):
    """Held-out samples as ``{"inputs", "label"}`` dicts, for validation and testing.

    Args:
        base: a dataset of ``(raw sample, label)`` pairs.
        indices: which of its items to evaluate on, in order.
        transform: preprocessing of a raw sample into the model's inputs.
    """

    def __init__(self, base: Dataset, indices: Sequence[int], transform: Callable[[Any], Any]) -> None:
        self.base = base
        self.indices = [int(i) for i in indices]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample, label = self.base[self.indices[index]]
        return {"inputs": self.transform(sample), "label": torch.tensor(int(label), dtype=torch.int64)}


class StreamCursor:
    """The stream's identity (dataset, seed, length, OOD and drift periods) and the next position to train on.

    Args:
        dataset: the source's name (:attr:`~loko_lightning.data.Source.name`), e.g. ``"mnist5k"``.
        seed: stream seed.
        length: number of stream positions.
        ood_every: OOD period (``None``: no OOD samples).
        position: next stream position to train on.
        owner: the class whose arguments (``source``, ``seed``, ...) define the stream, named in errors.
        drift_every: drift period (``None``: no drift).
        shuffle_buffer: a streamed source's shuffle buffer, which orders it (``None``: a stream held in memory).

    Attributes:
        steps: the (global) training steps of the current pass up to ``position`` (``None``: not counted, e.g. a
            checkpoint written before they were); they depend on the batch size and the number of processes, the
            position does not, so a run resumed with others goes on at ``position`` and ends its pass after the last
            sample.
    """

    # A differing saved value, and the argument (of the owner) that makes it match again.
    _FIELDS = {
        "dataset": "source",
        "seed": "seed",
        "ood_every": "perturbation",
        "drift_every": "drift_every",
        "length": "max_samples",
        "shuffle_buffer": "source.shuffle_buffer",
    }

    def __init__(
        self,
        dataset: str,
        seed: int,
        length: int,
        ood_every: int | None,
        position: int = 0,
        owner: type | None = None,
        drift_every: int | None = None,
        shuffle_buffer: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.length = length
        self.ood_every = ood_every
        self.drift_every = drift_every
        self.position = position
        self.owner = owner
        self.steps: int | None = None

    def advance_past(self, position: int, steps: int | None = None) -> None:
        """Record that ``position`` has been trained on (the next one is ``position + 1``), in ``steps`` steps."""
        self.position = position + 1
        self.steps = steps

    def state_dict(self) -> dict[str, Any]:
        """The position and the stream identity, for a checkpoint."""
        state = {
            "position": self.position,
            "steps": self.steps,
            "seed": self.seed,
            "length": self.length,
            "dataset": self.dataset,
            "ood_every": self.ood_every,
            "drift_every": self.drift_every,
        }
        if self.shuffle_buffer is not None:  # only a stream read through a shuffle buffer has one
            state["shuffle_buffer"] = self.shuffle_buffer
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position, after checking that the saved stream is this one.

        Args:
            state: a :meth:`state_dict`.

        Raises:
            ConfigError: the checkpoint comes from another stream (dataset, seed, length or OOD period differ);
                ``field`` is the argument to change.
            ValueError: the saved position is outside the stream.
        """
        hints = {
            "dataset": f"resume with the source of {state.get('dataset')!r}",
            "seed": f"resume with seed={state.get('seed')}",
            "length": "resume with the same data, max_samples and perturbation",
            "ood_every": f"resume with a perturbation of every={state.get('ood_every')}",
            "drift_every": f"resume with drift_every={state.get('drift_every')}",
            "shuffle_buffer": f"resume with the source's shuffle_buffer={state.get('shuffle_buffer')}",
        }
        for key, field in self._FIELDS.items():
            saved, ours = state.get(key), getattr(self, key)  # a key the state lacks reads as None
            if saved != ours:
                raise ConfigError(
                    f"the checkpoint's stream has {key}={saved!r} but this run's has {key}={ours!r}; resuming would "
                    f"skip or repeat samples. To fix it: {hints[key]}, or start without ckpt_path.",
                    field=field,
                    owner=self.owner,
                )
        position = int(state["position"])
        if not 0 <= position <= self.length:
            raise ValueError(f"the checkpoint's stream position {position} is outside [0, {self.length}].")
        self.position = position
        self.steps = state.get("steps")


def _identity(sample: Any) -> Any:
    return sample


class IterableStream(IterableDataset):
    """The training stream of a streamed source: position ``p`` is the ``p``-th sample read.

    It yields one rank's batch of each step, collated, in the layout of
    :class:`_StreamBatchSampler` (set by :class:`StreamDataLoader`): the same items, positions and steps as a
    :class:`StreamDataset` over the same samples.

    Args:
        examples: ``examples(start)`` iterates ``(raw sample, label)`` from position ``start`` on.
        length: stream positions (``max_samples``).
        transform: raw sample -> model inputs.
        drift: relabels each sample from its position (``None``: labels as read).
        decode: an encoded sample -> the raw sample (applied to this process's samples only).
    """

    def __init__(
        self,
        examples: Callable[[int], Iterator[tuple[Any, int]]],
        length: int,
        transform: Callable[[Any], Any],
        drift: Callable[[int, int], int] | None = None,
        decode: Callable[[Any], Any] = _identity,
    ) -> None:
        self.examples, self.length, self.transform, self.drift = examples, length, transform, drift
        self.decode = decode
        self.layout: Any = None
        self.collate: Callable = default_collate

    def laid_out(self, layout: Any, collate: Callable | None) -> IterableStream:
        """This stream read in ``layout``'s steps (a ``_StreamBatchSampler``), batches made by ``collate``."""
        out = copy.copy(self)
        out.layout, out.collate = layout, collate or default_collate
        return out

    def __len__(self) -> int:
        """Steps (the layout's, Lightning's batches), or positions before a layout is set."""
        return self.length if self.layout is None else len(self.layout)

    def _item(self, sample: Any, label: int, position: int) -> dict[str, Any]:
        if self.drift is not None:
            label = self.drift(label, position)
        return {
            "inputs": self.transform(self.decode(sample)),
            "label": torch.tensor(label, dtype=torch.int64),
            "position": torch.tensor(position, dtype=torch.int64),
            "ood": torch.tensor(False),
        }

    def __iter__(self) -> Iterator[Any]:
        if self.layout is None:
            raise RuntimeError("an IterableStream is read through StreamDataLoader, which lays out its steps.")
        chunks = iter(self.layout)
        first = next(chunks, None)
        if first is None:
            return
        position = self.layout.pass_start
        rows = self.examples(position)
        for chunk in _chain(first, chunks):
            mine, items = set(chunk), []
            end = self.layout.step_end(chunk[0])  # read the whole step: every process finds an early end at once
            while position < end:
                row = next(rows, None)
                if row is None:
                    raise ConfigError(
                        f"the stream ended after {position} samples, before max_samples={self.length}. To fix it: set "
                        f"max_samples to at most {position} (the run resumes from its last checkpoint with the same "
                        "max_samples only).",
                        field="max_samples",
                    )
                if position in mine:
                    items.append(self._item(row[0], row[1], position))
                position += 1
            yield self.collate(items)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


class _StreamSampler(Sampler[int]):
    """Stream positions ``start, ..., length - 1``, then whole passes.

    Its length is the steps taken before ``start`` in this pass (``steps_before``, by default ``start``: one sample a
    step) plus the rest of the stream, and at least the whole stream.
    """

    def __init__(self, length: int, start: int = 0, steps_before: int | None = None) -> None:
        self.length = length
        self.start = self.pass_start = start
        self.steps_before = self.pass_steps_before = start if steps_before is None else steps_before

    def __len__(self) -> int:
        return max(self.length, self.steps_before + self.length - self.start)

    def steps_through(self, position: int) -> int:
        """The steps of the current pass up to and including the one that trains on ``position``."""
        return self.pass_steps_before + position - self.pass_start + 1

    def __iter__(self) -> Iterator[int]:
        self.pass_start, self.start = self.start, 0  # a later pass (epoch) covers the whole stream
        self.pass_steps_before, self.steps_before = self.steps_before, 0
        yield from range(self.pass_start, self.length)


class _StreamBatchSampler(Sampler[list[int]]):
    """One rank's share of each global step: ``world_size · batch_size`` consecutive positions per step.

    Global step ``s`` of a pass that starts at ``start`` covers positions ``start + s·W·B … start + (s+1)·W·B - 1``
    (``W`` ranks, ``B`` per rank); rank ``r`` takes the ``r``-th chunk of them, so the ranks' batches, concatenated
    in rank order, are the step's positions in stream order. A last step with ``R < W·B`` positions is split as
    evenly as possible (chunks of ``⌈R/W⌉`` or ``⌊R/W⌋``); if ``R < W`` some ranks would have nothing, and those
    last ``R`` positions are not trained on (every rank must take part in every step).

    ``steps_before``: the global steps a resumed pass took before ``start`` (by default ``⌈start / (W·B)⌉``, those of
    this ``W`` and ``B``; another when the run that saved the position had another ``W`` or ``B``).
    """

    def __init__(
        self,
        length: int,
        start: int,
        batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        steps_before: int | None = None,
    ) -> None:
        self.length, self.start = length, start
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.pass_start = start  # where the current pass began (the step layout is counted from there)
        self.steps_before = -(-start // self.per_step) if steps_before is None else steps_before
        self.pass_steps_before = self.steps_before

    @property
    def per_step(self) -> int:
        return self.batch_size * self.world_size

    def _steps(self, count: int) -> int:
        """Global steps for ``count`` positions (a short last step only if every rank gets a sample)."""
        return count // self.per_step + (1 if count % self.per_step >= self.world_size else 0)

    def __len__(self) -> int:
        # Steps already taken before start (counted by Lightning's restored batch counter) plus the remaining ones;
        # at least a whole pass, which later passes (epochs) take.
        return max(self.steps_before + self._steps(self.length - self.start), self._steps(self.length))

    def chunk(self, step: int) -> range:
        """This rank's positions in global step ``step`` of the current pass."""
        lo = self.pass_start + step * self.per_step
        count = min(self.per_step, self.length - lo)
        if count == self.per_step:
            return range(lo + self.rank * self.batch_size, lo + (self.rank + 1) * self.batch_size)
        base, extra = divmod(count, self.world_size)  # the short last step: chunks of base + 1, then base
        first = lo + self.rank * base + min(self.rank, extra)
        return range(first, first + base + (1 if self.rank < extra else 0))

    def step_end(self, position: int) -> int:
        """The first position after the global step that trains on ``position``."""
        step = (position - self.pass_start) // self.per_step
        return min(self.pass_start + (step + 1) * self.per_step, self.length)

    def steps_through(self, position: int) -> int:
        """The global steps of the current pass up to and including the one that trains on ``position``."""
        return self.pass_steps_before + (position - self.pass_start) // self.per_step + 1

    def __iter__(self) -> Iterator[list[int]]:
        self.pass_start, self.start = self.start, 0  # a later pass (epoch) covers the whole stream
        self.pass_steps_before, self.steps_before = self.steps_before, 0
        for step in range(self._steps(self.length - self.pass_start)):
            yield list(self.chunk(step))


class StreamDataLoader(DataLoader):
    """Loader over a :class:`StreamDataset` from stream position ``start`` to the end, one step's batch at a time.

    Over an :class:`IterableStream` (a streamed source) it lays out the same steps,
    which the stream reads in order.

    ``batch_size`` samples per step (1, the default, is the paper's online setting); with ``world_size`` ranks each
    takes a disjoint share of every global step of ``world_size · batch_size`` consecutive positions (see
    :class:`_StreamBatchSampler`), so the ranks' batches in rank order are the stream in order.

    ``len()`` is the steps taken before ``start`` in this pass (``steps_before``, saved with the position: they
    depend on the batch size and the number of ranks of the run that saved it) plus the remaining ones, and at least
    a whole pass, so that Lightning's restored batch counter (which already counts the trained steps) ends a resumed
    epoch after the last sample, whatever batch size and number of ranks either run had. A finished stream
    (``start == len(dataset)``) and every later pass (epoch) start at position 0.

    The loader keeps no state of its own: the position lives in a :class:`StreamCursor` that its owner saves
    (:class:`~loko_lightning.data.StreamDataModule`). :meth:`state_dict` and :meth:`load_state_dict` exist so that
    Lightning sees a loader that resumes mid-epoch and does not warn that it cannot.

    Args:
        dataset: the stream.
        start: first stream position of the first pass.
        num_workers: DataLoader worker processes.
        batch_size: samples per step and rank.
        world_size: number of ranks sharing the stream.
        rank: this rank.
        collate_fn: how samples are batched (text: :meth:`~loko_lightning.data.TextTransform.collate`); default
            torch's.
        steps_before: the steps of this pass already taken before ``start`` (default: those of this batch size and
            number of ranks).
    """

    def __init__(
        self,
        dataset: StreamDataset | IterableStream,
        start: int = 0,
        num_workers: int = 0,
        batch_size: int = 1,
        world_size: int = 1,
        rank: int = 0,
        collate_fn: Callable | None = None,
        steps_before: int | None = None,
    ) -> None:
        if start >= len(dataset):
            start, steps_before = 0, None
        if isinstance(dataset, IterableStream):  # read in order: the stream lays out its own steps
            self.layout = _StreamBatchSampler(len(dataset), start, batch_size, world_size, rank, steps_before)
            super().__init__(dataset.laid_out(self.layout, collate_fn), batch_size=None, num_workers=num_workers)
            return
        if batch_size == 1 and world_size == 1:
            sampler = _StreamSampler(len(dataset), start, steps_before)
            super().__init__(dataset, batch_size=1, sampler=sampler, num_workers=num_workers, collate_fn=collate_fn)
        else:
            batches = _StreamBatchSampler(len(dataset), start, batch_size, world_size, rank, steps_before)
            super().__init__(dataset, batch_sampler=batches, num_workers=num_workers, collate_fn=collate_fn)

    def _layout(self) -> _StreamSampler | _StreamBatchSampler:
        layout = getattr(self, "layout", None)
        if layout is not None:
            return layout
        return self.batch_sampler if isinstance(self.batch_sampler, _StreamBatchSampler) else self.sampler

    def step_end(self, position: int) -> int:
        """The first stream position after the (global) step that trains on ``position``."""
        layout = self._layout()
        return layout.step_end(position) if isinstance(layout, _StreamBatchSampler) else position + 1

    def steps_through(self, position: int) -> int:
        """The (global) steps of the current pass up to and including the one that trains on ``position``."""
        return self._layout().steps_through(position)

    def state_dict(self) -> dict[str, Any]:
        """Empty: the stream position is saved with the cursor, by the loader's owner."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`).

        Args:
            state: ignored.
        """
