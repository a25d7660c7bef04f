"""The network factory base: one argument check and one target rule for every family, the head choices declared once,
and a new family (here a torchvision-style stub defined in this file) trained without any change to the data layer."""

import typing

import lightning.pytorch as pl
import pytest
import torch
import yaml
from peft.tuners.lora import LoraLayer
from runs import outputs
from text_helpers import tiny_text_network
from torch import nn

from loko_lightning import LoKO
from loko_lightning.cli import main
from loko_lightning.data import MNIST5k, StreamDataModule
from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import NetworkFactory, TimmClassifier, TransformersClassifier
from loko_lightning.preprocessing import ImagePreprocessing

FAMILIES = {TimmClassifier: "test_resnet", TransformersClassifier: "roberta-base"}


class TinyConvNet(NetworkFactory):
    """A torchvision-style factory: its own small network (no timm, no peft) and its own preprocessing."""

    def __init__(self, num_classes: int = 10, width: int = 4) -> None:
        self.check_arguments(num_classes=num_classes)
        self.backbone, self.num_classes, self.width = "tiny_conv", num_classes, width

    def preprocessing(self) -> ImagePreprocessing:
        return ImagePreprocessing(
            input_size=(3, 12, 12), interpolation="bilinear", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), crop_pct=1.0
        )

    def _build(self) -> nn.Module:
        network = nn.Sequential(
            nn.Conv2d(3, self.width, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(self.width, self.num_classes),
        )
        self.init_head(network[-1])
        return network


@pytest.mark.parametrize(
    ("arguments", "field", "message"),
    [
        ({"backbone": ""}, "backbone", "backbone must be a model name or directory, got ''"),
        ({"num_classes": 0}, "num_classes", "num_classes must be a positive integer, got 0"),
        ({"num_classes": True}, "num_classes", "num_classes must be a positive integer, got True"),
        ({"r": 0}, "r", "r (the adapter rank) must be a positive integer, got 0"),
        ({"alpha": -1.0}, "alpha", "alpha (the LoRA scaling numerator) must be a positive number, or null for r"),
        ({"dropout": 1.0}, "dropout", "dropout must lie in [0, 1), got 1.0"),
        ({"target": []}, "target", "target must be a preset ('convs', 'query'), a regular expression or a list"),
        ({"target": "[unclosed"}, "target", "target='[unclosed' is not a preset ('convs', 'query') nor a valid regex"),
    ],
)
def test_every_family_checks_its_arguments_alike_before_anything_is_built(arguments, field, message):
    for factory, backbone in FAMILIES.items():
        with pytest.raises(ConfigError) as err:
            factory(**{"backbone": backbone, **arguments})
        assert (err.value.field, err.value.owner) == (field, factory)
        assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("factory", list(FAMILIES))
def test_the_head_choices_are_declared_once(factory):
    """The choices the configuration offers (the signature's Literal) are the ones the check accepts."""
    offered = typing.get_args(typing.get_type_hints(factory.__init__)["head_init"])
    assert factory.head_inits == offered and "zeros" in offered
    with pytest.raises(ConfigError, match=f"head_init must be {' or '.join(map(repr, offered))}, got 'ones'"):
        factory(FAMILIES[factory], head_init="ones")


def adapted(network):
    return sorted(n.split("base_model.model.")[-1] for n, m in network.named_modules() if isinstance(m, LoraLayer))


def test_module_names_are_targets_of_every_family_and_unknown_ones_are_refused_alike(monkeypatch):
    query = "bert.encoder.layer.1.attention.self.query"
    text = tiny_text_network(monkeypatch, "tiny-bert", randomize=False, target=[query])
    assert adapted(text) == [query]
    image = TimmClassifier("test_resnet", 4, pretrained=False, target=["layer1.0.conv1"], r=2)()
    assert adapted(image) == ["layer1.0.conv1"]

    with pytest.raises(ConfigError) as err:
        tiny_text_network(monkeypatch, "tiny-bert", target=[query.replace("query", "qeury")])
    assert (err.value.field, err.value.owner) == ("target", TransformersClassifier)
    assert str(err.value).startswith(f"unknown module(s) in target: ['{query.replace('query', 'qeury')}']")
    close = str(err.value).split("close names: ")[1].split(";")[0]
    assert f"'{query}'" in close and "adaptable modules of BertForSequenceClassification" in str(err.value)
    with pytest.raises(ConfigError) as err:
        TimmClassifier("test_resnet", 4, pretrained=False, target=["layer9.conv"], r=2)()
    assert (err.value.field, err.value.owner) == ("target", TimmClassifier)
    assert str(err.value).startswith("unknown module(s) in target: ['layer9.conv']")
    assert "adaptable modules of ResNet" in str(err.value) and "'layer1.0.conv1'" in str(err.value)
    # The head is trained in full: no family adapts it.
    with pytest.raises(ConfigError, match=r"belong to the new head") as err:
        tiny_text_network(monkeypatch, "tiny-bert", target=["classifier"])
    assert err.value.owner is TransformersClassifier


def test_a_new_family_trains_through_the_learner_and_the_stream_without_changes_to_the_data_layer():
    torch.manual_seed(0)
    factory = TinyConvNet(num_classes=10)
    data = StreamDataModule(MNIST5k(), preprocessing=factory.preprocessing(), max_samples=6, eval_max_samples=4)
    assert data.data_config["input_size"] == (3, 12, 12) and data.data_config["mean"] == (0.5, 0.5, 0.5)
    assert data.data_config["interpolation"] == "bilinear" and data.data_config["crop_pct"] == 1.0
    model = OnlineClassifier(factory, lambda params: LoKO(params, p0=0.1, seed=0))
    before = [p.detach().clone() for p in model.trainable_parameters]
    trainer = pl.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0
    )
    trainer.fit(model, data)
    assert trainer.global_step == 6
    assert next(iter(data.train_dataloader()))["inputs"].shape == (1, 3, 12, 12)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.trainable_parameters, strict=True))


def tiny_config(tmp_path, network="TinyConvNet"):
    """A ``loko`` config of a 6-sample MNIST stream for a network factory of this file, by class path."""
    config = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 1},
        "model": {
            "network": {"class_path": f"{__name__}.{network}", "init_args": {"num_classes": 10}},
            "optimizer": {"class_path": "loko_lightning.LoKO", "init_args": {"p0": 0.1}},
        },
        "data": {"source": {"class_path": "loko_lightning.data.MNIST5k"}, "max_samples": 6, "eval_max_samples": 4},
    }
    path = tmp_path / f"{network}.yaml"
    path.write_text(yaml.safe_dump(config))
    return ["--config", str(path), *outputs(tmp_path, plot=False)]


def test_a_new_family_runs_through_the_loko_command_by_class_path(tmp_path):
    main(["fit", *tiny_config(tmp_path)])
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)  # as `loko test` reads it
    assert ckpt["global_step"] == 6
    assert ckpt["datamodule_hyper_parameters"]["preprocessing"] == TinyConvNet().preprocessing()


class UnsizedConvNet(TinyConvNet):
    """A factory whose preprocessing refuses one of its arguments."""

    def preprocessing(self) -> ImagePreprocessing:
        raise ConfigError(f"width={self.width} has no input size", field="width", owner=self)


def test_an_error_of_a_factorys_preprocessing_names_its_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *tiny_config(tmp_path, "UnsizedConvNet")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "loko: error: --model.network.width: width=4 has no input size"
    )
