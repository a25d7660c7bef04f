"""The top-k observation: the label, the k most probable other classes and the rest, against its float64 definition."""

import copy

import pytest
import torch
from loko_helpers import SmallConvNet, conv_stream, flat, jacrev_rows, mlp, teacher_stream

from loko_lightning import JacobianEngine, LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.reference import topk_step_reference
from loko_lightning.observation import TopK, get_observation


def _run(model, stream, k, factorize, batch=1, r_estimator="taylor", debias=False):
    reference_model = copy.deepcopy(model)
    opt = LoKO(
        model.parameters(),
        p0=0.3,
        seed=4,
        observation=TopK(k),
        filter={"name": "covariance", "beta": 0.9, "r_estimator": r_estimator, "debias": debias},
    )
    theta, p = flat(model.parameters()).detach().clone(), flat(opt.state[q]["cov"] for q in model.parameters())
    R = None
    engine = JacobianEngine(model, observation=opt.observation, factorize=bool(factorize))
    samples = list(stream)
    for step, start in enumerate(range(0, len(samples), batch), 1):
        chunk = samples[start : start + batch]
        x = torch.cat([s[0] for s in chunk])
        label = torch.stack([s[1].argmax() for s in chunk])
        H, y_hat = zip(*(jacrev_rows(reference_model, s[0], probabilities=True) for s in chunk), strict=True)
        targets = torch.stack([s[1] for s in chunk])
        m = targets.shape[1]
        R = torch.zeros(m, m, dtype=torch.float64) if R is None else R
        theta, p, R = topk_step_reference(theta, p, R, torch.stack(H), torch.stack(y_hat), targets, step, top=k,
                                          beta=0.9, r_estimator=r_estimator, debias=debias)  # fmt: skip
        torch.nn.utils.vector_to_parameters(theta, reference_model.parameters())
        observed = engine.observe(x, label, batched=batch > 1)
        opt.step(lambda observed=observed: observed)
        assert bool(opt.diagnostics["applied"])
        # float64 on both sides; the fast path's rows are J_s a pulled back from the logits and its S⁺ an
        # eigendecomposition of the same singular S: equal up to float64 rounding amplified by cond(S).
        torch.testing.assert_close(flat(model.parameters()).detach(), theta, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(flat(opt.state[q]["cov"] for q in model.parameters()), p, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(opt.state[next(model.parameters())]["R"], R, rtol=1e-8, atol=1e-12)
    return opt


@pytest.mark.parametrize("k", [1, 2])
def test_topk_matches_the_float64_reference_on_dense_blocks(k):
    _run(mlp(), teacher_stream(40), k, factorize=False)


@pytest.mark.parametrize("r_estimator", ["taylor", "residual"])
def test_topk_matches_the_float64_reference_on_factored_blocks(r_estimator):
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(25), 1, factorize=True, r_estimator=r_estimator)


def test_topk_debiased_matches_the_reference():
    """``debias``: each sample's block ``A_b R_k A_bᵀ`` divided by ``1 - β^k``, joint steps of 3."""
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(24), 1, factorize=True, batch=3, debias=True)


def test_topk_joint_step_of_several_samples_matches_the_reference():
    torch.manual_seed(0)
    _run(SmallConvNet().double(), conv_stream(24), 1, factorize=True, batch=3)


def test_topk_with_every_class_is_the_full_observation():
    """k = m - 1 observes every class in class order with no rest: the paper's step (only the rounding of the rows
    differs: J_s u_i pulled back from the logits instead of u_i through the softmax's backward)."""
    full, top = mlp(), mlp()
    opt_full = LoKO(full.parameters(), p0=0.3, seed=4)
    opt_top = LoKO(top.parameters(), p0=0.3, seed=4, observation=TopK(3))
    engine_full = JacobianEngine(full)
    engine_top = JacobianEngine(top, observation=opt_top.observation)
    for x, y in teacher_stream(40):
        opt_full.step(lambda x=x, y=y: engine_full.observe(x, y.argmax()[None]))
        opt_top.step(lambda x=x, y=y: engine_top.observe(x, y.argmax()[None]))
        torch.testing.assert_close(flat(top.parameters()), flat(full.parameters()), rtol=1e-9, atol=1e-11)
    first_full, first_top = next(full.parameters()), next(top.parameters())
    torch.testing.assert_close(opt_top.state[first_top]["R"], opt_full.state[first_full]["R"], rtol=1e-9, atol=1e-12)


def test_topk_rows_are_the_aggregated_jacobian():
    model = mlp(m=6)
    x = torch.randn(1, 5, dtype=torch.float64)
    H, y_hat = jacrev_rows(model, x, probabilities=True)
    label = torch.tensor([int(y_hat.argmin())])  # the least probable class: still observed
    prediction, target, jacobians = JacobianEngine(model, observation="topk2").observe(x, label)
    assert [tuple(j.shape) for j in jacobians] == [(4, *p.shape) for p in model.parameters()]
    order = y_hat.argsort(descending=True).tolist()
    classes = sorted([int(label), *[c for c in order if c != int(label)][:2]])
    A = torch.zeros(4, 6, dtype=torch.float64)
    A[range(3), classes] = 1.0
    A[3] = 1.0 - A[:3].sum(0)
    rows = torch.cat([j.reshape(4, -1) for j in jacobians], 1)
    torch.testing.assert_close(rows, A @ H, rtol=1e-12, atol=1e-15)  # two float64 reverse passes
    aggregation, lift, observed, observed_target = TopK(2).aggregate(prediction[None], target[None])
    torch.testing.assert_close(aggregation[0], A, rtol=0, atol=0)
    torch.testing.assert_close(aggregation[0] @ lift[0].T, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(observed[0], A @ prediction, rtol=0, atol=1e-15)
    assert observed_target[0].tolist() == [float(c == int(label)) for c in classes] + [0.0]


def test_topk_bad_input_is_refused_naming_the_field():
    model = mlp()
    with pytest.raises(ConfigError, match=r"Invalid k: 0 \(must be an integer >= 1\)") as err:
        TopK(0)
    assert err.value.field == "k"
    with pytest.raises(ConfigError, match="Invalid k: True"):
        TopK(True)
    with pytest.raises(ConfigError, match=r"r_estimator: 'identity' does not apply to observation 'topk5'"):
        LoKO(model.parameters(), observation="topk", filter={"name": "covariance", "r_estimator": "identity"})
    opt = LoKO(model.parameters(), observation=TopK(4))
    x, y = next(teacher_stream(1))
    with pytest.raises(ConfigError, match=r"Invalid k: 4 for 4 classes \(must be at most m - 1 = 3") as err:
        opt.step(lambda: JacobianEngine(model, observation=opt.observation).observe(x, y.argmax()[None]))
    assert err.value.field == "k"
    assert get_observation("topk3") == TopK(3) and get_observation("topk") == TopK(5)
    assert opt.defaults["observation"] == "topk4"
    with pytest.raises(ConfigError, match=r"expected one of .*topk<k> such as topk3"):
        get_observation("topkx")
