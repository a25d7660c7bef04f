"""The heads on frozen features (streaming LDA, nearest class mean, the frozen linear head): float64 references, the
prequential contract at the learner level, checkpoints, and their configuration errors."""

import copy
import gc
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch
from runs import assert_same_tensors, fit_full_and_resumed, loader, stream, trainable, trainer
from sklearn.covariance import oas

from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.learner.frozen_heads import output_layer
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier
from loko_lightning.peers import FrozenLinearHead, NearestClassMean, StreamingLDA
from loko_lightning.peers.frozen_heads import REFRESH

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
BASELINES = ROOT / "configs" / "baselines"
HEADS = ("streaming_lda", "ncm", "frozen_linear_head")


def labelled(n=120, d=6, m=3, seed=0):
    """``n`` float64 features in ``m`` Gaussian classes (the last class never drawn: an unseen class) and labels."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(m, d, generator=gen, dtype=torch.float64)
    labels = torch.randint(m - 1, (n,), generator=gen)
    mixing = torch.randn(d, d, generator=gen, dtype=torch.float64)
    return centres[labels] + torch.randn(n, d, generator=gen, dtype=torch.float64) @ mixing, labels


def reference_lda(x, y, m, shrinkage):
    """The batch float64 LDA of the samples ``x`` ``(N, d)``: class means (zero for an unseen class), the pooled
    within-class covariance, shrunk by scikit-learn's OAS or ``(1 − ε)Σ + εI``, and the closed-form head."""
    d = x.shape[1]
    means = torch.zeros(m, d, dtype=torch.float64)
    for k in range(m):
        if (y == k).any():
            means[k] = x[y == k].mean(0)
    residuals = (x - means[y]).numpy()
    covariance = torch.from_numpy(residuals.T @ residuals / len(x))
    if shrinkage == "oas" and not covariance.trace():  # no spread yet: the identity
        shrunk = torch.eye(d, dtype=torch.float64)
    elif shrinkage == "oas":
        shrunk = torch.from_numpy(oas(residuals, assume_centered=True)[0])
    else:
        shrunk = (1 - shrinkage) * covariance + shrinkage * torch.eye(d, dtype=torch.float64)
    precision = torch.linalg.inv(shrunk)
    weight = means @ precision
    return means, covariance, weight, -0.5 * (weight * means).sum(-1)


def fit(optimizer_class, x, y, m, batch=1, **kwargs):
    layer = torch.nn.Linear(x.shape[1], m).to(x.dtype)
    head = optimizer_class(layer.parameters(), **kwargs)
    head.bind(layer.weight, layer.bias)
    for start in range(0, len(x), batch):
        assert bool(head.step(lambda s=start: (x[s : s + batch], y[s : s + batch])))
    return layer, head


# ------------------------------------------------------------------ float64 references
@pytest.mark.parametrize("shrinkage", ["oas", 1e-2])
@pytest.mark.parametrize("batch", [1, 7])
def test_streaming_lda_equals_the_batch_computation_in_float64(shrinkage, batch):
    """After 120 samples (one at a time, or 7 a step) the running class means, the pooled covariance and the head
    written into a float64 layer equal the batch float64 computation with scikit-learn's OAS. Both are float64 sums of
    120 terms computed in other orders: a few ulps (2^-52) each, relative 1e-10 leaves a margin of ~10^4."""
    x, y = labelled()
    layer, lda = fit(StreamingLDA, x, y, 3, batch=batch, shrinkage=shrinkage)
    means, covariance, weight, bias = reference_lda(x, y, 3, shrinkage)
    state = lda.state[layer.weight]
    torch.testing.assert_close(state["mean"], means, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lda.covariance(state), covariance, rtol=1e-10, atol=1e-12)
    assert state["count"].tolist() == [float((y == k).sum()) for k in range(3)]
    torch.testing.assert_close(layer.weight.detach(), weight, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(layer.bias.detach(), bias, rtol=1e-9, atol=1e-12)
    assert not layer.weight[2].any() and layer.bias[2] == 0  # the unseen class: the paper's zero mean, logit 0


@pytest.mark.parametrize("shrinkage", ["oas", 1e-2])
def test_streaming_lda_solves_the_head_through_its_refreshes(shrinkage):
    """The head after each sample, before the first refresh of the eigenbasis, at it, between and after two, equals
    the batch float64 head of the samples so far (the eigendecomposition and the Woodbury correction are exact
    algebra: float64 rounding only, as in the test above)."""
    x, y = labelled(n=2 * REFRESH + 40, d=24, m=4)
    layer = torch.nn.Linear(24, 4).double()
    lda = StreamingLDA(layer.parameters(), shrinkage=shrinkage)
    lda.bind(layer.weight, layer.bias)
    checks = {1, 2, REFRESH - 1, REFRESH, REFRESH + 5, REFRESH + 6, 2 * REFRESH + 7, len(x)}
    for n in range(1, len(x) + 1):
        assert bool(lda.step(lambda n=n: (x[n - 1 : n], y[n - 1 : n])))
        if n in checks:
            _, _, weight, bias = reference_lda(x[:n], y[:n], 4, shrinkage)
            torch.testing.assert_close(layer.weight.detach(), weight, rtol=1e-9, atol=1e-12, msg=f"after {n}")
            torch.testing.assert_close(layer.bias.detach(), bias, rtol=1e-9, atol=1e-12, msg=f"after {n}")
    assert lda.state[layer.weight]["recent"].shape[0] < REFRESH  # the rows since the last refresh, folded at REFRESH


def test_streaming_lda_resumed_between_refreshes_writes_the_same_heads():
    """A checkpoint between two refreshes (the eigenbasis is not in it: rebuilt from the saved scatter) continues
    with the same heads, bit for bit: every vector is rotated by the same product either way."""
    x, y = labelled(n=REFRESH + 50, d=24, m=4)
    whole, lda = fit(StreamingLDA, x[: REFRESH + 20], y[: REFRESH + 20], 4)
    saved = lda.state_dict()
    layer = torch.nn.Linear(24, 4).double()
    resumed = StreamingLDA(layer.parameters())
    resumed.bind(layer.weight, layer.bias)
    resumed.load_state_dict(saved)
    for n in range(REFRESH + 20, len(x)):
        lda.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
        resumed.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
        assert torch.equal(layer.weight, whole.weight) and torch.equal(layer.bias, whole.bias), n


def deferred_lda(d, m, **kwargs):
    layer = torch.nn.Linear(d, m).double()
    lda = StreamingLDA(layer.parameters(), **kwargs)
    lda.bind(layer.weight, layer.bias)
    lda.defer()
    return layer, lda


@pytest.mark.parametrize("shrinkage", ["oas", 1e-2])
def test_a_deferred_streaming_lda_scores_the_batch_head_and_writes_it_only_when_asked(shrinkage):
    """Deferred (the mixture's LDA), the head is never multiplied out in a step: its layer keeps its initial weights,
    and its logits of the next samples, scored in the eigenbasis, equal those of the batch float64 head before,
    at and after refreshes; :meth:`write` puts that head into the layer. Both are float64 computations of the same
    algebra in other orders (as in the test above): each logit within 1e-9 of the magnitudes it sums,
    ``Σ_j |W_kj z_j| + |b_k|``."""
    x, y = labelled(n=2 * REFRESH + 40, d=24, m=4)
    layer, lda = deferred_lda(24, 4, shrinkage=shrinkage)
    initial = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert lda.current() is None
    torch.testing.assert_close(lda.logits(x[:3]), torch.nn.functional.linear(x[:3], *initial), rtol=0, atol=0)
    checks = {1, 2, REFRESH - 1, REFRESH, REFRESH + 5, 2 * REFRESH + 7, len(x) - 3}
    for n in range(1, len(x) - 2):
        assert bool(lda.step(lambda n=n: (x[n - 1 : n], y[n - 1 : n])))
        if n in checks:
            _, _, weight, bias = reference_lda(x[:n], y[:n], 4, shrinkage)
            probe = x[n : n + 3]
            error = (lda.logits(probe) - (probe @ weight.T + bias)).abs()
            assert bool((error <= 1e-9 * (probe.abs() @ weight.abs().T + bias.abs())).all()), n
            assert torch.equal(layer.weight, initial[0]) and torch.equal(layer.bias, initial[1]), n
    lda.write()
    _, _, weight, bias = reference_lda(x[: len(x) - 3], y[: len(x) - 3], 4, shrinkage)
    torch.testing.assert_close(layer.weight.detach(), weight, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(layer.bias.detach(), bias, rtol=1e-9, atol=1e-12)


def test_a_deferred_streaming_lda_resumed_or_followed_scores_the_same_logits_bit_for_bit():
    """Loaded between two refreshes, a deferred LDA computes its head from the loaded statistics alone and scores
    every next sample as the one that went on, bit for bit (the same products: see the resumed test above), through
    the next refresh; a follower scores as the LDA it followed did then, and keeps that head while the other learns
    on."""
    x, y = labelled(n=2 * REFRESH + 10, d=24, m=4)
    _, lda = deferred_lda(24, 4)
    for n in range(REFRESH + 20):
        lda.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
    _, resumed = deferred_lda(24, 4)
    resumed.step(lambda: (x[-1:], y[-1:]))  # a head of its own before the load, which the load replaces
    resumed.load_state_dict(copy.deepcopy(lda.state_dict()))
    _, follower = deferred_lda(24, 4)
    follower.follow(lda)
    followed = lda.logits(x[REFRESH + 20 :])
    assert torch.equal(follower.logits(x[REFRESH + 20 :]), followed)
    for n in range(REFRESH + 20, len(x)):
        assert torch.equal(resumed.logits(x[n : n + 1]), lda.logits(x[n : n + 1])), n
        lda.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
        resumed.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
    assert torch.equal(follower.logits(x[REFRESH + 20 :]), followed)
    assert not torch.equal(lda.logits(x[REFRESH + 20 :]), followed)  # it learned on (the test can fail)


def test_a_deferred_streaming_lda_keeps_its_rotated_vectors_and_rotates_afresh_in_another_basis():
    """Deferred, the class means and rows in the eigenbasis are kept in the state, updated from each sample's
    ``Vᵀ z``: they equal the fresh rotations of the raw ones within float64 rounding (relative 1e-9, as above). A state
    whose basis check is not the loading machine's (its eigendecomposition gave another ``V``: another machine's, here
    a changed check) is rotated afresh: the next logits equal the uninterrupted LDA's within the same rounding."""
    x, y = labelled(n=REFRESH + 40, d=24, m=4)
    _, lda = deferred_lda(24, 4)
    for n in range(REFRESH + 20):
        lda.logits(x[n : n + 1])
        lda.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
    state = lda.state[next(iter(lda.state))]
    vectors = lda.eigenbasis(state).vectors
    torch.testing.assert_close(state["rotated_mean"], state["mean"] @ vectors, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(state["rotated_recent"], state["recent"] @ vectors, rtol=1e-9, atol=1e-12)
    assert state["rotated_recent"].shape[0] == state["recent"].shape[0] > 0
    saved = copy.deepcopy(lda.state_dict())
    saved["state"][0]["basis_check"] += 1
    saved["state"][0]["rotated_mean"].zero_()  # would be read as it is, were the check the loading machine's
    _, elsewhere = deferred_lda(24, 4)
    elsewhere.load_state_dict(saved)
    probe = x[REFRESH + 20 :]
    ours, theirs = elsewhere.logits(probe), lda.logits(probe)
    _, _, weight, bias = reference_lda(x[: REFRESH + 20], y[: REFRESH + 20], 4, "oas")
    assert bool(((ours - theirs).abs() <= 1e-9 * (probe.abs() @ weight.abs().T + bias.abs())).all())


def test_a_deferred_streaming_lda_lets_the_old_basis_go_at_a_refresh():
    """A refresh's eigenbasis ``V`` (``d²`` floats: 13 MB at d = 1,280) is freed once the next refresh replaces it:
    the last sample scored, whose ``Vᵀ z`` its update reuses, keeps no reference to it after that update."""
    x, y = labelled(n=REFRESH + 60, d=24, m=4)
    _, lda = deferred_lda(24, 4)
    old = None
    for n in range(len(x)):
        lda.logits(x[n : n + 1])
        lda.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
        basis = lda.current().basis
        if old is not None and old() is not basis:
            break
        old = None if basis is None else weakref.ref(basis)
    else:
        pytest.fail("no refresh in the stream")
    del basis
    gc.collect()
    assert old() is None


def test_streaming_lda_loads_a_state_saved_before_the_recent_rows_were_kept():
    """A state whose scatter is all of S (no ``"recent"`` rows: saved before they were kept) loads, and the heads
    after the next samples equal those of the state that kept its rows (the same S: float64 rounding only, as in the
    tests above)."""
    x, y = labelled(n=REFRESH + 30, d=24, m=4)
    whole, lda = fit(StreamingLDA, x[: REFRESH + 20], y[: REFRESH + 20], 4)
    saved = copy.deepcopy(lda.state_dict())  # torch's state_dict shares the live state's dicts
    old = saved["state"][0]
    old["scatter"] = old["scatter"] + old["recent"].T @ old["recent"]  # the rows folded, as a state of before
    del old["recent"]
    layer = torch.nn.Linear(24, 4).double()
    resumed = StreamingLDA(layer.parameters())
    resumed.bind(layer.weight, layer.bias)
    resumed.load_state_dict(saved)
    assert resumed.state[layer.weight]["recent"].shape == (0, 24)
    for n in range(REFRESH + 20, len(x)):
        lda.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
        resumed.step(lambda n=n: (x[n : n + 1], y[n : n + 1]))
        torch.testing.assert_close(layer.weight, whole.weight, rtol=1e-9, atol=1e-12, msg=f"after {n}")
        torch.testing.assert_close(layer.bias, whole.bias, rtol=1e-9, atol=1e-12, msg=f"after {n}")


def test_streaming_lda_predicts_the_gaussian_posterior():
    """Its softmax is the posterior of a Gaussian class model with the shrunk covariance and equal priors:
    log N(z; μ_k, Σ_s) up to a constant in k (float64; the same float64 rounding argument as above)."""
    x, y = labelled(n=60)
    layer, lda = fit(StreamingLDA, x[:50], y[:50], 2, shrinkage=0.1)
    state = lda.state[layer.weight]
    covariance = 0.9 * lda.covariance(state) + 0.1 * torch.eye(6, dtype=torch.float64)
    gaussians = [torch.distributions.MultivariateNormal(state["mean"][k], covariance) for k in range(2)]
    log_density = torch.stack([g.log_prob(x[50:]) for g in gaussians], -1)
    torch.testing.assert_close(layer(x[50:]).softmax(-1), log_density.softmax(-1), rtol=1e-9, atol=1e-12)


def test_nearest_class_mean_predicts_the_nearest_mean():
    """Its means are the batch means (float64, as above) and its argmax is the nearest mean in Euclidean distance."""
    x, y = labelled(n=80)
    layer, ncm = fit(NearestClassMean, x[:60], y[:60], 3)
    means = reference_lda(x[:60], y[:60], 3, "oas")[0]
    torch.testing.assert_close(ncm.state[layer.weight]["mean"], means, rtol=1e-10, atol=1e-12)
    seen = means[:2]  # the unseen class's zero mean has logit 0: compare among the seen classes
    nearest = torch.cdist(x[60:], seen).argmin(-1)
    assert torch.equal(layer(x[60:])[:, :2].argmax(-1), nearest)


def test_the_statistics_resume_in_float64():
    """torch casts an optimizer's state to its parameter's dtype on loading; the statistics stay float64, exactly."""
    x, y = labelled(n=20)
    layer, lda = fit(StreamingLDA, x.float(), y, 3)
    fresh = StreamingLDA(layer.parameters())
    fresh.load_state_dict(lda.state_dict())
    assert_same_tensors(dict(lda.state[layer.weight]), dict(fresh.state[layer.weight]), "state")


def test_non_finite_features_change_nothing():
    x, y = labelled(n=10)
    layer, lda = fit(StreamingLDA, x, y, 3)
    before = {k: v.clone() for k, v in lda.state[layer.weight].items()}
    weight = layer.weight.detach().clone()
    bad = x[:1].clone()
    bad[0, 2] = float("nan")
    assert not bool(lda.step(lambda: (bad, y[:1])))
    assert_same_tensors(before, dict(lda.state[layer.weight]), "state")
    assert torch.equal(layer.weight, weight)


# ------------------------------------------------------------------ the learner
def learner(optimizer, num_classes=3):
    factory = TimmClassifier("test_resnet", num_classes=num_classes, pretrained=False, r=2)
    return OnlineClassifier(factory, optimizer)


def scored(module, monkeypatch):
    """The predictions the learner scores, in order, and the trained learner."""
    predictions = []
    log_online = module._log_online
    monkeypatch.setattr(
        module, "_log_online", lambda p, *args: (predictions.append(p.detach().double()), log_online(p, *args))
    )
    return predictions


def frozen_features(module, items):
    """The features the network's output layer reads, for every sample, in float64 (network in eval mode)."""
    captured = []
    layer = output_layer(module.network, module.num_classes)
    hook = layer.register_forward_hook(lambda _, args, __: captured.append(args[0].detach().double()))
    module.network.eval()
    with torch.no_grad():
        for item in items:
            module.network(item["inputs"][None])
    hook.remove()
    module.network.train()
    return torch.cat(captured)


def test_the_learner_scores_streaming_lda_before_its_update(monkeypatch, one_thread):
    """Through trainer.fit: the prediction scored for sample i is the float64 LDA of samples 0..i-1 (never i itself),
    and the adapters never move. The learner's logits are float32 (features, head weights cast from float64, a
    d = 64 sum): relative rounding about d 2^-24 = 4e-6 of the largest term; probabilities within 1e-4 hold that with
    a margin, while predicting with sample i included differs by far more (asserted: the test can fail)."""
    items = stream(16, num_classes=3, seed=1)
    module = learner(partial(StreamingLDA, shrinkage=0.1))
    adapters = {n: p.detach().clone() for n, p in module.network.named_parameters() if "lora_" in n}
    features = frozen_features(module, items)
    labels = torch.stack([item["label"] for item in items])
    predictions = scored(module, monkeypatch)
    trainer().fit(module, loader(items))
    assert len(predictions) == 16
    lookahead_gap = 0.0
    torch.testing.assert_close(predictions[0][0], torch.full((3,), 1 / 3, dtype=torch.float64))  # zero head
    for i, prediction in enumerate(predictions[1:], start=1):
        _, _, weight, bias = reference_lda(features[:i], labels[:i], 3, 0.1)
        expected = (features[i] @ weight.T + bias).softmax(-1)
        torch.testing.assert_close(prediction[0], expected, rtol=0, atol=1e-4)
        _, _, weight, bias = reference_lda(features[: i + 1], labels[: i + 1], 3, 0.1)
        lookahead_gap = max(
            lookahead_gap, float((prediction[0] - (features[i] @ weight.T + bias).softmax(-1)).abs().max())
        )
    assert lookahead_gap > 1e-2
    for name, param in module.network.named_parameters():
        if name in adapters:
            assert torch.equal(param, adapters[name]), name


def test_the_frozen_linear_head_trains_the_output_layer_alone(monkeypatch, one_thread):
    """AdamW on the output layer's gradient: the head moves, the adapters do not; the prediction scored for each sample
    is the network's output before that sample's step."""
    items = stream(6, num_classes=3, seed=2)
    module = learner(partial(FrozenLinearHead, lr=0.05))
    layer = output_layer(module.network, 3)
    adapters = {n: p.detach().clone() for n, p in module.network.named_parameters() if "lora_" in n}
    features = frozen_features(module, items)
    heads = []

    def forward(self, x):  # the head each prediction is made with
        heads.append((self.weight.detach().clone(), self.bias.detach().clone()))
        return torch.nn.functional.linear(x, self.weight, self.bias)

    monkeypatch.setattr(type(layer), "forward", forward)
    predictions = scored(module, monkeypatch)
    trainer().fit(module, loader(items))
    assert len(predictions) == 6
    for i, prediction in enumerate(predictions):
        weight, bias = (t.double() for t in heads[i])
        torch.testing.assert_close(prediction[0], (features[i] @ weight.T + bias).softmax(-1), rtol=0, atol=1e-5)
    assert layer.weight.abs().sum() > 0
    for name, param in module.network.named_parameters():
        if name in adapters:
            assert torch.equal(param, adapters[name]), name


# ------------------------------------------------------------------ through loko fit
@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_each_frozen_head_fits_the_debug_config_and_resumes_exactly(head, tmp_path, one_thread):
    """24 real MNIST digits through EfficientNet-Lite0; stopped after 12 with a checkpoint at 6 and resumed: the same
    head, statistics and online metrics as one uninterrupted run, bit for bit on the CPU."""
    common = ["--config", DEBUG, "--config", str(BASELINES / f"{head}.yaml")]
    common += ["--data.max_samples", "24", "--data.eval_max_samples", "8"]
    if head == "frozen_linear_head":
        common += ["--model.select.samples", "8"]
    full, resumed = fit_full_and_resumed(tmp_path, common)
    assert full["global_step"] == resumed["global_step"] == 24
    weights = trainable(full["state_dict"])
    head_weights = [key for key in weights if "modules_to_save" in key]
    assert head_weights and all(full["state_dict"][key].abs().sum() > 0 for key in head_weights)
    for key in full["state_dict"]:
        if key in weights or key.startswith(("online_acc", "nll", "ece")):
            assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
    assert_same_tensors(full["optimizer_states"], resumed["optimizer_states"], "optimizer_states")


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("shrinkage", [0.0, 1.5, "ledoit", float("nan"), True])
def test_a_bad_shrinkage_names_the_field_and_the_fix(shrinkage):
    with pytest.raises(ConfigError) as info:
        StreamingLDA([torch.nn.Parameter(torch.zeros(2))], shrinkage=shrinkage)
    assert info.value.field == "shrinkage" and "'oas'" in str(info.value)


def test_a_schedule_for_a_closed_form_head_is_one_line(capsys):
    args = ["fit", "--config", DEBUG, "--config", str(BASELINES / "streaming_lda.yaml"), "--data.max_samples", "4"]
    args += ["--model.lr_scheduler", "torch.optim.lr_scheduler.ConstantLR"]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "lr_scheduler" in error[0] and "no learning rate" in error[0]


def test_the_output_layer_must_be_among_the_optimizers_parameters():
    layer = torch.nn.Linear(3, 2)
    lda = StreamingLDA([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError) as info:
        lda.bind(layer.weight, layer.bias)
    assert info.value.field == "optimizer"


# ------------------------------------------------------------------ benchmarks/compare.py
def test_compare_runs_the_frozen_heads_beside_adamw(tmp_path, monkeypatch, one_thread):
    """The three heads and AdamW on the same 12 samples (a random-weight timm test network): every step recorded, the
    closed-form heads' step time in the table, the linear head's rate chosen on the first 4."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import compare

    heads = ["adamw", *HEADS]
    network = ["--model.network.backbone", "test_resnet", "--model.network.pretrained", "false"]
    network += ["--model.network.weights", "null", "--model.window", "4"]
    args = ["--config", DEBUG, "--samples", "12", "--threads", "1", "--seeds", "0", "--warmup", "2"]
    args += ["--select-samples", "4", "--optimizers", *heads, "--out", str(tmp_path), "--", *network]
    summary = compare.main(args)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    for head in heads:
        assert sum(row.startswith(f"{head},") for row in rows) == 12, head
        assert compare.LABELS[head] in (tmp_path / "results.md").read_text()
    assert summary["frozen_linear_head"]["selection"][0].startswith("chose")
