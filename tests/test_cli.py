"""The ``loko`` command end to end: the debug config on real offline data, a CIFAR-format folder through
torchvision's real loader, evaluation from a checkpoint, and an exact resume."""

import logging
from pathlib import Path

import pytest
import torch
from data_files import N_TRAIN
from runs import outputs, trainable

from loko_lightning import __version__
from loko_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")


@pytest.mark.slow
def test_debug_config_end_to_end(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    main(["fit", "--config", DEBUG, "--data.max_samples", "40", "--data.eval_max_samples", "40", *outputs(tmp_path)])
    log_dir = tmp_path / "run" / "version_0"
    metrics = (log_dir / "metrics.csv").read_text()
    assert "train/online_acc" in metrics and "val/acc" in metrics and "loko/p_mean" in metrics
    assert (log_dir / "online.png").stat().st_size > 1000
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    printed = caplog.text
    assert "Average online top-1 accuracy:" in printed and "over 40 samples" in printed
    assert str(log_dir / "metrics.csv") in printed
    assert "104,182 trainable parameters" in printed

    test_args = ["--data.eval_max_samples", "40", "--ckpt_path", str(last), *outputs(tmp_path, "eval")]
    main(["test", "--config", DEBUG, *test_args])
    assert "test/acc" in (tmp_path / "eval" / "version_0" / "metrics.csv").read_text()


CHEAP_LOFI = [
    "--model.optimizer.init_args.filter",
    "lofi10_empirical",
    "--model.optimizer.time_update",
    "{forgetting: 0.001}",
]


TOPK = ["--model.optimizer.init_args.observation", "topk5"]
NATURAL = ["--model.optimizer.init_args.filter", "natural", "--model.optimizer.init_args.p0", "0.03"]
LOFI = ["--model.optimizer.init_args.filter", "lofi10", "--model.optimizer.init_args.p0", "0.03"]


@pytest.mark.parametrize(
    ("flags", "filter", "extra"),
    [(TOPK, "topk5", []), (NATURAL, "natural", []), (LOFI, "lofi10", []), (LOFI, "lofi10_empirical", CHEAP_LOFI)],
    ids=["topk", "natural", "lofi", "lofi_empirical"],
)
def test_the_cheap_filters_and_observations_train_from_the_command_line(tmp_path, flags, filter, extra):
    """A random-weight timm test network on 12 glyphs100 samples (100 classes) with each cheap observation's flags
    (the keys of the retired presets; LoFi on the empirical Fisher with stabilised forgetting as more flags)."""
    network = ["--model.network.backbone", "test_resnet", "--model.network.weights", "null"]
    network += ["--model.network.pretrained", "false", "--model.network.num_classes", "100", "--model.window", "4"]
    data = ["--data.source", "Glyphs100", "--data.max_samples", "12", "--data.eval_max_samples", "4"]
    main(["fit", "--config", DEBUG, *flags, *network, *data, *outputs(tmp_path), *extra])
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert filter in (group["observation"], group["filter"]["name"])
    assert group["forgetting"] == (0.001 if extra else 0.0)
    assert checkpoint["global_step"] == 12


def test_version_and_help_describe_the_tool(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code in (0, None) and capsys.readouterr().out.strip() == f"loko {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "online fine-tuning of pretrained timm and transformers models with LoRA adapters" in out
    assert "Lightning Trainer command line tool" not in out


def test_version_from_a_source_tree_without_distribution_metadata(capsys, monkeypatch, tmp_path):
    """Run from a checkout on PYTHONPATH (no install, so no metadata), the command still starts and names the source
    tree's pyproject.toml version, or "unknown" without one; every `loko` command used to stop there on
    PackageNotFoundError."""
    import importlib.metadata

    import loko_lightning.cli.entry as entry

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(entry, "version", missing)
    tree = tmp_path / "checkout"
    (tree / "loko_lightning" / "cli").mkdir(parents=True)
    (tree / "pyproject.toml").write_text('[project]\nname = "loko-lightning"\nversion = "9.8.7"\n')
    for pyproject, expected in ((True, "9.8.7"), (False, "unknown")):
        if not pyproject:
            (tree / "pyproject.toml").unlink()
        monkeypatch.setattr(entry, "__file__", str(tree / "loko_lightning" / "cli" / "entry.py"))
        with pytest.raises(SystemExit) as exit_info:
            main(["--version"])
        assert exit_info.value.code in (0, None) and capsys.readouterr().out.strip() == f"loko {expected}"


def test_print_config_shows_the_resolved_configuration(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", DEBUG, "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "backbone: tf_efficientnet_lite0" in out
    assert "class_path: loko_lightning.data.MNIST5k" in out and "image_size: 32" in out
    assert "p0: 0.2" in out
    assert "class_path: loko_lightning.LoKO" in out
    assert "class_path: loko_lightning.models.TimmClassifier" in out


def test_cifar10_config_on_a_cifar_folder_through_torchvision(tmp_path, cifar10):
    config = str(ROOT / "configs" / "cifar10_resnet18.yaml")
    main(
        [
            "fit",
            "--config",
            config,
            "--model.network.pretrained",
            "false",
            "--data.source.root",
            str(cifar10),
            "--data.source.download",
            "false",
            "--data.source.image_size",
            "32",
            *outputs(tmp_path / "out"),
        ]
    )
    metrics = (tmp_path / "out" / "run" / "version_0" / "metrics.csv").read_text()
    assert "val/acc" in metrics
    # Every training image streamed once; the test images evaluated.
    ckpt = torch.load(tmp_path / "out" / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == N_TRAIN


def test_missing_data_is_one_line_error(tmp_path, capsys):
    config = str(ROOT / "configs" / "cifar10_resnet18.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                config,
                "--model.network.pretrained",
                "false",
                "--data.source.root",
                str(tmp_path / "nothing"),
                "--data.source.download",
                "false",
                *outputs(tmp_path),
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("loko: error: --data.")
    assert str(tmp_path / "nothing") in err[-1] and "download" in err[-1]


def trainable_state(path):
    ckpt = torch.load(path, weights_only=False)
    return ckpt, trainable(ckpt["state_dict"])


@pytest.mark.slow
def test_stopped_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path):
    """Stop after sample 20 of 30 (a mid-stream checkpoint at 10), resume from it: same parameters, filter state and
    online accuracy as one uninterrupted run, bit for bit on the CPU."""
    common = ["--config", DEBUG, "--data.max_samples", "30", "--data.eval_max_samples", "8"]
    main(["fit", *common, *outputs(tmp_path, "full", every=30)])
    main(["fit", *common, "--trainer.max_steps", "20", *outputs(tmp_path, "part", every=10, keep_all=True)])
    part = tmp_path / "part" / "checkpoints" / "epoch=0-step=10.ckpt"
    assert part.is_file()
    main(["fit", *common, "--ckpt_path", str(part), *outputs(tmp_path, "resumed", every=30)])

    full, full_params = trainable_state(tmp_path / "full" / "checkpoints" / "last.ckpt")
    resumed, resumed_params = trainable_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert full["global_step"] == resumed["global_step"] == 30
    assert full_params.keys() == resumed_params.keys() and full_params
    for key in full_params:
        assert torch.equal(full_params[key], resumed_params[key]), key
    for key in ("online_acc.mean_value", "online_acc.weight", "loss_avg.buffer", "loss_avg.count"):
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    full_opt, resumed_opt = full["optimizer_states"][0]["state"], resumed["optimizer_states"][0]["state"]
    for index in full_opt:
        for key, value in full_opt[index].items():
            assert torch.equal(value, resumed_opt[index][key]), (index, key)
