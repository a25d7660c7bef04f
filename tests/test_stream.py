"""The training stream: seeded order, OOD samples from a pluggable perturbation, a modality-neutral dataset, and
exact mid-stream resume through a Trainer (the position is saved once, in the train loader's state)."""

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import runs
import torch
from data_files import N_TRAIN, decode, make, stream_ids
from lightning.pytorch.callbacks import ModelCheckpoint

import loko_lightning.data as data_module
from loko_lightning.data import (
    CIFAR10,
    PeriodicPerturbation,
    Perturbation,
    RotationJitter,
    StreamCursor,
    StreamDataModule,
    StreamDataset,
)
from loko_lightning.errors import ConfigError


# ---------------------------------------------------------------- order
def test_stream_is_a_seeded_permutation_and_max_samples_truncates_it(cifar10):
    first = stream_ids(make(CIFAR10(root=str(cifar10), image_size=8), seed=0))
    assert sorted(first) == list(range(N_TRAIN)) and first != list(range(N_TRAIN))
    assert stream_ids(make(CIFAR10(root=str(cifar10), image_size=8), seed=0)) == first
    assert stream_ids(make(CIFAR10(root=str(cifar10), image_size=8), seed=1)) != first
    short = make(CIFAR10(root=str(cifar10), image_size=8), seed=0, max_samples=7)
    assert short.stream_length == 7 and stream_ids(short) == first[:7]
    assert make(CIFAR10(root=str(cifar10), image_size=8), max_samples=10_000).stream_length == N_TRAIN


# ---------------------------------------------------------------- out-of-distribution samples
def test_ood_samples_follow_every_n_normal_samples(cifar10):
    dm = make(CIFAR10(root=str(cifar10), image_size=8), max_samples=10, perturbation=RotationJitter(3))
    batches = list(dm.train_dataloader())
    assert dm.stream_length == len(batches) == 13  # 10 normal + 3 OOD
    assert [i for i, b in enumerate(batches) if b["ood"]] == [3, 7, 11]
    normal = [b for b in batches if not b["ood"]]
    assert [decode(b["inputs"][0]) for b in normal] == stream_ids(
        make(CIFAR10(root=str(cifar10), image_size=8), max_samples=10)
    )
    for p in (3, 7, 11):  # a transformed copy of the previous sample, same label
        assert int(batches[p]["label"]) == int(batches[p - 1]["label"])
        assert not torch.equal(batches[p]["inputs"], batches[p - 1]["inputs"])
    again = list(
        make(
            CIFAR10(root=str(cifar10), image_size=8), max_samples=10, perturbation=RotationJitter(3)
        ).train_dataloader()
    )
    assert all(torch.equal(a["inputs"], b["inputs"]) for a, b in zip(batches, again, strict=True))
    other_seed = make(CIFAR10(root=str(cifar10), image_size=8), max_samples=10, seed=5, perturbation=RotationJitter(3))
    assert data_module.ood_params(0, 3, 30.0, 0.5) != data_module.ood_params(5, 3, 30.0, 0.5)
    assert [int(b["ood"]) for b in other_seed.train_dataloader()] == [int(b["ood"]) for b in batches]


def test_ood_sample_without_rotation_or_jitter_is_an_exact_copy(cifar10):
    dm = make(
        CIFAR10(root=str(cifar10), image_size=8),
        max_samples=4,
        perturbation=RotationJitter(2, rotation=0.0, jitter=0.0),
    )
    batches = list(dm.train_dataloader())
    assert [bool(b["ood"]) for b in batches] == [False, False, True, False, False, True]
    assert torch.equal(batches[2]["inputs"], batches[1]["inputs"])
    assert torch.equal(batches[5]["inputs"], batches[4]["inputs"])


def test_ood_params_are_within_range_and_deterministic():
    draws = [data_module.ood_params(3, p, 30.0, 0.5) for p in range(200)]
    assert draws == [data_module.ood_params(3, p, 30.0, 0.5) for p in range(200)]
    angles, brightness, contrast = map(np.asarray, zip(*draws, strict=True))
    assert np.abs(angles).max() <= 30 and angles.min() < -20 and angles.max() > 20
    for factor in (brightness, contrast):
        assert factor.min() >= 0.5 and factor.max() <= 1.5


class Swap(PeriodicPerturbation):
    """A perturbation of non-image samples: the stream needs nothing of the sample but what the transform takes."""

    def __call__(self, sample, position, seed):
        return f"{sample[::-1]}@{position}/{seed}"


def test_stream_is_modality_neutral_and_asks_the_perturbation_where_it_inserts():
    base = [(f"text{i}", i % 3) for i in range(7)]
    stream = StreamDataset(base, [6, 0, 3, 2, 5], transform=str.upper, seed=9, perturbation=Swap(2))
    assert isinstance(stream.perturbation, Perturbation)
    assert len(stream) == 7  # 5 normal + 5 // 2 inserted
    items = [stream[p] for p in range(len(stream))]
    assert [item["inputs"] for item in items] == ["TEXT6", "TEXT0", "0TXET@2/9", "TEXT3", "TEXT2", "2TXET@5/9", "TEXT5"]
    assert [bool(item["ood"]) for item in items] == [False, False, True, False, False, True, False]
    assert [int(item["label"]) for item in items] == [0, 0, 0, 0, 2, 2, 2]
    assert [int(item["position"]) for item in items] == list(range(7))
    with pytest.raises(IndexError):
        stream[7]
    assert len(StreamDataset(base, [1, 2], transform=str)) == 2


# ---------------------------------------------------------------- checkpoint state and exact resume
def test_state_round_trip_and_refusal_of_another_stream(cifar10):
    dm = make(CIFAR10(root=str(cifar10), image_size=8))
    state = {"position": 13, "seed": 0, "length": N_TRAIN, "dataset": "cifar10", "ood_every": None}
    dm.load_state_dict(state)
    loader = dm.train_dataloader()
    assert len(loader) == N_TRAIN and [int(b["position"]) for b in loader] == list(range(13, N_TRAIN))
    # Only samples that reach training advance it (on_before_batch_transfer); the class names (label ids) come too.
    assert dm.state_dict() == {**state, "drift_every": None, "steps": None, "classes": dm.classes}
    assert [int(b["position"]) for b in loader] == list(range(N_TRAIN))  # the next pass is the whole stream
    assert loader.state_dict() == {}  # the position is saved once, by the DataModule
    assert int(next(iter(dm.train_dataloader()))["position"]) == 0  # a fresh fit starts over
    dm.load_state_dict({**state, "position": N_TRAIN})  # a finished stream: the next pass starts over
    assert int(next(iter(dm.train_dataloader()))["position"]) == 0
    with pytest.raises(ValueError, match=r"position 21 is outside \[0, 20\]"):
        dm.load_state_dict({**state, "position": 21})
    with pytest.raises(ConfigError, match=r"trained with classes \['cat', 'dog'\]") as err:
        dm.load_state_dict({**state, "classes": ["cat", "dog"]})  # resuming would mix up the label ids
    assert err.value.field == "source"

    with pytest.raises(ConfigError, match=r"the checkpoint's stream has seed=0 .*seed=1.*resume with seed=0") as err:
        make(CIFAR10(root=str(cifar10), image_size=8), seed=1).load_state_dict(state)
    assert (err.value.field, err.value.owner) == ("seed", StreamDataModule) and "--" not in str(err.value)
    with pytest.raises(ConfigError, match=r"length=20 but this run's has length=5") as err:
        make(CIFAR10(root=str(cifar10), image_size=8), max_samples=5).load_state_dict(state)
    assert err.value.field == "max_samples"
    pending = StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), perturbation=RotationJitter(4))
    pending.load_state_dict(state)  # before setup: checked once the stream is known
    with pytest.raises(ConfigError, match=r"ood_every=None but this run's has ood_every=4") as err:
        pending.setup("fit")
    assert err.value.field == "perturbation" and "resume with a perturbation of every=None" in str(err.value)
    cursor = StreamCursor("cifar10", 0, N_TRAIN, None)
    cursor.load_state_dict(state)
    cursor.advance_past(15)
    assert cursor.state_dict() == {**state, "drift_every": None, "position": 16, "steps": None}


# ---------------------------------------------------------------- drifting labels
def test_drifting_stream_permutes_the_labels_exactly_every_drift_every_positions(cifar10):
    plain = make(CIFAR10(root=str(cifar10), image_size=8), seed=2)
    drifting = make(CIFAR10(root=str(cifar10), image_size=8), seed=2, drift_every=6)
    classes = len(plain.classes)
    true = [int(plain.train_stream[p]["label"]) for p in range(N_TRAIN)]
    shown = [int(drifting.train_stream[p]["label"]) for p in range(N_TRAIN)]
    assert [decode(b["inputs"][0]) for b in drifting.train_dataloader()] == stream_ids(plain)  # same samples
    assert shown[:6] == true[:6]  # the first segment keeps the dataset's labels
    mappings = [drifting.train_stream.drift.mapping(s) for s in range(4)]  # positions 0-5, 6-11, 12-17, 18-19
    for position in range(N_TRAIN):
        assert shown[position] == mappings[position // 6][true[position]]
    for before, after in zip(mappings, mappings[1:], strict=False):
        assert sorted(after) == list(range(classes)) and after != before  # a permutation, changed at each boundary
    again = make(CIFAR10(root=str(cifar10), image_size=8), seed=2, drift_every=6)
    assert [int(again.train_stream[p]["label"]) for p in range(N_TRAIN)] == shown  # from (seed, segment) alone
    other = make(CIFAR10(root=str(cifar10), image_size=8), seed=3, drift_every=6)
    assert other.train_stream.drift.mapping(1) != mappings[1] or other.train_stream.drift.mapping(2) != mappings[2]
    held_out = [int(drifting.eval_dataset[i]["label"]) for i in range(len(drifting.eval_dataset))]
    assert held_out == [int(plain.eval_dataset[i]["label"]) for i in range(len(plain.eval_dataset))]


def test_drift_every_is_checked_and_part_of_the_stream_identity(cifar10):
    with pytest.raises(ConfigError, match="drift_every must be a positive integer") as err:
        StreamDataModule(CIFAR10(root=str(cifar10)), drift_every=0)
    assert err.value.field == "drift_every"
    state = make(CIFAR10(root=str(cifar10), image_size=8), drift_every=6).state_dict()
    assert state["drift_every"] == 6
    with pytest.raises(ConfigError, match=r"drift_every=6 but this run's has drift_every=None.*drift_every=6") as err:
        make(CIFAR10(root=str(cifar10), image_size=8)).load_state_dict(state)
    assert err.value.field == "drift_every"


# Lightning's notes about the deliberately minimal module below (no validation_step, manual optimization).
quiet_trainer = pytest.mark.filterwarnings(
    "ignore:You passed in a `val_dataloader` but have no `validation_step`",
    "ignore:Using ModelCheckpoint with manual optimization",
    "ignore:Be aware that when using `ckpt_path`, callbacks",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
    "error:You're resuming from a checkpoint that ended before the epoch ended",  # the loader counts as resumable
)


class Killed(Exception):
    """A run that dies mid-stream (Lightning tears down and re-raises it)."""


class Recorder(pl.LightningModule):
    """Records the stream positions and input checksums that reach training_step; one manual optimizer step each.

    ``labels`` records the labels that reach it, in the same order.

    Args:
        crash_at: raise in training_step at this stream position (a run that dies mid-stream).
        estimate_steps: ask ``trainer.estimated_stepping_batches`` in configure_optimizers, as an LR schedule does
            (Lightning then builds the train loader before it restores its loop state).
    """

    def __init__(self, crash_at: int | None = None, estimate_steps: bool = False) -> None:
        super().__init__()
        self.estimate_steps = estimate_steps
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, bool, float]] = []
        self.labels: list[int] = []
        self.crash_at = crash_at

    def training_step(self, batch, batch_idx):
        assert batch["inputs"].shape[0] == 1
        if int(batch["position"]) == self.crash_at:
            raise Killed(f"stopped at stream position {self.crash_at}")
        self.seen.append((int(batch["position"]), bool(batch["ood"]), float(batch["inputs"].double().sum())))
        self.labels.append(int(batch["label"]))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward((self.weight * batch["inputs"].mean()).sum())
        optimizer.step()

    def configure_optimizers(self):
        if self.estimate_steps:
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD([self.weight], lr=0.0)


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    """The shared quiet trainer, writing into tmp_path, checkpointing only where a callback asks."""
    return runs.trainer(default_root_dir=tmp_path, enable_checkpointing=bool(kwargs.get("callbacks")), **kwargs)


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint`` right after training step ``step`` (while the epoch is still running)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@quiet_trainer
@pytest.mark.parametrize("estimate_steps", [False, True])
def test_resume_after_max_steps_neither_skips_nor_repeats(cifar10, tmp_path, estimate_steps):
    k, ckpt = 7, tmp_path / "interrupted.ckpt"
    first = Recorder(estimate_steps=estimate_steps)
    run = trainer(tmp_path, max_steps=k, callbacks=[SaveAt(ckpt, k)])
    run.fit(first, datamodule=StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=3))
    assert [p for p, _, _ in first.seen] == list(range(k))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["StreamDataModule"]["position"] == k
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{}]  # saved once, by the DataModule

    second = Recorder(estimate_steps=estimate_steps)
    dm = StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=3)
    trainer(tmp_path).fit(second, datamodule=dm, ckpt_path=ckpt)
    positions = [p for p, _, _ in first.seen + second.seen]
    assert positions == list(range(N_TRAIN))
    expected = [float(dm.train_stream[p]["inputs"].double().sum()) for p in range(N_TRAIN)]
    assert [s for _, _, s in first.seen + second.seen] == expected

    with pytest.raises(ConfigError, match=r"seed=3 but this run's has seed=4"):
        other = StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=4)
        trainer(tmp_path).fit(Recorder(), datamodule=other, ckpt_path=ckpt)


# With a worker process the loader runs batches ahead of training_step: the saved position must not.
@quiet_trainer
@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_from_a_mid_stream_checkpoint_is_bit_exact_with_ood(cifar10, tmp_path, num_workers):
    def datamodule():
        return StreamDataModule(
            CIFAR10(root=str(cifar10), image_size=8), seed=1, num_workers=num_workers, perturbation=RotationJitter(4)
        )

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    full = Recorder()
    trainer(tmp_path, callbacks=[every]).fit(full, datamodule=datamodule())
    assert len(full.seen) == 25 and [p for p, _, _ in full.seen] == list(range(25))  # 20 normal + 5 OOD
    assert [p for p, ood, _ in full.seen if ood] == [4, 9, 14, 19, 24]

    resumed = Recorder()
    trainer(tmp_path).fit(resumed, datamodule=datamodule(), ckpt_path=tmp_path / "ckpt" / "step=10.ckpt")
    assert resumed.seen == full.seen[10:]


@quiet_trainer
def test_a_drifting_stream_resumed_mid_stream_shows_the_same_labels(cifar10, tmp_path):
    def datamodule():
        return StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=1, drift_every=4)

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    full = Recorder()
    trainer(tmp_path, callbacks=[every]).fit(full, datamodule=datamodule())
    resumed = Recorder()
    trainer(tmp_path).fit(resumed, datamodule=datamodule(), ckpt_path=tmp_path / "ckpt" / "step=10.ckpt")
    assert resumed.seen == full.seen[10:] and resumed.labels == full.labels[10:]
    plain = StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=1)
    plain.setup("fit")
    true = [int(plain.train_stream[p]["label"]) for p, _, _ in full.seen]
    assert full.labels[:4] == true[:4] and full.labels != true  # the labels drift after the first segment


@quiet_trainer
def test_a_run_stopped_mid_stream_resumes_at_its_last_checkpoint(cifar10, tmp_path):
    """Checkpoints every 3 steps, the run dies at position 8 with batches prefetched by a worker; resuming from the
    step-6 checkpoint trains positions 6, 7, ... once each."""
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    dm = StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=2, num_workers=1)
    crashed = Recorder(crash_at=8)
    with pytest.raises(Killed):
        trainer(tmp_path, callbacks=[every]).fit(crashed, datamodule=dm)
    assert [p for p, _, _ in crashed.seen] == list(range(8))
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["step=3.ckpt", "step=6.ckpt"]

    resumed = Recorder()
    trainer(tmp_path).fit(
        resumed,
        datamodule=StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), seed=2),
        ckpt_path=tmp_path / "ckpt" / "step=6.ckpt",
    )
    assert [p for p, _, _ in crashed.seen[:6] + resumed.seen] == list(range(N_TRAIN))
    expected = [float(dm.train_stream[p]["inputs"].double().sum()) for p in range(N_TRAIN)]
    assert [s for _, _, s in crashed.seen[:6] + resumed.seen] == expected


@quiet_trainer
def test_a_resumed_stream_that_ends_starts_the_next_epoch_at_zero(cifar10, tmp_path):
    def datamodule():
        return StreamDataModule(CIFAR10(root=str(cifar10), image_size=8), max_samples=6)

    mid, end = tmp_path / "mid.ckpt", tmp_path / "end.ckpt"
    trainer(tmp_path, callbacks=[SaveAt(mid, 4), SaveAt(end, 6)]).fit(Recorder(), datamodule=datamodule())
    resumed = Recorder()
    trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=datamodule(), ckpt_path=mid)
    assert [p for p, _, _ in resumed.seen] == [4, 5, 0, 1, 2, 3, 4, 5]
    finished = Recorder()
    trainer(tmp_path).fit(finished, datamodule=datamodule(), ckpt_path=end)
    assert finished.seen == []
    again = Recorder()
    trainer(tmp_path, max_epochs=2).fit(again, datamodule=datamodule(), ckpt_path=end)
    assert [p for p, _, _ in again.seen] == list(range(6))
