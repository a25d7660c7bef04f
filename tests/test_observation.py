"""The observation seam: a new observation or R estimator is one class or one registry entry plus its tests."""

import copy

import pytest
import torch
from loko_helpers import DenseModelFilter, flat_cov, loko_closure, mlp, teacher_stream
from torch.func import jacrev

from loko_lightning import JacobianEngine, LoKO, jacobian
from loko_lightning.errors import ConfigError
from loko_lightning.kalman import noise, reference
from loko_lightning.observation import Regression, Softmax, get_observation


class TemperedSoftmax(Softmax):
    """A toy observation written the way a contributor would add one: class probabilities at temperature 2."""

    name = "tempered"

    def predict(self, outputs):
        return torch.softmax(outputs / 2.0, dim=-1)


def test_a_new_observation_changes_the_jacobian_engine():
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(1, 5, dtype=torch.float64)
    params = list(model.parameters())
    prediction, jacobians = jacobian(model, x, observation=TemperedSoftmax())

    def observed(*values):
        state = dict(zip((n for n, _ in model.named_parameters()), values, strict=True))
        return torch.softmax(torch.func.functional_call(model, state, (x,))[0] / 2.0, -1)

    expected = jacrev(observed, argnums=tuple(range(len(params))))(*params)
    torch.testing.assert_close(prediction, observed(*params), rtol=0, atol=0)
    for got, want in zip(jacobians, expected, strict=True):
        # m - 1 reverse rows and the last as minus their sum (it sums to one): equal to float64 rounding.
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_new_observation_trains_like_the_float64_reference():
    observation = TemperedSoftmax()
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.3, seed=3, observation=observation, filter={"name": "covariance", "beta": 0.9})
    assert opt.observation is observation
    filt = DenseModelFilter(copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator="taylor",
                            output=observation)  # fmt: skip
    for x, y in teacher_stream(60):
        y_ref = filt.step(x, y)
        y_fast, _, _ = opt.step(loko_closure(model, x, y, observation=observation))
        # Same tolerance as the paper's observation against the reference (test_covariance_filter): float64 rounding.
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)


def test_a_new_r_estimator_is_one_entry_in_each_registry(monkeypatch):
    """A toy estimator, 2·I used as is, registered in the fast registry and (separately) in the reference."""
    monkeypatch.setitem(
        noise.R_ESTIMATORS,
        "twice",
        noise.NoiseEstimator(
            "twice",
            lambda e, hpht, y, k: 2 * torch.eye(e.shape[-1], dtype=hpht.dtype).expand(e.shape[0], -1, -1),
            False,
            "R = 2 I",
        ),  # fmt: skip
    )
    monkeypatch.setitem(
        reference.REFERENCE_R_ESTIMATORS, "twice", (lambda e, HPHt_b, y, k: 2 * torch.eye(e.shape[0]).double(), False)
    )
    monkeypatch.setattr(Softmax, "r_estimators", (*Softmax.r_estimators, "twice"))
    model = mlp()
    opt = LoKO(model.parameters(), p0=0.3, seed=3, filter={"name": "covariance", "beta": 0.9, "r_estimator": "twice"})
    filt = DenseModelFilter(copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator="twice")
    for x, y in teacher_stream(30):
        y_ref = filt.step(x, y)
        y_fast, _, _ = opt.step(loko_closure(model, x, y))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)


def test_an_r_estimator_the_observation_does_not_admit_is_refused():
    with pytest.raises(ConfigError, match="'softmax' does not apply to observation 'regression'") as err:
        LoKO(mlp().parameters(), observation="regression", filter={"name": "covariance", "r_estimator": "softmax"})
    assert err.value.field == "r_estimator"
    with pytest.raises(ConfigError, match="Invalid observation: 'logits'") as err:
        LoKO(mlp().parameters(), observation="logits")
    assert err.value.field == "observation"
    with pytest.raises(ConfigError, match="Invalid observation"):
        JacobianEngine(mlp(), observation="logits")


def test_every_registered_observation_admits_only_registered_estimators():
    for name in ("softmax", "regression"):
        assert set(get_observation(name).r_estimators) <= set(noise.R_ESTIMATORS)


def test_observe_forms_the_target_of_the_observation():
    torch.manual_seed(1)
    model = mlp()
    with JacobianEngine(model, factorize=True) as engine:
        x, label = torch.randn(1, 5, dtype=torch.float64), torch.tensor([2])
        prediction, target, jacobians = engine.observe(x, label)
        assert prediction.shape == (4,) and target.tolist() == [0.0, 0.0, 1.0, 0.0]
        single, _ = engine(x)
        torch.testing.assert_close(prediction, single, rtol=0, atol=0)
        xs, labels = torch.randn(3, 5, dtype=torch.float64), torch.tensor([0, 3, 1])
        predictions, targets, _ = engine.observe(xs, labels)
        assert predictions.shape == (3, 4) and targets.argmax(-1).tolist() == [0, 3, 1]
        one, target_one, blocks = engine.observe(x, label, batched=True)
        assert one.shape == (1, 4) and target_one.shape == (1, 4) and blocks[0].shape[0] == 1
    with JacobianEngine(model, observation=Regression()) as engine:
        values = torch.randn(1, 4, dtype=torch.float64)
        prediction, target, _ = engine.observe(x, values)
        torch.testing.assert_close(target, values[0], rtol=0, atol=0)
        with pytest.raises(ValueError, match="regression target must have the prediction's shape"):
            engine.observe(x, torch.tensor([2]))
