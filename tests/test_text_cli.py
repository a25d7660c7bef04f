"""The text path through the real ``loko`` command: the text quick-start config on a tiny local CSV and a tiny local
BERT, an exact resume in the middle of the second epoch, and one-line errors for bad text input."""

import logging
from pathlib import Path

import pytest
import torch
from runs import outputs, trainable
from text_helpers import sentiment_rows, tiny_bert_dir, write_text_file

from loko_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
TEXT = str(ROOT / "configs" / "text_quickstart.yaml")
DEBUG = str(ROOT / "configs" / "debug.yaml")


# Tiny models: more intra-op threads only add synchronisation (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A tiny random BERT with MiniLM's tokenizer in a directory, and a 40-row CSV of a separable sentiment task."""
    root = tmp_path_factory.mktemp("text")
    return tiny_bert_dir(root / "model"), write_text_file(root / "reviews.csv", sentiment_rows(40))


def text_args(local, *extra):
    model, data = local
    return [
        "--config", TEXT, "--model.network.backbone", str(model), "--model.network.weights", "null",
        "--data.source", "TextFile", "--data.source.root", str(data), "--data.source.max_length", "16",
        "--data.max_samples", "null", "--data.eval_max_samples", "null", *extra,
    ]  # fmt: skip


def test_text_quickstart_config_end_to_end_on_a_local_csv(local, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    main(["fit", *text_args(local, "--model.held_out_metrics", "[mcc, f1]"), *outputs(tmp_path)])
    log_dir = tmp_path / "run" / "version_0"
    metrics = (log_dir / "metrics.csv").read_text()
    for key in ("train/online_acc", "train/ce_avg1000", "loko/p_mean", "val/acc", "val/mcc", "val/f1"):
        assert key in metrics, key
    assert (log_dir / "online.png").stat().st_size > 1000
    printed = caplog.text
    assert "Average online top-1 accuracy:" in printed and "over 36 samples" in printed  # 40 rows, 4 held out
    assert "Moving-average cross-entropy over the last 36 samples" in printed
    assert "textfile: label ids {0: 'fresh', 1: 'rotten'}" in printed
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 36
    assert ckpt["datamodule_hyper_parameters"]["preprocessing"].tokenizer == str(local[0])  # the network's tokenizer


@pytest.mark.slow
def test_resumed_in_the_second_epoch_ends_like_an_uninterrupted_run(local, tmp_path):
    """Two epochs of 36 samples; stop after 50 (a checkpoint at 45, mid-epoch 2), resume: bit for bit the same."""
    common = text_args(local, "--data.epochs", "2")
    main(["fit", *common, *outputs(tmp_path, "full", every=72, plot=False)])
    main(["fit", *common, "--trainer.max_steps", "50", *outputs(tmp_path, "part", every=45, keep_all=True, plot=False)])
    part = tmp_path / "part" / "checkpoints" / "epoch=0-step=45.ckpt"
    assert part.is_file()
    main(["fit", *common, "--ckpt_path", str(part), *outputs(tmp_path, "resumed", every=72, plot=False)])
    full = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert full["global_step"] == resumed["global_step"] == 72
    full_params, resumed_params = trainable(full["state_dict"]), trainable(resumed["state_dict"])
    assert full_params.keys() == resumed_params.keys() and full_params
    for key in full_params:
        assert torch.equal(full_params[key], resumed_params[key]), key
    for key in ("online_acc.mean_value", "online_acc.weight", "ce_avg.buffer", "ce_avg.count"):
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    full_opt, resumed_opt = full["optimizer_states"][0]["state"], resumed["optimizer_states"][0]["state"]
    for index in full_opt:
        for key, value in full_opt[index].items():
            assert torch.equal(value, resumed_opt[index][key]), (index, key)


def one_line_error(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("loko: error: "), lines
    return lines[-1]


def test_bad_text_input_is_one_line_naming_the_flag(local, tmp_path, capsys):
    out = outputs(tmp_path)
    line = one_line_error(capsys, [*text_args(local), "--model.network.backbone", "no-such-org/no-such-model", *out])
    assert line.startswith("loko: error: --model.network.backbone: could not load the config of 'no-such-org/")
    assert "Without internet" in line
    line = one_line_error(capsys, [*text_args(local), "--data.source.text_column", "review", *out])
    assert line.startswith("loko: error: --data.source.text_column: ") and "no column 'review'" in line
    line = one_line_error(capsys, [*text_args(local), "--data.source.max_length", "0", *out])
    assert line.startswith("loko: error: --data.source.max_length: max_length must be a positive")
    line = one_line_error(capsys, [*text_args(local), "--data.source.image_size", "32", *out])
    assert line.startswith("loko: error: --data.source.image_size is not an option of loko_lightning.data.TextFile")
    line = one_line_error(capsys, [*text_args(local), "--data.source", "TextFil", *out])
    assert line.startswith("loko: error: --data.source: 'TextFil' is not a known Source. To fix it: did you mean")
    three = write_text_file(tmp_path / "three.csv", [(f"text {i}", i % 3) for i in range(12)])
    too_small = ["--data.source.root", str(three), "--model.network.num_classes", "2"]  # a 2-class head, label 2
    line = one_line_error(capsys, [*text_args(local), *too_small, *out])
    assert line.startswith("loko: error: --model.network.num_classes: ") and "has label 2" in line


def test_image_config_on_text_data_and_the_reverse(local, tmp_path, capsys):
    line = one_line_error(capsys, ["--config", DEBUG, "--data.source", "TextFile", "--data.source.root",
                                   str(local[1]), *outputs(tmp_path)])  # fmt: skip
    assert line.startswith("loko: error: --data.source: TextFile holds text samples but model.network")
    assert "TransformersClassifier" in line
    line = one_line_error(capsys, [*text_args(local), "--data.source", "MNIST5k", *outputs(tmp_path)])
    assert line.startswith("loko: error: --data.source: MNIST5k holds image samples")


def test_text_fit_predict_export_reload_in_plain_transformers(local, tmp_path, capsys):
    """Through the real CLI: fit on the CSV, predict texts (and a .txt file), export both ways, reload in transformers
    with the learner's predictions; an image given to this text model and a checkpoint for another modality refused."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from loko_lightning.learner.module import OnlineClassifier

    two = ["--model.network.num_classes", "2"]
    main(["fit", *text_args(local, *two), *outputs(tmp_path, plot=False)])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    (tmp_path / "more.txt").write_text("a wonderful film\n\nthe worst film\n")
    texts = f'["a great film", "{tmp_path / "more.txt"}"]'
    out = tmp_path / "texts.json"
    main(
        [
            "predict",
            *text_args(local, "--data.predict_inputs", texts),
            "--ckpt_path",
            str(ckpt),
            "--predictions",
            str(out),
        ]
    )
    rows = __import__("json").loads(out.read_text())
    assert [row["input"] for row in rows] == ["a great film", "a wonderful film", "the worst film"]
    assert {row["predicted"] for row in rows} <= {"fresh", "rotten"}

    learner = OnlineClassifier.load_from_checkpoint(ckpt, weights_only=True).eval()
    assert learner.class_names == ["fresh", "rotten"] and learner.preprocessing["max_length"] == 16
    tokenizer = AutoTokenizer.from_pretrained(str(local[0]))
    inputs = dict(tokenizer(["a great film", "the worst film"], padding=True, return_tensors="pt"))
    with torch.no_grad():
        want = learner(inputs)
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "adapter")])
    base = AutoModelForSequenceClassification.from_pretrained(str(local[0]), num_labels=2)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(**inputs).logits
    # Eager attention in the learner (for its Jacobian), transformers' default kernel here: float32 rounding.
    torch.testing.assert_close(got, want)
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"])
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.id2label == {0: "fresh", 1: "rotten"}
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, want)  # merged weights rounded to float32 once each

    image = tmp_path / "photo.png"
    __import__("PIL.Image").Image.new("RGB", (8, 8)).save(image)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["predict", *text_args(local, "--data.predict_inputs", f"[{image}]"), "--ckpt_path", str(ckpt)])
    assert "is an image file, but this is a text model" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the checkpoint's text network with an image dataset
        main(["predict", "--config", DEBUG, "--ckpt_path", str(ckpt)])
    assert "holds image samples but model.network is TransformersClassifier" in capsys.readouterr().err


LONG = " ".join(["a wonderful film with a great cast but the worst ending of the year"] * 3)


def test_text_predict_and_export_keep_the_training_max_length(local, tmp_path, capsys, monkeypatch):
    """Trained at 16 tokens: predict truncates there whatever the configuration says, a flag saying otherwise is
    refused, and the merged export's pipeline (tokenizer model_max_length 16) gives the learner's probabilities."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from loko_lightning.learner.module import OnlineClassifier

    monkeypatch.chdir(tmp_path)
    two = ["--model.network.num_classes", "2"]
    main(["fit", *text_args(local, *two), *outputs(tmp_path, plot=False)])
    ckpt = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    args = text_args(local, "--data.predict_inputs", f'["{LONG}"]')
    at = args.index("--data.source.max_length")
    unset = args[:at] + args[at + 2 :]  # TextFile's own default, 128 tokens

    def predict(arguments, name):
        main(["predict", *arguments, "--ckpt_path", ckpt, "--predictions", str(tmp_path / name)])
        return [row["probabilities"] for row in json.loads((tmp_path / name).read_text())]

    trained = predict(args, "trained.json")
    assert predict(unset, "unset.json") == trained  # the checkpoint's 16 tokens, not the source's default 128
    assert predict([*unset, "--preprocessing_from", "config"], "config.json") != trained
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["predict", *unset, "--data.source.max_length", "32", "--ckpt_path", ckpt])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("loko: error: --data.source.max_length: this flag asks for max_length 32, but the "
                          "checkpoint was trained with max_length 16")  # fmt: skip

    # The merged export in a stock pipeline, offline, in a fresh interpreter, as loko export printed it.
    main(["export", "--ckpt_path", ckpt, "--out", "merged", "--merge"])
    code = "\n".join(capsys.readouterr().out.splitlines()[1:])
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").model_max_length == 16
    check = f"import json\nscores = classify([{LONG!r}])[0]\n"
    check += "print(json.dumps({r['label']: r['score'] for r in scores}))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code + "\n" + check], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    learner = OnlineClassifier.load_from_checkpoint(ckpt, weights_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(local[0]))
    with torch.no_grad():
        want = learner(dict(tokenizer([LONG], truncation=True, max_length=16, return_tensors="pt")))[0].softmax(-1)
    # Eager attention in the learner (for its Jacobian), the pipeline's default kernel: float32 rounding.
    torch.testing.assert_close(torch.tensor([got["fresh"], got["rotten"]]), want)


def hf_args(local, root, *extra):
    """The text quick start on a local CSV read by the Hugging Face csv builder, streamed (HFStream)."""
    model, _ = local
    return [
        "--config", TEXT, "--model.network.backbone", str(model), "--model.network.weights", "null",
        "--data.source", "HFStream", "--data.source.path", "csv", "--data.source.root", str(root),
        "--data.source.max_length", "16", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip


def error_of(capsys, args):
    """Run ``loko args``: exit status 2 and its one ``loko: error:`` line."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_streamed_csv_errors_name_real_flags(local, tmp_path, capsys, monkeypatch):
    """An empty file, a label beyond the head, nothing to predict, a mistyped text file: one line naming a real flag."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.csv").write_text("")
    err = error_of(capsys, ["fit", *hf_args(local, tmp_path / "empty.csv", "--data.max_samples", "4")])
    assert err.startswith("loko: error: --data.source.root: dataset='hf:csv':") and "is empty (no header row" in err
    rows = tmp_path / "rows.csv"
    write_text_file(rows, [(f"text number {i}", i % 7) for i in range(12)])
    err = error_of(capsys, ["fit", *hf_args(local, rows, "--data.max_samples", "8",
                                                  "--model.network.num_classes", "5")])  # fmt: skip
    assert err.startswith("loko: error: --model.network.num_classes: dataset='hf:csv': the train split has label 5")
    predict = ["predict", *hf_args(local, rows, "--data.max_samples", "8", "--model.network.num_classes", "7")]
    err = error_of(capsys, [*predict, "--data.eval_max_samples", "0", "--predictions", str(tmp_path / "p.csv")])
    assert err.startswith("loko: error: --data.predict_inputs: nothing to predict")
    assert not (tmp_path / "p.csv").exists()
    err = error_of(capsys, [*predict, "--data.predict_inputs", "[nosuch.txt]"])
    assert err.startswith("loko: error: --data.predict_inputs: no text file at 'nosuch.txt'")
