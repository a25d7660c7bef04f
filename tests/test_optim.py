import copy
import math
import subprocess
import sys

import pytest
import torch
from reference import ReferenceLoKO
from torch import nn
from torch.nn import functional as F

from loko_lightning import LoKO, OuterJacobian, jacobian
from loko_lightning.blocks import FactoredJacobian
from loko_lightning.functional import innovation_covariance, loko_update, psd_pinv

ESTIMATORS = ["taylor", "residual", "identity", "decay", "softmax"]


def mlp(d_in=5, hidden=7, m=4, dtype=torch.float64):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, m)).to(dtype)


def teacher_stream(n, d_in=5, m=4, seed=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(m, d_in, generator=gen, dtype=dtype)
    for _ in range(n):
        x = torch.randn(1, d_in, generator=gen, dtype=dtype)
        yield x, F.one_hot((x @ w.T).argmax(), m).to(dtype)


def loko_closure(model, x, y, **kwargs):
    def closure():
        prediction, jacobians = jacobian(model, x, **kwargs)
        return prediction, y, jacobians

    return closure


@pytest.mark.parametrize("p0_init", ["uniform", "constant"])
@pytest.mark.parametrize("r_estimator", ESTIMATORS)
def test_matches_float64_reference(r_estimator, p0_init):
    """Fast path (float64) and the dense reference agree to float64 rounding over 120 steps."""
    model = mlp()
    reference = ReferenceLoKO(copy.deepcopy(model), None, beta=0.9, r_estimator=r_estimator, process_noise=1e-4)
    opt = LoKO(
        model.parameters(), p0=0.3, p0_init=p0_init, beta=0.9, r_estimator=r_estimator, process_noise=1e-4, seed=3
    )
    reference.P = torch.diag(torch.cat([opt.state[p]["cov"].reshape(-1) for p in model.parameters()]))
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
    torch.testing.assert_close(cov, torch.diag(reference.P), rtol=1e-9, atol=1e-15)
    assert (cov > 0).all()
    assert (cov < 0.3 + 120 * 1e-4).all()


def test_float32_step_matches_float64_reference():
    """One float32 step from the same state as the float64 reference: error at the level of cond(S)·eps32."""
    model64 = mlp()
    model32 = copy.deepcopy(model64).float()
    opt32 = LoKO(model32.parameters(), p0=0.2, seed=0)
    reference = ReferenceLoKO(copy.deepcopy(model64), None, beta=0.95, r_estimator="taylor")
    reference.P = torch.diag(torch.cat([opt32.state[p]["cov"].reshape(-1) for p in model32.parameters()]).double())
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
    opt = LoKO(model.parameters(), p0=p0, p0_init="constant", r_estimator="identity")
    info = torch.full((d,), 1 / p0, dtype=torch.float64)
    moment = w0 / p0
    for _ in range(n):
        i = torch.randint(d, (1,), generator=gen).item()
        a = 0.5 + torch.rand((), generator=gen, dtype=torch.float64)
        x = torch.zeros(1, d, dtype=torch.float64)
        x[0, i] = a
        y = (x @ true_w.T)[0] + torch.randn(m, generator=gen, dtype=torch.float64)
        opt.step(loko_closure(model, x, y, output="identity"))
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


def test_state_dict_round_trip_continues_bit_identically():
    stream = list(teacher_stream(40, dtype=torch.float32))
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), seed=0, process_noise=1e-5)
    for x, y in stream[:20]:
        opt.step(loko_closure(model, x, y))
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for x, y in stream[20:]:
        opt.step(loko_closure(model, x, y))

    restored = mlp(dtype=torch.float32)
    restored.load_state_dict(saved_model)
    opt2 = LoKO(restored.parameters(), seed=123)  # a different p0 draw, overwritten by the checkpoint
    opt2.load_state_dict(saved_opt)
    for x, y in stream[20:]:
        opt2.step(loko_closure(restored, x, y))
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["cov"], opt2.state[q]["cov"])
    first, first2 = next(model.parameters()), next(restored.parameters())
    for key in ("noise", "step", "skipped"):
        assert torch.equal(opt.state[first][key], opt2.state[first2][key])


def test_float64_state_survives_checkpoint_of_float32_model():
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), dtype=torch.float64, seed=0)
    x, y = next(teacher_stream(1, dtype=torch.float32))
    opt.step(loko_closure(model, x, y))
    opt2 = LoKO(model.parameters(), dtype=torch.float64)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in model.parameters():
        assert opt2.state[p]["cov"].dtype == torch.float64
        assert torch.equal(opt2.state[p]["cov"], opt.state[p]["cov"])
    assert opt2.state[next(model.parameters())]["noise"].dtype == torch.float64


@pytest.mark.parametrize("where", ["prediction", "jacobian", "target"])
def test_non_finite_input_skips_update(where):
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), seed=0)
    stream = list(teacher_stream(3, dtype=torch.float32))
    opt.step(loko_closure(model, *stream[0]))
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    x, y = stream[1]

    def bad_closure():
        prediction, jacobians = jacobian(model, x)
        if where == "prediction":
            prediction = prediction.clone()
            prediction[0] = float("nan")
        elif where == "jacobian":
            jacobians[1] = jacobians[1].clone()
            jacobians[1][0, 0] = float("inf")
        return prediction, (y * float("nan") if where == "target" else y), jacobians

    opt.step(bad_closure)
    assert not opt.diagnostics["applied"].item()
    assert opt.diagnostics["skipped"].item() == 1
    for p, q in zip(model.parameters(), params_before, strict=True):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            if key != "skipped":  # the one counter a skipped update is meant to change
                assert torch.equal(after["state"][index][key], value), key
    opt.step(loko_closure(model, *stream[2]))
    assert opt.diagnostics["applied"].item()
    assert opt.diagnostics["step"].item() == 2


def test_wrong_shapes_raise():
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters())
    x, y = next(teacher_stream(1, dtype=torch.float32))
    prediction, jacobians = jacobian(model, x)
    with pytest.raises(ValueError, match=r"Invalid target: expected shape \(4,\).*got \(3,\)"):
        opt.step(lambda: (prediction, y[:3], jacobians))
    with pytest.raises(ValueError, match=r"Invalid prediction: expected shape \(m,\), got \(1, 4\)"):
        opt.step(lambda: (prediction[None], y, jacobians))
    with pytest.raises(ValueError, match=r"expected 4 \(one per parameter\), got 3"):
        opt.step(lambda: (prediction, y, jacobians[:3]))
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]: expected shape \(4, 7, 5\), got \(4, 5, 7\)"):
        opt.step(lambda: (prediction, y, [jacobians[0].transpose(1, 2), *jacobians[1:]]))
    with pytest.raises(ValueError, match="closure"):
        opt.step()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"p0": 0.0}, "Invalid p0"),
        ({"p0": -1.0}, "Invalid p0"),
        ({"p0": float("nan")}, "Invalid p0"),
        ({"beta": 1.0}, "Invalid beta"),
        ({"beta": 0.0}, "Invalid beta"),
        ({"process_noise": -1e-3}, "Invalid process_noise"),
        ({"r_estimator": "kalman"}, "Invalid r_estimator"),
        ({"p0_init": "normal"}, "Invalid p0_init"),
        ({"dtype": torch.float16}, "Invalid dtype"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoKO(mlp().parameters(), **kwargs)


def test_param_groups_carry_their_own_p0():
    model = mlp(dtype=torch.float32)
    opt = LoKO(
        [
            {"params": model[0].parameters(), "p0": 1e-3, "p0_init": "constant"},
            {"params": model[2].parameters()},
        ],
        p0=0.2,
        seed=0,
    )
    assert torch.equal(opt.state[model[0].weight]["cov"], torch.full((7, 5), 1e-3))
    head = opt.state[model[2].weight]["cov"]
    assert (head > 0).all() and (head <= 0.2).all() and head.std() > 0.02  # U(0, 0.2] has std 0.058
    with pytest.raises(ValueError, match="must be set on the optimizer"):
        LoKO([{"params": model[0].parameters(), "beta": 0.5}])


def test_seed_makes_p0_reproducible():
    a = LoKO(mlp().parameters(), seed=7)
    b = LoKO(mlp().parameters(), seed=7)
    for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
        assert torch.equal(sa["cov"], sb["cov"])


def test_torch_only_import_pulls_no_lightning():
    code = (
        "import sys, loko_lightning, loko_lightning.optim, loko_lightning.jacobian, loko_lightning.functional\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class SmallConvNet(nn.Module):
    """Conv layers with few and many positions, a Linear on tokens and a head: every Jacobian block kind."""

    def __init__(self, m=4):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.conv3 = nn.Conv2d(4, 5, 2)  # one output position
        self.tokens = nn.Linear(4, 4)
        self.head = nn.Linear(5 + 4, m)

    def forward(self, x):
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))  # (1, 4, 2, 2)
        pooled = torch.tanh(self.conv3(h)).flatten(1)  # (1, 5)
        tokens = torch.tanh(self.tokens(h.flatten(2).transpose(1, 2))).mean(1)  # (1, 4)
        return self.head(torch.cat([pooled, tokens], 1))


def conv_stream(n, m=4, seed=5):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(m, 2 * 4 * 4, generator=gen, dtype=torch.float64)
    for _ in range(n):
        x = torch.randn(1, 2, 4, 4, generator=gen, dtype=torch.float64)
        yield x, F.one_hot((x.reshape(1, -1) @ w.T).argmax(), m).to(torch.float64)


@pytest.mark.parametrize("r_estimator", ["taylor", "identity"])
def test_factored_blocks_match_float64_reference(r_estimator, monkeypatch):
    """FactoredJacobian (k > 1), k = 1 blocks and dense blocks together reproduce the dense reference."""
    monkeypatch.setattr(sys.modules["loko_lightning.jacobian"], "factored_is_cheaper", lambda *args: True)
    torch.manual_seed(3)
    model = SmallConvNet().double()
    reference = ReferenceLoKO(copy.deepcopy(model), None, beta=0.9, r_estimator=r_estimator, process_noise=1e-4)
    groups = [
        {"params": [*model.conv1.parameters(), *model.conv2.parameters()], "process_noise": 1e-4},
        {"params": [*model.conv3.parameters(), *model.tokens.parameters(), *model.head.parameters()]},
    ]
    opt = LoKO(groups, p0=0.3, beta=0.9, r_estimator=r_estimator, process_noise=1e-4, seed=3)
    reference.P = torch.diag(torch.cat([opt.state[p]["cov"].reshape(-1) for p in model.parameters()]))
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
    torch.testing.assert_close(cov, torch.diag(reference.P), rtol=1e-9, atol=1e-15)


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
                _factor(j, p) if isinstance(j, torch.Tensor) and p.dim() > 1 else j
                for j, p in zip(jacs, model_b.parameters(), strict=True)
            ]
            return prediction, y, blocks

        _, _, blocks = opt_fact.step(factored_closure)
        assert any(isinstance(b, FactoredJacobian) for b in blocks)
    for p, q in zip(model.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(opt_dense.state[p]["cov"], opt_fact.state[q]["cov"], rtol=1e-10, atol=1e-15)


def _factor(jac, param):
    """An exact factorization of a dense block: left = the dense rows, right = identity (k = cols)."""
    m, rows = jac.shape[0], param.shape[0]
    cols = param[0].numel()
    return FactoredJacobian(jac.reshape(m, rows, cols), torch.eye(cols, dtype=jac.dtype), param.shape)


def test_factored_jacobian_shapes_are_checked_and_non_finite_skips():
    model = SmallConvNet()
    opt = LoKO(model.parameters(), seed=0)
    x, y = next(conv_stream(1))
    x, y = x.float(), y.float()
    prediction, jacs = jacobian(model, x)
    good = _factor(jacs[0], model.conv1.weight)
    bad = FactoredJacobian(good.left, good.right[:-1], model.conv1.weight.shape)
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]"):
        opt.step(lambda: (prediction, y, [bad, *jacs[1:]]))
    wrong_rows = FactoredJacobian(good.left[:, :2], good.right, model.conv1.weight.shape)
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]"):
        opt.step(lambda: (prediction, y, [wrong_rows, *jacs[1:]]))
    before = [p.detach().clone() for p in model.parameters()]
    nan_left = good.left.clone()
    nan_left[0, 0, 0] = float("nan")
    opt.step(lambda: (prediction, y, [FactoredJacobian(nan_left, good.right, good.param_shape), *jacs[1:]]))
    assert not opt.diagnostics["applied"].item()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    opt.step(lambda: (prediction, y, [good, *jacs[1:]]))
    assert opt.diagnostics["applied"].item()


def test_cached_plan_and_flat_covariance_equal_the_stateless_update():
    """LoKO keeps one update plan and p̂ as one flat vector between steps; that must not change any number.

    The stateless :func:`loko_update` (a plan built per call, p̂ gathered from and scattered back to separate
    tensors) is run beside the optimizer on the same Jacobians. The layout changes mid-stream (dense, then
    factored blocks, then dense again: a new plan and a new flat order each time), and the optimizer's state is
    replaced by ``load_state_dict`` mid-stream (the flat vector must be rebuilt from the new tensors). Both sides
    do the same operations on the same values, so they agree exactly.
    """
    torch.manual_seed(4)
    model = SmallConvNet().double()
    model_b = copy.deepcopy(model)
    opt = LoKO(model.parameters(), seed=0, process_noise=1e-4)
    params_b = list(model_b.parameters())
    covs = [opt.state[p]["cov"].clone() for p in model.parameters()]
    noise, step = torch.zeros(4, 4, dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for i, (x, y) in enumerate(conv_stream(12)):
        factorize = 4 <= i < 8
        prediction, jacs = jacobian(model, x, factorize=factorize)
        prediction_b, jacs_b = jacobian(model_b, x, factorize=factorize)
        assert torch.equal(prediction, prediction_b)
        opt.step(lambda: (prediction, y, jacs))  # noqa: B023 (called at once)
        expected = loko_update(
            params_b, jacs_b, covs, prediction_b, y, noise, step, beta=0.95, r_estimator="taylor", process_noise=1e-4
        )
        if i == 9:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, q, cov in zip(model.parameters(), params_b, covs, strict=True):
            assert torch.equal(p, q), i
            assert torch.equal(opt.state[p]["cov"], cov), i
        # The optimizer computes p̂'s statistics when they are read; they are those of this step.
        diagnostics = opt.diagnostics
        for key, value in expected.items():
            assert torch.equal(diagnostics[key], value), (i, key)
    assert opt.diagnostics["step"].item() == 12


@pytest.mark.parametrize(("m", "n"), [(10, 45_001), (40, 25_003)])
@pytest.mark.parametrize("tiled", [True, False])
def test_wide_update_matches_dense_formulas(m, n, tiled):
    """One update on a wide H (many parameters against m) equals Algorithm 1 written with dense matrices.

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
    noise = torch.eye(m, dtype=torch.float64) * 0.05
    step = torch.zeros((), dtype=torch.int64)

    H = torch.cat(
        [j.reshape(m, -1) if isinstance(j, torch.Tensor) else j.to_dense().reshape(m, -1) for j in jacobians], dim=1
    )
    p = torch.cat([c.reshape(-1) for c in covs])
    e = target - prediction
    hpht = (H * p) @ H.T
    R = 0.9 * noise + 0.1 * (torch.outer(e, e) + hpht)
    K = (p[:, None] * H.T) @ torch.linalg.pinv(hpht + R, hermitian=True)
    theta = K @ e
    p_new = p - (K * H.T).sum(1) * p

    loko_update(params, jacobians, covs, prediction, target, noise, step, beta=0.9, r_estimator="taylor")
    torch.testing.assert_close(torch.cat([q.reshape(-1) for q in params]), theta, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(torch.cat([c.reshape(-1) for c in covs]), p_new, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(noise, R, rtol=1e-10, atol=1e-14)


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
