"""Every config in configs/ parses and builds, and the paper experiments have the paper's trainable counts."""

import shlex
from pathlib import Path

import pytest
import torch
import yaml

from loko_lightning.cli import LoKOCLI
from loko_lightning.cli.configs import resolve_config_names
from loko_lightning.data import StreamDataModule
from loko_lightning.kalman.filters import get_filter
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models.adapters import count_parameters

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Trainable parameters in the paper's table (Appendix, "Total and trainable parameters") per experiment.
PAPER_COUNTS = {
    "mnist_densenet121": 166_000,
    "cifar10_resnet18": 150_000,
    "cifar10_vit_b16": 155_000,
    "cifar100_resnet50": 520_000,
    "cifar100_vit_b16": 155_000,
    "imagenet100_vit_l16": 400_000,
    # Language (RoBERTa with LoRA on the queries; "Result Language" table).
    **{f"{task}_roberta_base": 666_000 for task in ("sst2", "cola", "mrpc")},
    **{f"{task}_roberta_large": 1_248_000 for task in ("sst2", "cola", "mrpc")},
}


def build(config, *overrides):
    args = ["--config", str(config), "--model.network.pretrained", "false", *overrides]
    return LoKOCLI(OnlineClassifier, StreamDataModule, args=args, run=False)


def test_every_paper_experiment_has_a_config():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} >= set(PAPER_COUNTS) | {"debug"}


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_paper_config_builds_with_the_papers_trainable_count(name):
    # On the meta device: the real modules and adapters, no memory for weights (ViT-L/16 has 304M parameters).
    with torch.device("meta"):
        cli = build(CONFIGS / f"{name}.yaml", "--trainer.logger", "false")
    trainable, _ = count_parameters(cli.model.network)
    assert abs(trainable - PAPER_COUNTS[name]) / PAPER_COUNTS[name] <= 0.03, trainable
    assert cli.model.is_kalman
    assert cli.datamodule.hparams.preprocessing == cli.model.network_factory.preprocessing()  # the data follows it


@pytest.mark.parametrize("config", ["cifar10_resnet18", "sst2_roberta_base"])
@pytest.mark.parametrize(
    ("name", "optimizer", "scheduler"),
    [("adamw", torch.optim.AdamW, torch.optim.lr_scheduler.LinearLR), ("adagrad", torch.optim.Adagrad, None)],
)
def test_baseline_overlays_build_on_image_and_text_configs(config, name, optimizer, scheduler):
    """``--config <experiment> --config configs/baselines/<name>.yaml``: the paper's baseline optimizer and schedule
    (AdamW with linear decay, AdaGrad at a constant rate) replace LoKO."""
    overlay = ["--config", str(CONFIGS / "baselines" / f"{name}.yaml")]
    with torch.device("meta"):
        cli = build(CONFIGS / f"{config}.yaml", *overlay, "--trainer.logger", "false")
    optim = cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    assert type(optim) is optimizer and not cli.model.is_kalman
    schedule = cli.model.lr_scheduler_factory
    assert (schedule is None) if scheduler is None else type(schedule(optim)) is scheduler


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_has_the_four_sections_and_builds(path):
    """Every experiment config parses with the four top-level sections and builds (on the meta device: no weights)."""
    config = yaml.safe_load(path.read_text())
    assert {"seed_everything", "trainer", "model", "data"} <= set(config)
    if path.stem in PAPER_COUNTS:
        return  # built with its trainable count above
    with torch.device("meta"):
        cli = build(path, "--trainer.logger", "false")
    assert cli.datamodule.hparams.preprocessing == cli.model.network_factory.preprocessing()  # the data follows it


PAPER_LOKO = {
    "p0": 0.2,
    "p0_init": "uniform",
    "process_noise": 0.0,
    "observation": "softmax",
    # The filter owns its settings: the paper's beta and Taylor R, the EMA of R not debiased, the prior not scaled, no
    # categorical noise added to the estimate.
    "filter": {
        "name": "covariance",
        "beta": 0.95,
        "r_estimator": "taylor",
        "rcond": None,
        "debias": False,
        "prior_scale_rate": 0.0,
        "prior_scale_until": 0,
        "softmax_noise": False,
    },
}


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("presets/loko_topk", {"observation": "topk5", "r_estimator": "taylor", "p0": 0.2}),
        # The information-form filters keep no R setting (their noise is the categorical one).
        ("presets/loko_natural", {"filter": "natural", "p0": 0.03}),
        ("presets/loko_lofi", {"filter": "lofi10", "p0": 0.03}),
        ("presets/loko_natural_average", {"filter": "natural", "p0": 0.03, "average": 0.99}),
    ],
)
def test_a_retired_preset_is_refused_naming_the_flags_that_build_its_settings(preset, expected):
    """Four presets remain; a retired one is one line giving its settings as flags, and those flags build them."""
    with pytest.raises(ValueError, match="that preset was retired") as caught:
        resolve_config_names(["fit", "--config", preset])
    flags = str(caught.value).split("its settings as flags: ")[1]
    extra = ["--trainer.logger", "false", *shlex.split(flags)]
    with torch.device("meta"):
        cli = build(CONFIGS / "cifar100_resnet50.yaml", *extra)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = cli.model.optimizer_factory([param])
    # The filter's settings are the filter's (its config), the prior's the group's.
    settings = {**optimizer.param_groups[0], **optimizer.filter.config(), "average": optimizer.average}
    settings["filter"] = optimizer.filter.spec
    assert {k: settings[k] for k in expected} == expected


def test_only_four_presets_ship():
    """The paper's, the image and text defaults' parts (to pin them), and the frozen-head mixture for early streams."""
    shipped = sorted(path.stem for path in (CONFIGS / "presets").glob("*.yaml"))
    assert shipped == ["loko_images", "loko_mixture_lda", "loko_paper", "loko_text"]
    for name in shipped:  # each pins itself: the default does not decide over a preset
        assert yaml.safe_load((CONFIGS / "presets" / f"{name}.yaml").read_text())["loko"] == "as_configured"


@pytest.mark.parametrize("name", ["fashion_mnist_lite0", "cifar10_resnet18", "sst2_roberta_base"])
def test_the_paper_preset_pins_the_papers_loko_over_any_earlier_setting(name):
    """configs/presets/loko_paper.yaml, layered last, gives the paper's LoKO even after flags that changed it."""
    changed = [
        "--model.optimizer.p0",
        "0.05",
        "--model.optimizer.time_update",
        "{process_noise: 1e-5}",
        "--model.optimizer.filter",
        "{name: covariance, beta: 0.9}",
        "--model.optimizer.filter",
        "natural",
        "--model.optimizer.init_args.average",
        "0.99",
        "--model.step_scales",
        "{head: 0.1}",
    ]
    preset = ["--config", str(CONFIGS / "presets" / "loko_paper.yaml")]
    extra = ["--trainer.logger", "false"]
    with torch.device("meta"):
        plain = build(CONFIGS / f"{name}.yaml", *extra, "--loko", "as_configured")
        pinned = build(CONFIGS / f"{name}.yaml", *extra, *changed, *preset)
        unpinned = build(CONFIGS / f"{name}.yaml", *extra, *preset, *changed)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizers = {
        key: cli.model.optimizer_factory([param])
        for key, cli in (("plain", plain), ("pinned", pinned), ("unpinned", unpinned))
    }
    groups = {key: optimizer.param_groups[0] for key, optimizer in optimizers.items()}
    assert (optimizers["plain"].average, optimizers["pinned"].average, optimizers["unpinned"].average) == (0, 0, 0.99)
    scales = (plain.model.step_scales, pinned.model.step_scales, unpinned.model.step_scales)
    assert scales == (None, None, {"head": 0.1})
    for key in ("plain", "pinned"):
        assert {k: groups[key][k] for k in PAPER_LOKO} == PAPER_LOKO, key
        assert groups[key]["p_floor"] == 0.0
    unpinned = groups["unpinned"]
    # beta is the covariance filter's: the natural filter has none to take.
    assert (unpinned["p0"], unpinned["process_noise"], unpinned["filter"]) == (
        0.05,
        1e-5,
        {"name": "natural", "fisher": "empirical"},
    )


def test_the_image_preset_shares_the_heads_rows_under_a_tenth_of_the_prior():
    """presets/loko_images: the average, one Σ for the head's weight and the head's p0 0.1 x 0.2."""
    extra = ["--trainer.logger", "false"]
    preset = str(CONFIGS / "presets" / "loko_images.yaml")
    with torch.device("meta"):
        cli = build(CONFIGS / "fashion_mnist_lite0.yaml", *extra, "--config", preset)
    assert (cli.model.head_covariance, cli.model.step_scales) == ("shared", {"head": 0.1})
    optimizer = cli.model.build_optimizer()
    assert optimizer.average == 0.99
    groups = [(g["shared_rows"], g["p0_scale"], tuple(g["params"][0].shape)) for g in optimizer.param_groups]
    assert groups[-2:] == [(True, 0.1, (10, 1280)), (False, 0.1, (10,))]  # the head's weight, then its bias
    assert {g[:2] for g in groups[:-2]} == {(False, 1.0)}  # the adapters


def test_the_paper_preset_pins_a_diagonal_head_covariance():
    extra = ["--trainer.logger", "false"]
    paper = ["--config", str(CONFIGS / "presets" / "loko_paper.yaml")]
    with torch.device("meta"):
        cli = build(CONFIGS / "fashion_mnist_lite0.yaml", *extra, "--model.head_covariance", "shared", *paper)
    assert cli.model.head_covariance == "diagonal"


def test_the_text_preset_is_one_filter_whose_prior_scale_is_set_online():
    """presets/loko_text over the text quick start: one filter from p0 10, its prior's scale set by its predictive
    likelihood on the first 500 updates (no choice among filters), one covariance over the sentence embedding for the
    head's rows."""
    extra = ["--trainer.logger", "false"]
    cli = build(CONFIGS / "text_quickstart.yaml", *extra, "--config", str(CONFIGS / "presets" / "loko_text.yaml"))
    assert cli.model.head_covariance == "shared" and cli.model.select is None
    optimizer = cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(3))])
    assert optimizer.param_groups[0]["p0"] == 10.0
    expected = {"debias": True, "prior_scale_rate": 0.03, "prior_scale_until": 500}
    assert optimizer.filter.config() == {**get_filter("covariance").config(), **expected}
