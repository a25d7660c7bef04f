"""The LoKO ``loko fit`` runs without a preset: decided from the model and the run, printed in one line, pinnable."""

import logging
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace

from loko_lightning import LoKO
from loko_lightning.cli import LoKOCLI, main
from loko_lightning.cli.default import LEARNER_DEFAULTS, MANY_CLASS_IMAGES, decide, default_arguments, distributed
from loko_lightning.data import StreamDataModule
from loko_lightning.learner.module import OnlineClassifier

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = sorted(
    path.stem for path in CONFIGS.glob("*.yaml") if path.stem.split("_")[0] in ("cifar10", "cifar100", "imagenet100")
) + ["mnist_densenet121", "sst2_roberta_base", "cola_roberta_large", "mrpc_roberta_base", "debug"]


def build(config, *overrides, caplog=None):
    args = ["--config", str(CONFIGS / f"{config}.yaml"), "--model.network.pretrained", "false"]
    args += ["--trainer.logger", "false", *overrides]
    with torch.device("meta"):
        return LoKOCLI(OnlineClassifier, StreamDataModule, args=args, run=False)


def settings(cli):
    """What the built learner runs: the optimizer's arguments and the learner's options the default sets."""
    optimizer = cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(3))])
    group = optimizer.param_groups[0]
    select = cli.model.select
    return {
        "p0": "auto" if select is not None else group["p0"],
        "grid": select.values if select is not None else None,
        "filter": LoKO.arguments(optimizer.state_dict())["filter"],
        "average": optimizer.average,
        "head_covariance": cli.model.head_covariance,
        "step_scales": cli.model.step_scales,
        "mixture": cli.model.hparams["mixture"],
    }


def decided_line(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoKO")]


def test_an_image_backbone_with_ten_classes_gets_the_image_default_and_one_line_saying_so(caplog):
    with caplog.at_level(logging.INFO):
        cli = build("quickstart")
    got = settings(cli)
    assert (got["average"], got["head_covariance"], got["step_scales"], got["p0"]) == (
        0.99,
        "shared",
        {"head": 0.1},
        0.2,
    )
    # Predicting with its mixture with streaming LDA on the frozen features (OAS), the preset's experts.
    assert got["mixture"]["head"]["class_path"].endswith("StreamingLDA")
    # weighed by Bayes with a share to the past posteriors and a smaller fixed share (mixing past posteriors).
    assert (got["mixture"]["share"], got["mixture"]["share_past"]) == (0.001, 0.01)
    assert len(got["mixture"]["temperatures"]) == 13 and got["mixture"]["vote"]
    # and the learner's prediction also sharpened, for Bayes' weights to pick its calibration.
    assert got["mixture"]["learner_temperatures"] == [0.5, 0.7, 0.85]
    # with the log-linear pools of the learner and LDA, and nearest class mean on LDA's statistics (all image defaults).
    assert got["mixture"]["pools"] == [0.5, 1.0] and got["mixture"]["nearest_mean"] is True
    assert got["mixture"]["nearest_vote"] is False  # neutral on 10 classes: off
    # and its top-1 confidence recalibrated by its bins (the mixture averages its experts: underconfident at 64 px).
    assert got["mixture"]["calibration"] == 300
    (line,) = decided_line(caplog)
    assert "presets/loko_images + presets/loko_mixture_lda" in line and "10 classes" in line and "as_configured" in line
    assert "--config presets/loko_images runs the filter alone" in line  # the way out of the mixture's cost
    # Once decided, the configuration says so: a saved config.yaml runs as it is, with no second decision.
    assert cli.config.loko == "as_configured"


def test_a_text_backbone_gets_one_filter_whose_prior_scale_is_set_online():
    for config in ("text_quickstart", "wordnet_minilm"):  # 5 and 25 classes
        got = settings(build(config))
        assert (got["p0"], got["grid"], got["average"]) == (10.0, None, 0.0), config
        assert (got["filter"]["prior_scale_rate"], got["filter"]["prior_scale_until"]) == (0.03, 500), config
        assert got["filter"]["debias"] is True, config
        assert got["head_covariance"] == "shared" and got["step_scales"] is None  # WordNet: NLL 1.344 -> 1.306
        # predicting with the mixture on the frozen sentence embedding, the learner also softened and sharpened.
        assert got["mixture"]["head"]["class_path"].endswith("StreamingLDA"), config
        assert got["mixture"]["learner_temperatures"] == [0.5, 0.7, 0.85, 1.25, 1.5, 2.0], config
        assert got["mixture"]["nearest_mean"] is False, config  # not measured on text
        assert (got["mixture"]["share"], got["mixture"]["share_past"]) == (0.001, 0.01), config
        assert got["mixture"]["calibration"] == 300, config


def test_an_image_backbone_with_a_hundred_classes_gets_the_natural_filter_with_the_averaged_mean_and_the_mixture(
    caplog,
):
    with caplog.at_level(logging.INFO):
        got = settings(build("glyphs100_lite0"))
    assert (got["filter"]["name"], got["p0"], got["average"]) == ("natural", 0.03, 0.99)
    assert got["mixture"]["head"]["class_path"].endswith("StreamingLDA")
    assert (got["mixture"]["share"], got["mixture"]["share_past"]) == (0.001, 0.01)
    assert got["mixture"]["pools"] == [0.5, 1.0] and got["mixture"]["nearest_mean"] is True
    assert got["mixture"]["nearest_vote"] is True  # on 100 classes only
    assert got["mixture"]["calibration"] == 300
    (line,) = decided_line(caplog)
    assert "the many-class image default + presets/loko_mixture_lda" in line and "100 classes" in line
    assert "nearest class mean (and its vote)" in line
    # The way out of the mixture's cost: the filter's three flags, given, pin it alone.
    flags = [flag for pair in (f.split("=", 1) for f in MANY_CLASS_IMAGES) for flag in pair]
    assert all(flag in line for flag in MANY_CLASS_IMAGES)
    with caplog.at_level(logging.INFO):
        alone = settings(build("glyphs100_lite0", *flags))
    assert (alone["filter"]["name"], alone["p0"], alone["average"], alone["mixture"]) == ("natural", 0.03, 0.99, None)


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_the_paper_configs_pin_the_papers_filter(name, caplog):
    with caplog.at_level(logging.INFO):
        got = settings(build(name))
    assert {key: got[key] for key in ("p0", "average")} == {"p0": 0.2, "average": 0.0}
    assert got["filter"]["name"] == "covariance" and got["filter"]["beta"] == 0.95
    assert (got["head_covariance"], got["step_scales"], got["mixture"]) == ("diagonal", None, None)
    # Pinned: nothing decided, one line saying so.
    assert decided_line(caplog) == [
        "LoKO as configured: the configuration pins it (loko: as_configured); the paper's filter, every LoKO setting "
        "at its default"
    ]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model.optimizer.init_args.p0", "0.5"], "--model.optimizer.p0 0.5"),
        (["--model.optimizer.init_args.filter", "{name: covariance, beta: 0.9}"], "--model.optimizer.filter"),
        (["--model.optimizer.init_args.time_update", "{process_noise: 1e-6}"], "--model.optimizer.time_update"),
        (["--model.head_covariance", "shared"], "--model.head_covariance shared"),
        (
            ["--model.mixture", "loko_lightning.learner.mixture.FrozenHeadMixture"]
            + ["--model.mixture.head", "StreamingLDA"],
            "--model.mixture",
        ),
    ],
)
def test_a_setting_the_configuration_changed_is_kept_and_the_line_names_it(flags, named, caplog):
    with caplog.at_level(logging.INFO):
        got = settings(build("quickstart", *flags))
    assert got["average"] == 0.0  # nothing of the image default
    (line,) = decided_line(caplog)
    assert line.startswith("LoKO as configured: ") and named in line


def test_the_paper_filters_own_values_written_out_are_no_change():
    """The quick starts used to spell the paper's filter out (p0 0.2, beta 0.95): that is the default's to decide."""
    flags = [
        "--model.optimizer.init_args.p0",
        "0.2",
        "--model.optimizer.init_args.filter",
        "{name: covariance, beta: 0.95}",
    ]
    assert settings(build("quickstart", *flags))["average"] == 0.99


def test_as_configured_and_the_paper_preset_run_the_papers_filter():
    for flags in (["--loko", "as_configured"], ["--config", str(CONFIGS / "presets" / "loko_paper.yaml")]):
        got = settings(build("quickstart", *flags))
        assert (got["p0"], got["average"], got["head_covariance"], got["step_scales"]) == (0.2, 0.0, "diagonal", None)
        assert got["mixture"] is None


def test_several_processes_keep_the_image_and_text_defaults(caplog):
    """Under DDP each step is one joint update of every process's samples; the text default, one filter since its
    prior's scale is set online (no choice of p0 among filters, which ran in one process), keeps its settings too."""
    ddp = ("--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    with caplog.at_level(logging.INFO):
        images, text = settings(build("quickstart", *ddp)), settings(build("text_quickstart", *ddp))
    assert (images["average"], images["head_covariance"]) == (0.99, "shared")
    assert (text["p0"], text["filter"]["prior_scale_rate"], text["head_covariance"]) == (10.0, 0.03, "shared")
    image_line, text_line = decided_line(caplog)
    assert "several processes (measured in one)" in image_line and "presets/loko_images" in image_line
    # The mixture mixes every process's samples under DDP: both defaults keep it there.
    assert images["mixture"] is not None and "presets/loko_mixture_lda" in image_line
    assert text["mixture"] is not None and "5 classes, several processes (measured in one)" in text_line


def test_several_processes_keep_the_many_class_image_default_with_the_mixture(caplog):
    ddp = ("--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    with caplog.at_level(logging.INFO):
        got = settings(build("glyphs100_lite0", *ddp))
    assert (got["filter"]["name"], got["p0"], got["average"]) == ("natural", 0.03, 0.99)
    assert got["mixture"] is not None
    (line,) = decided_line(caplog)
    assert "several processes (measured in one)" in line and "presets/loko_mixture_lda" in line


def test_the_sharded_update_keeps_the_image_defaults_with_a_covariance_per_head_row(caplog):
    """``shard: true`` says how the update is computed: the image defaults keep their filter and mixture, the 10-class
    one with a covariance per head row (the sharded update refuses a shared one), and say so; text runs as configured
    (its online choice of p0 runs in one unsharded process)."""
    shard = ("--model.optimizer.init_args.shard", "true")
    with caplog.at_level(logging.INFO):
        images, many = (build(config, *shard) for config in ("quickstart", "glyphs100_lite0"))
        text = settings(build("text_quickstart", *shard))
    for cli in (images, many):
        assert cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(3))]).shard
    images, many = settings(images), settings(many)
    assert (images["average"], images["head_covariance"], images["step_scales"]) == (0.99, "diagonal", {"head": 0.1})
    assert (many["filter"]["name"], many["p0"], many["average"]) == ("natural", 0.03, 0.99)
    assert images["mixture"] is not None and many["mixture"] is not None
    image_line, many_line, text_line = decided_line(caplog)
    assert "a covariance per head row" in image_line and "presets/loko_mixture_lda" in image_line
    assert "the many-class image default" in many_line
    assert text_line.startswith("LoKO as configured: --model.optimizer.shard True is set")
    assert text["p0"] == 0.2 and text["mixture"] is None


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ({}, False),
        ({"devices": "auto", "accelerator": "cpu"}, False),
        ({"devices": 1}, False),
        ({"devices": 2}, True),
        ({"devices": "2"}, True),
        ({"devices": [0, 1]}, True),
        ({"devices": [0]}, False),
        ({"num_nodes": 2}, True),
        ({"strategy": "ddp"}, True),
        ({"strategy": "ddp_spawn"}, True),
        ({"strategy": {"class_path": "lightning.pytorch.strategies.DDPStrategy"}}, True),
        ({"strategy": "auto", "devices": 1}, False),
    ],
)
def test_which_trainer_configurations_run_several_processes(trainer, expected, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = Namespace(**{key: Namespace(**v) if isinstance(v, dict) else v for key, v in trainer.items()})
    assert distributed(config) is expected


def test_a_gradient_optimizer_is_not_decided():
    assert settings_free(build("quickstart", "--config", str(CONFIGS / "baselines" / "adamw.yaml")))


def settings_free(cli):
    optimizer = cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(3))])
    return isinstance(optimizer, torch.optim.AdamW) and cli.model.head_covariance == "diagonal"


def test_decide_reads_the_top_level_key():
    loko = Namespace(class_path="loko_lightning.LoKO", init_args=Namespace())
    adamw = Namespace(class_path="torch.optim.AdamW", init_args=Namespace())
    pinned = decide(Namespace(loko="as_configured", model=Namespace(optimizer=loko, **LEARNER_DEFAULTS)))
    assert (pinned.name, pinned.args) == (None, ())  # nothing decided, nothing applied
    assert decide(Namespace(loko="as_configured", model=Namespace(optimizer=adamw))) is None  # not a LoKO: no line


def test_a_pinned_configuration_still_says_which_loko_runs(caplog):
    """``loko: as_configured`` (a preset, the paper's configs, a saved config.yaml): one line naming what it sets."""
    with caplog.at_level(logging.INFO):
        build("text_quickstart", "--config", str(CONFIGS / "presets" / "loko_text.yaml"))
        build("cifar10_resnet18")
    text, paper = decided_line(caplog)
    assert text == (
        "LoKO as configured: the configuration pins it (loko: as_configured); it sets p0 10.0, filter, head_covariance "
        "shared"
    )
    assert paper.endswith("(loko: as_configured); the paper's filter, every LoKO setting at its default")


def test_print_config_prints_what_was_decided(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "quickstart", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["loko"] == "as_configured" and printed["model"]["head_covariance"] == "shared"
    assert printed["model"]["optimizer"]["init_args"]["average"] == 0.99


def test_a_fit_with_the_default_saves_what_it_ran_and_the_checkpoint_serves_it(tmp_path, monkeypatch):
    """Through ``loko fit``: the default decided, its checkpoint's learner and optimizer rebuilt as they ran."""
    monkeypatch.chdir(tmp_path)
    main([
        "fit", "--config", "debug", "--loko", "default", "--data.max_samples", "6", "--data.eval_max_samples", "2",
        "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", "[]",
        "--trainer.enable_checkpointing", "true",
    ])  # fmt: skip
    (ckpt,) = tmp_path.rglob("*.ckpt")
    loaded = OnlineClassifier.load_from_checkpoint(ckpt, weights_only=False)
    assert (loaded.head_covariance, loaded.step_scales) == ("shared", {"head": 0.1})
    state = torch.load(ckpt, weights_only=False)
    assert state["optimizer_states"][0]["param_groups"][0]["p0"] == 0.2


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--model.step_scales", "{head: 0.1}"], "step_scales {head: < 1} on a text backbone"),
        (["--model.optimizer.init_args.p0", "auto"], "p0: auto over its default grid"),
    ],
)
def test_a_combination_measured_to_lose_on_text_is_warned_in_one_line(flags, warned):
    with pytest.warns(UserWarning, match=warned.replace("{", r"\{").replace("(", r"\(")):
        build("text_quickstart", *flags)


@pytest.mark.parametrize("config", ["quickstart", "text_quickstart"])
def test_softmax_noise_is_warned_in_one_line_on_any_backbone(config):
    with pytest.warns(UserWarning, match=r"filter \{softmax_noise: true\}: measured to lose against the default"):
        build(config, "--model.optimizer.init_args.filter", "{name: covariance, softmax_noise: true}")


def test_the_text_default_is_not_warned(recwarn):
    build("text_quickstart")
    assert not [w for w in recwarn if "measured to lose" in str(w.message) or "too small for text" in str(w.message)]


@pytest.mark.parametrize(("config", "classes"), [("quickstart", 10), ("glyphs100_lite0", 100), ("text_quickstart", 5)])
def test_code_gets_the_same_default_as_loko_fit(config, classes):
    """``default_arguments(network)``: the learner's keyword arguments of the LoKO ``loko fit`` decides for it."""
    cli = build(config)
    decision, arguments = default_arguments(cli.model.network_factory)
    with torch.device("meta"):
        model = OnlineClassifier(cli.model.network_factory, **arguments)
    assert settings(cli) == settings(Namespace(model=model))
    assert decision.line == decide_line(config)


def decide_line(config):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        build(config)
    finally:
        logger.removeHandler(handler)
    return next(r.getMessage() for r in records if r.getMessage().startswith("LoKO"))


def test_a_flag_of_the_mixtures_options_changes_the_mixture_the_default_adds(caplog):
    """``--model.mixture.init_args.calibration=0`` with no mixture in the config: parsed after the decided presets, so
    the default's mixture is built with it (before, the first parse refused it: the mixture's head was missing); the
    rest of the mixture is the preset's, and a flag with its value apart works the same."""
    with caplog.at_level(logging.INFO):
        got = settings(build("quickstart", "--model.mixture.init_args.calibration=0"))
    assert got["mixture"]["calibration"] == 0 and got["mixture"]["share_past"] == 0.01
    assert got["mixture"]["nearest_mean"] is True  # the decision's own flag, before the user's
    (line,) = decided_line(caplog)
    assert "presets/loko_mixture_lda" in line
    apart = settings(build("quickstart", "--model.mixture.init_args.pools", "[1]"))
    assert apart["mixture"]["pools"] == [1.0] and apart["mixture"]["calibration"] == 300


def test_a_flag_of_the_mixtures_options_without_a_mixture_is_still_refused():
    """The paper's config pins its LoKO (nothing decided, no mixture): the mixture's flag is refused as before (the
    parser's error naming model.mixture and its missing head, then its exit)."""
    with pytest.raises(SystemExit):
        build("cifar10_resnet18", "--model.mixture.init_args.calibration=0")
