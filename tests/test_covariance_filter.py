"""The fast Kalman update against the dense float64 reference (:mod:`loko_lightning.kalman.reference`) and closed
forms."""

import copy
import math
import sys

import pytest
import torch
from loko_helpers import (
    DenseModelFilter,
    SmallConvNet,
    assert_matches_dense,
    conv_stream,
    factor_dense,
    flat_cov,
    loko_closure,
    mlp,
    teacher_stream,
)
from torch import nn
from torch.nn import functional as F

from loko_lightning import LoKO, OuterJacobian, jacobian
from loko_lightning.errors import ConfigError
from loko_lightning.jacobians.blocks import FactoredJacobian
from loko_lightning.kalman.filters import Covariance, psd_pinv
from loko_lightning.kalman.noise import R_ESTIMATORS
from loko_lightning.kalman.plan import innovation_covariance
from loko_lightning.kalman.reference import REFERENCE_R_ESTIMATORS, loko_step_reference, pinv_reference
from loko_lightning.kalman.update import loko_update

ESTIMATORS = list(R_ESTIMATORS)


def test_the_reference_writes_every_estimator_of_the_registry():
    assert set(REFERENCE_R_ESTIMATORS) == set(R_ESTIMATORS)


@pytest.mark.parametrize("p0_init", ["uniform", "constant"])
@pytest.mark.parametrize("r_estimator", ESTIMATORS)
def test_matches_float64_reference(r_estimator, p0_init):
    """Fast path (float64) and the dense reference agree to float64 rounding over 120 steps."""
    model = mlp()
    opt = LoKO(
        model.parameters(),
        p0=0.3,
        p0_init=p0_init,
        seed=3,
        filter={"name": "covariance", "beta": 0.9, "r_estimator": r_estimator},
        time_update={"process_noise": 1e-4},
    )
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator=r_estimator, process_noise=1e-4)
    for x, y in teacher_stream(120):
        y_ref = reference.step(x, y)
        y_fast, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert opt.diagnostics["step"].item() == 120
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    cov = torch.cat([opt.state[p]["cov"].reshape(-1) for p in model.parameters()])
    # Both sides do the same float64 arithmetic in another order; 120 steps of a contracting filter keep the
    # accumulated relative error near 1e-13, so 1e-9 leaves room without hiding an algorithmic difference.
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cov, reference.p, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(opt.state[next(model.parameters())]["R"], reference.R, rtol=1e-9, atol=1e-15)
    assert (cov > 0).all()
    assert (cov < 0.3 + 120 * 1e-4).all()


def step_beside(model, opt, reference, other, steps=120):
    """``steps`` samples through the fast path, ``reference`` (whose predictions it must give) and ``other`` beside."""
    for x, y in teacher_stream(steps):
        y_ref = reference.step(x, y)
        other.step(x, y)
        y_fast, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("r_estimator", ["taylor", "residual"])
def test_debiased_noise_matches_float64_reference(r_estimator):
    """``debias``: the noise in ``S`` is ``R_k / (1 - β^k)``, the state's ``R_k`` the EMA: as the dense reference."""
    model = mlp()
    settings = {"name": "covariance", "beta": 0.9, "r_estimator": r_estimator, "debias": True}
    opt = LoKO(model.parameters(), p0=0.3, seed=3, filter=settings, time_update={"process_noise": 1e-4})
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(
        copy.deepcopy(model), p0, beta=0.9, r_estimator=r_estimator, debias=True, process_noise=1e-4
    )
    paper = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator=r_estimator, process_noise=1e-4)
    step_beside(model, opt, reference, paper)
    theta = assert_matches_dense(model, opt, reference)
    # Not the paper's filter: its first steps, with R_k scaled down by 1 - 0.9^k, take it elsewhere.
    assert (theta - paper.theta).abs().max() > 1e-3
    assert opt.filter.config()["debias"] is True


def test_debias_is_refused_where_r_is_no_ema():
    """``identity``, ``decay`` and ``softmax`` are not an EMA: nothing to debias, said with the fix."""
    with pytest.raises(ConfigError, match=r"Invalid debias: r_estimator 'identity' is not an EMA.*set debias: false"):
        LoKO(mlp().parameters(), filter={"name": "covariance", "r_estimator": "identity", "debias": True})
    with pytest.raises(ConfigError, match=r"Invalid debias: 'yes' \(must be true or false\)"):
        LoKO(mlp().parameters(), filter={"name": "covariance", "debias": "yes"})


@pytest.mark.parametrize("per_group", [False, True], ids=["one floor", "a floor per group"])
def test_p_floor_matches_float64_reference(per_group):
    """A floor on p̂ holds p̂ at the floor once the update would take it below, the same as the dense reference."""
    model = mlp()
    first, second = [*model[0].parameters()], [*model[2].parameters()]
    n_first, n_second = sum(p.numel() for p in first), sum(p.numel() for p in second)
    groups = [{"params": first, "p_floor": 0.05} if per_group else {"params": first}, {"params": second}]
    high = 0.05 if per_group else 0.02
    floor = torch.cat(
        [torch.full((n_first,), high, dtype=torch.float64), torch.full((n_second,), 0.02, dtype=torch.float64)]
    )
    opt = LoKO(groups, p0=0.3, seed=3, filter={"name": "covariance", "beta": 0.9}, time_update={"p_floor": 0.02})
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", p_floor=floor)
    unfloored = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor")
    step_beside(model, opt, reference, unfloored)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    cov = torch.cat([opt.state[p]["cov"].reshape(-1) for p in model.parameters()])
    # The same float64 arithmetic in another order, as in test_matches_float64_reference.
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cov, reference.p, rtol=1e-9, atol=1e-15)
    # The floor binds for some entries and not for others, and it changed the run.
    assert (cov >= floor).all()
    at_floor = cov == floor
    assert at_floor.any() and not at_floor.all()
    assert (unfloored.p < floor).any()
    assert not torch.allclose(theta, unfloored.theta, rtol=1e-6, atol=0)


def test_float32_step_matches_float64_reference():
    """One float32 step from the same state as the float64 reference: error at the level of cond(S)·eps32."""
    model64 = mlp()
    model32 = copy.deepcopy(model64).float()
    opt32 = LoKO(model32.parameters(), p0=0.2, seed=0)
    p0 = flat_cov(opt32, model32.parameters())
    reference = DenseModelFilter(copy.deepcopy(model64), p0, beta=0.95, r_estimator="taylor")
    x, y = next(teacher_stream(1))
    reference.step(x, y)
    opt32.step(loko_closure(model32, x.float(), y.float()))
    cond = opt32.diagnostics["cond"].item()
    assert cond < 1e3
    theta32 = torch.cat([p.detach().reshape(-1) for p in model32.parameters()]).double()
    delta_ref = reference.theta - torch.cat([p.detach().reshape(-1) for p in model64.parameters()])
    # Relative error of a float32 solve is ~ cond(S)·eps32 = cond·1.2e-7; x10 for the sums over ñ = 78 terms.
    bound = 10 * cond * torch.finfo(torch.float32).eps
    err = (theta32 - reference.theta).abs().max() / delta_ref.abs().max()
    assert err < bound, (err, bound)


@pytest.mark.slow
def test_singular_s_float32_stays_finite_and_positive():
    """Softmax makes S singular; float32 must still give a finite update that learns and keeps p̂ > 0."""
    m, d = 10, 16
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(m, d, generator=gen) * 3
    model = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, m))
    opt = LoKO(model.parameters(), p0=0.2, seed=0)
    correct = worst_cond = 0
    n = 10_000
    for k in range(n):
        label = torch.randint(m, (1,), generator=gen)
        x = centres[label] + torch.randn(1, d, generator=gen)
        y = F.one_hot(label[0], m).float()
        prediction, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
        correct += int(prediction.argmax() == label[0])
        if k % 100 == 0:
            worst_cond = max(worst_cond, opt.diagnostics["cond"].item())
    diag = opt.diagnostics
    assert diag["skipped"].item() == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all((opt.state[p]["cov"] > 0).all() for p in model.parameters())
    assert math.isfinite(worst_cond)
    assert correct / n > 0.95, correct / n


def test_plain_inverse_of_softmax_s_is_singular():
    """The trap the pseudo-inverse avoids: S's all-ones direction is (numerically) null."""
    model = mlp(dtype=torch.float32)
    x, y = next(teacher_stream(1, dtype=torch.float32))
    prediction, jacobians = jacobian(model, x)
    flat = torch.cat([j.reshape(4, -1) for j in jacobians], 1)
    s = flat @ flat.T * 0.2 + 0.05 * torch.outer(y - prediction, y - prediction)
    ones = torch.ones(4) / 2
    assert (s @ ones).abs().max() < 1e-6 * s.abs().max()
    pinv, cond = psd_pinv(s)
    assert torch.isfinite(pinv).all()
    assert (pinv @ ones).abs().max() < 1e-4 * pinv.abs().max()


def test_linear_gaussian_matches_recursive_least_squares():
    """Orthogonal (one-hot) features keep the exact posterior diagonal, so LoKO with R = I is exact RLS.

    Each observation is y = W x + v, v ~ N(0, I), x = a e_i. Per weight W_ji the Kalman filter equals
    Bayesian least squares with prior N(W0_ji, p0): W_ji = (W0_ji / p0 + Σ a y_j) / (1/p0 + Σ a²) and
    p_ji = 1 / (1/p0 + Σ a²), summed over the observations that hit feature i.
    """
    m, d, p0, n = 3, 6, 0.5, 400
    gen = torch.Generator().manual_seed(0)
    true_w = torch.randn(m, d, generator=gen, dtype=torch.float64)
    model = nn.Linear(d, m, bias=False).double()
    w0 = model.weight.detach().clone()
    opt = LoKO(model.parameters(), p0=p0, p0_init="constant", filter={"name": "covariance", "r_estimator": "identity"})
    info = torch.full((d,), 1 / p0, dtype=torch.float64)
    moment = w0 / p0
    for _ in range(n):
        i = torch.randint(d, (1,), generator=gen).item()
        a = 0.5 + torch.rand((), generator=gen, dtype=torch.float64)
        x = torch.zeros(1, d, dtype=torch.float64)
        x[0, i] = a
        y = (x @ true_w.T)[0] + torch.randn(m, generator=gen, dtype=torch.float64)
        opt.step(loko_closure(model, x, y, observation="regression"))
        info[i] += a * a
        moment[:, i] += a * y
    torch.testing.assert_close(model.weight.detach(), moment / info, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(opt.state[model.weight]["cov"], (1 / info).expand(m, d), rtol=1e-10, atol=1e-15)
    assert (model.weight.detach() - true_w).abs().max() < 0.5  # ~ 1/sqrt(n/d) posterior spread


def test_outer_jacobian_equals_dense():
    model = mlp(dtype=torch.float64)
    x, y = next(teacher_stream(1))
    opt_dense = LoKO(model.parameters(), seed=0)
    model_b = copy.deepcopy(model)
    opt_outer = LoKO(model_b.parameters(), seed=0)
    opt_dense.step(loko_closure(model, x, y))
    _, _, jacs = opt_outer.step(loko_closure(model_b, x, y, factorize=True))
    assert isinstance(jacs[2], OuterJacobian)
    for p, q in zip(model.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("r_estimator", ["taylor", "identity"])
def test_factored_blocks_match_float64_reference(r_estimator, monkeypatch):
    """FactoredJacobian (k > 1), k = 1 blocks and dense blocks together reproduce the dense reference."""
    monkeypatch.setattr(sys.modules["loko_lightning.jacobians.reverse"], "factored_is_cheaper", lambda *args: True)
    torch.manual_seed(3)
    model = SmallConvNet().double()
    groups = [
        {"params": [*model.conv1.parameters(), *model.conv2.parameters()], "process_noise": 1e-4},
        {"params": [*model.conv3.parameters(), *model.tokens.parameters(), *model.head.parameters()]},
    ]
    opt = LoKO(
        groups,
        p0=0.3,
        seed=3,
        filter={"name": "covariance", "beta": 0.9, "r_estimator": r_estimator},
        time_update={"process_noise": 1e-4},
    )
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator=r_estimator, process_noise=1e-4)
    kinds = set()
    for x, y in conv_stream(40):
        y_ref = reference.step(x, y)
        y_fast, _, jacs = opt.step(loko_closure(model, x, y, factorize=True))
        kinds |= {type(j).__name__ + (str(j.left.shape[2]) if isinstance(j, FactoredJacobian) else "") for j in jacs}
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    # conv1/conv2: 4 positions; conv3: 1; tokens: 4 tokens; head: OuterJacobian; biases dense.
    assert kinds == {"FactoredJacobian4", "FactoredJacobian1", "OuterJacobian", "Tensor"}
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    cov = torch.cat([opt.state[p]["cov"].reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cov, reference.p, rtol=1e-9, atol=1e-15)


def test_factored_and_dense_steps_agree():
    """The same filter fed factored or dense Jacobians of the same model: the same parameters and p̂."""
    torch.manual_seed(4)
    model = SmallConvNet().double()
    model_b = copy.deepcopy(model)
    opt_dense = LoKO(model.parameters(), seed=0)
    opt_fact = LoKO(model_b.parameters(), seed=0)
    for x, y in conv_stream(10):
        _, _, dense_jacs = opt_dense.step(loko_closure(model, x, y))

        def factored_closure(x=x, y=y):
            prediction, jacs = jacobian(model_b, x, factorize=True)
            blocks = [
                factor_dense(j, p) if isinstance(j, torch.Tensor) and p.dim() > 1 else j
                for j, p in zip(jacs, model_b.parameters(), strict=True)
            ]
            return prediction, y, blocks

        _, _, blocks = opt_fact.step(factored_closure)
        assert any(isinstance(b, FactoredJacobian) for b in blocks)
    for p, q in zip(model.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(opt_dense.state[p]["cov"], opt_fact.state[q]["cov"], rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize(("m", "n"), [(10, 45_001), (40, 25_003)])
@pytest.mark.parametrize("tiled", [True, False])
def test_wide_update_matches_reference(m, n, tiled):
    """One update on a wide H (many parameters against m) equals the dense reference of Algorithm 1.

    These sizes take the blocked code paths (H P Hᵀ and diag(Hᵀ S⁺ H) summed over column chunks) that the small
    models of the other tests never reach, and the factored blocks form groups of one shape with several blocks
    and runs of groups with one k that mix both ways of forming M_i (k <= rows and k > rows). float64 on both sides:
    the sums differ in order only, so 1e-10 relative is far above rounding (about 1e-13 here) and far below any
    wrong term.
    """
    gen = torch.Generator().manual_seed(m)
    sizes = [n // 3, n // 3, n - 2 * (n // 3)]
    buffer = torch.randn(m, n, generator=gen, dtype=torch.float64) / math.sqrt(n)
    blocks, start = [], 0
    for size in sizes:
        block = buffer[:, start : start + size]
        blocks.append(block if tiled else block.clone())
        start += size

    # Factored blocks with few (k = 3 <= 5 rows) and many (k = 3 > 2, 6 > 2 rows) positions, and an outer one.
    def factored(rows, cols, k):
        left = torch.randn(m, rows, k, generator=gen, dtype=torch.float64)
        return FactoredJacobian(
            left, torch.randn(cols, k, generator=gen, dtype=torch.float64), torch.Size((rows, cols))
        )

    outer = OuterJacobian(
        torch.randn(m, 6, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)
    )
    jacobians = [*blocks, factored(5, 7, 3), factored(2, 9, 6), factored(5, 7, 3), factored(5, 4, 3)]
    jacobians += [factored(2, 9, 3), factored(2, 9, 6), outer]
    params = [torch.zeros(j.shape[1:], dtype=torch.float64) for j in jacobians]
    covs = [torch.rand(p.shape, generator=gen, dtype=torch.float64) * 0.3 + 0.01 for p in params]
    prediction = torch.softmax(torch.randn(m, generator=gen, dtype=torch.float64), 0)
    target = F.one_hot(torch.tensor(1), m).double()
    R = torch.eye(m, dtype=torch.float64) * 0.05
    step = torch.zeros((), dtype=torch.int64)

    H = torch.cat(
        [j.reshape(m, -1) if isinstance(j, torch.Tensor) else j.to_dense().reshape(m, -1) for j in jacobians], dim=1
    )
    p = torch.cat([c.reshape(-1) for c in covs])
    theta = torch.zeros_like(p)
    theta, p_new, R_new = loko_step_reference(theta, p, R, H, prediction, target, 1, beta=0.9, r_estimator="taylor")

    loko_update(params, jacobians, {"cov": covs, "R": R, "step": step}, prediction, target,
                filter=Covariance(beta=0.9, r_estimator="taylor"))  # fmt: skip
    torch.testing.assert_close(torch.cat([q.reshape(-1) for q in params]), theta, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(torch.cat([c.reshape(-1) for c in covs]), p_new, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(R, R_new, rtol=1e-10, atol=1e-14)


def test_innovation_covariance_matches_dense_product():
    """``innovation_covariance`` (the update's own H P Hᵀ) on every block kind equals ``H diag(p) Hᵀ`` of the dense H.

    float64 on both sides, sums in a different order only: 1e-12 relative is far above rounding and far below any
    missing or wrong term.
    """
    gen = torch.Generator().manual_seed(3)
    m = 7

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    jacobians = [
        randn(m, 4, 3),
        FactoredJacobian(randn(m, 5, 3), randn(6, 3), torch.Size((5, 6))),
        FactoredJacobian(randn(m, 2, 4), randn(9, 4), torch.Size((2, 9))),
        OuterJacobian(randn(m, 3), randn(8)),
    ]
    covs = [torch.rand(j.shape[1:], generator=gen, dtype=torch.float64) + 0.1 for j in jacobians]
    H = torch.cat([(j if isinstance(j, torch.Tensor) else j.to_dense()).reshape(m, -1) for j in jacobians], dim=1)
    p = torch.cat([c.reshape(-1) for c in covs])
    torch.testing.assert_close(innovation_covariance(jacobians, covs), (H * p) @ H.T, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="at least one parameter block"):
        innovation_covariance([], [])


def test_reference_is_recursive_least_squares():
    """The reference itself, with R = I on orthogonal (one-hot) features, is exact Bayesian least squares.

    The same closed form as ``test_linear_gaussian_matches_recursive_least_squares``, for the specification rather
    than the fast path: y = W x + v, v ~ N(0, I), x = a e_i, and H = ∂(W x)/∂vec(W) = I_m ⊗ xᵀ.
    """
    m, d, p0, n = 3, 6, 0.5, 200
    gen = torch.Generator().manual_seed(1)
    true_w = torch.randn(m, d, generator=gen, dtype=torch.float64)
    w0 = torch.randn(m, d, generator=gen, dtype=torch.float64)
    theta, p, R = w0.reshape(-1), torch.full((m * d,), p0, dtype=torch.float64), torch.zeros(m, m)
    info = torch.full((d,), 1 / p0, dtype=torch.float64)
    moment = w0 / p0
    for k in range(1, n + 1):
        i = torch.randint(d, (1,), generator=gen).item()
        a = 0.5 + torch.rand((), generator=gen, dtype=torch.float64)
        x = torch.zeros(d, dtype=torch.float64)
        x[i] = a
        y = true_w @ x + torch.randn(m, generator=gen, dtype=torch.float64)
        H = torch.kron(torch.eye(m, dtype=torch.float64), x[None])
        theta, p, R = loko_step_reference(
            theta, p, R, H, theta.reshape(m, d) @ x, y, k, beta=0.9, r_estimator="identity"
        )
        info[i] += a * a
        moment[:, i] += a * y
    torch.testing.assert_close(theta.reshape(m, d), moment / info, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(p.reshape(m, d), (1 / info).expand(m, d), rtol=1e-10, atol=1e-15)


def test_reference_pinv_and_fast_pinv_drop_the_same_null_direction():
    """Both pseudo-inverses drop eigenvalues at or below rcond · λ_max, so on a rank-deficient S they agree.

    S = A Aᵀ with A of rank m - 1: one eigenvalue is rounding noise (~1e-16 λ_max), the others are O(1). float64 on
    both sides; the kept spectrum's condition number is below 1e3, so 1e-10 relative is far above rounding.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    S = a @ a.T
    expected = torch.linalg.pinv(S, hermitian=True, rtol=1e-10)
    fast, cond = psd_pinv(S)
    assert cond < 1e3
    torch.testing.assert_close(pinv_reference(S), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="Invalid r_estimator"):
        loko_step_reference(torch.zeros(4), torch.ones(4), S, a, torch.zeros(5), torch.zeros(5), 1, beta=0.9,
                            r_estimator="kalman")  # fmt: skip


def test_the_posterior_floor_holds_where_one_observation_determines_a_parameter():
    """One parameter, observed exactly (e = 0, the residual R = e eᵀ = 0): the gain is 1 and (KH)_ii = 1 in exact
    arithmetic, so p̂ would be 0 (or below it by a rounding) and the parameter frozen for good; the update keeps
    p̂ = eps · p̂_prior instead (the clamp of the step's posterior, reached here for every Jacobian value)."""
    eps = torch.finfo(torch.float64).eps
    for h in (0.7, 1.3, 3.1, 1e3):
        param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = LoKO(
            [param],
            p0=0.5,
            p0_init="constant",
            observation="regression",
            filter={"name": "covariance", "r_estimator": "residual"},
        )
        prediction = torch.zeros(1, dtype=torch.float64)
        opt.step(lambda h=h, prediction=prediction: (prediction, prediction.clone(), [torch.full((1, 1), h).double()]))
        assert bool(opt.diagnostics["applied"])
        assert torch.equal(opt.state[param]["cov"], torch.full((1,), eps * 0.5, dtype=torch.float64)), h
