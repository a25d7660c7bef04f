"""The diagonal natural-gradient filter (information form) against its float64 definition."""

import copy

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, flat, jacrev_rows, mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import DiagonalInformation, FisherRows, get_filter
from loko_lightning.kalman.reference import natural_step_reference
from loko_lightning.kalman.time_update import TimeUpdate


def _run(
    model, stream, fisher, factorize, p0_init="uniform", process_noise=0.0, batch=1, p_floor=0.0, shrinkage=0.0,
    inflation=0.0, forgetting=0.0,
):  # fmt: skip
    """Train ``model`` with the fast path and a copy with the reference, step by step; compare after every step."""
    reference_model = copy.deepcopy(model)
    time_update = dict(process_noise=process_noise, p_floor=p_floor, shrinkage=shrinkage, inflation=inflation,
                       forgetting=forgetting)  # fmt: skip
    opt = LoKO(model.parameters(), p0=0.5, p0_init=p0_init, seed=4, filter=DiagonalInformation(fisher),
               time_update=time_update)  # fmt: skip
    theta, p = flat(model.parameters()).detach().clone(), flat(opt.state[q]["cov"] for q in model.parameters())
    engine = JacobianEngine(model, observation=opt.observation, factorize=factorize)
    twin = FisherRows(fisher, seed=4)  # the sampled Fisher's labels: the optimizer's generator, drawn alike
    samples = list(stream)
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        x = torch.cat([s[0] for s in chunk])
        label = torch.stack([s[1].argmax() for s in chunk])
        jz, y_hat = zip(*(jacrev_rows(reference_model, s[0], probabilities=False) for s in chunk), strict=True)
        targets = torch.stack([s[1] for s in chunk])
        time_update = TimeUpdate(process_noise, p_floor, shrinkage, inflation, forgetting, reference=0.5)
        sampled = twin.draw(torch.stack(y_hat) if batch > 1 else y_hat[0]) if fisher == "sampled" else None
        theta, p = natural_step_reference(theta, p, torch.stack(jz), torch.stack(y_hat), targets, fisher=fisher,
                                          sampled=sampled, time_update=time_update)  # fmt: skip
        torch.nn.utils.vector_to_parameters(theta, reference_model.parameters())
        prediction, target, jacobians = engine.observe(x, label, batched=batch > 1)
        opt.step(lambda prediction=prediction, target=target, jacobians=jacobians: (prediction, target, jacobians))
        assert bool(opt.diagnostics["applied"])
        # float64 throughout; the fast path pulls e back from the logits (J_zᵀ e) where the reference forms
        # Hᵀ R⁺ e with an eigendecomposition of the singular R: equal up to the pseudo-inverse's float64 rounding.
        torch.testing.assert_close(flat(model.parameters()).detach(), theta, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(flat(opt.state[q]["cov"] for q in model.parameters()), p, rtol=1e-9, atol=1e-12)
    return opt


@pytest.mark.parametrize("fisher", ["empirical", "exact", "sampled"])
def test_natural_gradient_matches_the_float64_reference_on_dense_blocks(fisher):
    _run(mlp(), teacher_stream(40), fisher, factorize=False)


@pytest.mark.parametrize("fisher", ["empirical", "exact", "sampled"])
def test_natural_gradient_matches_the_float64_reference_on_factored_blocks(fisher):
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(25), fisher, factorize=True, p0_init="constant", process_noise=1e-3)


def test_natural_gradient_with_a_floor_on_p_hat_matches_the_reference():
    """The floored p̂ is the one the step uses, as in the reference; the floor is reached (else this tests nothing)."""
    opt = _run(mlp(), teacher_stream(40), "exact", factorize=False, p0_init="constant", p_floor=0.3)
    assert float(opt.diagnostics["p_min"]) == pytest.approx(0.3)


@pytest.mark.parametrize("fisher", ["empirical", "exact", "sampled"])
def test_natural_gradient_joint_step_of_several_samples_matches_the_reference(fisher):
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(24), fisher, factorize=True, batch=3)


def test_natural_gradient_row_zero_is_the_negative_cross_entropy_gradient():
    model = mlp()
    x, y = next(teacher_stream(1))
    engine = JacobianEngine(model, observation=FisherRows("empirical"))
    prediction, target, jacobians = engine.observe(x, y.argmax()[None])
    loss = torch.nn.functional.cross_entropy(model(x), y.argmax()[None])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert [tuple(j.shape) for j in jacobians] == [(1, *p.shape) for p in model.parameters()]
    for jac, grad in zip(jacobians, grads, strict=True):
        torch.testing.assert_close(jac[0], -grad, rtol=1e-12, atol=1e-15)  # two float64 backward passes
    torch.testing.assert_close(target, y)


def test_exact_fisher_rows_factor_the_softmax_covariance():
    y_hat = torch.softmax(torch.randn(2, 6, dtype=torch.float64), -1)
    y = torch.nn.functional.one_hot(torch.tensor([1, 4]), 6).double()
    rows = FisherRows("exact").cotangents(y_hat, y)
    assert rows.shape == (7, 2, 6)
    torch.testing.assert_close(rows[0], y - y_hat, rtol=0, atol=0)
    for b in range(2):
        a = rows[1:, b]
        covariance = torch.diag(y_hat[b]) - torch.outer(y_hat[b], y_hat[b])
        torch.testing.assert_close(a.T @ a, covariance, rtol=1e-12, atol=1e-15)


def test_natural_gradient_is_refused_where_it_cannot_work():
    model = mlp()
    with pytest.raises(ConfigError, match="'natural' has no setting r_estimator"):  # its noise: the categorical one
        LoKO(model.parameters(), filter={"name": "natural", "r_estimator": "taylor"})
    with pytest.raises(ConfigError, match="Invalid fisher: 'mc'"):
        DiagonalInformation("mc")
    with pytest.raises(ConfigError, match="the observation must be 'softmax'"):
        LoKO(model.parameters(), filter="natural", observation="topk2")
    with pytest.raises(ConfigError, match="is a filter .*set filter: natural"):
        LoKO(model.parameters(), observation="natural")
    opt = LoKO(model.parameters(), filter="natural")
    with pytest.raises(ValueError, match=r"use engine.observe\(inputs, label\)"):
        JacobianEngine(model, observation=opt.observation)(torch.randn(1, 5, dtype=torch.float64))
    assert opt.defaults["filter"] == {"name": "natural", "fisher": "empirical"} and "r_estimator" not in opt.defaults
    assert get_filter("natural_exact") == DiagonalInformation("exact")
    assert get_filter("natural") != DiagonalInformation("exact")


def test_natural_gradient_skips_a_non_finite_step():
    model = mlp()
    opt = LoKO(model.parameters(), filter="natural", seed=0)
    engine = JacobianEngine(model, observation=opt.observation)
    x, y = next(teacher_stream(1))
    before = [p.detach().clone() for p in model.parameters()]
    cov = [opt.state[p]["cov"].clone() for p in model.parameters()]
    prediction, target, jacobians = engine.observe(x, y.argmax()[None])
    jacobians[0] = jacobians[0].clone()
    jacobians[0].view(-1)[0] = float("nan")
    opt.step(lambda: (prediction, target, jacobians))
    assert not bool(opt.diagnostics["applied"]) and int(opt.diagnostics["skipped"]) == 1
    for p, b, c in zip(model.parameters(), before, cov, strict=True):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["cov"], c)
