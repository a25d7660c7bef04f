"""Joint updates on B samples (the multistream EKF) against the dense float64 stacked reference, and its edge cases."""

import copy
import sys

import pytest
import torch
from loko_helpers import RTOL, SmallConvNet, conv_stream, flat_cov, mlp, teacher_stream
from torch import nn
from torch.func import functional_call, jacrev

from loko_lightning import LoKO, OuterJacobian, jacobian
from loko_lightning.jacobians.blocks import FactoredJacobian
from loko_lightning.kalman.noise import R_ESTIMATORS
from loko_lightning.kalman.reference import loko_step_reference_batch
from loko_lightning.kalman.time_update import TimeUpdate

ESTIMATORS = list(R_ESTIMATORS)


def stack_blocks(per_sample):
    """Per-sample Jacobian blocks (lists, one per sample) as batched blocks with a leading batch dimension."""
    batched = []
    for blocks in zip(*per_sample, strict=True):
        first = blocks[0]
        if isinstance(first, OuterJacobian):
            batched.append(OuterJacobian(torch.stack([b.left for b in blocks]), torch.stack([b.right for b in blocks])))
        elif isinstance(first, FactoredJacobian):
            left, right = torch.stack([b.left for b in blocks]), torch.stack([b.right for b in blocks])
            batched.append(FactoredJacobian(left, right, first.param_shape))
        else:
            batched.append(torch.stack(list(blocks)))
    return batched


def batch_closure(model, xs, ys, **kwargs):
    """The closure of a batch, built from single-sample Jacobians (independent of the engine's batched pass)."""

    def closure():
        results = [jacobian(model, x, **kwargs) for x in xs]
        return torch.stack([r[0] for r in results]), torch.stack(ys), stack_blocks([r[1] for r in results])

    return closure


class StackedDenseFilter:
    """Joint LoKO steps the slow way: θ̃ a float64 vector, each sample's H from ``jacrev``, the stacked reference."""

    def __init__(self, model, p0, *, beta, r_estimator, process_noise=0.0):
        self.time_update = TimeUpdate(process_noise=process_noise)
        self.model = model
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.shapes = [n for n, _ in trainable], [p.shape for _, p in trainable]
        self.theta = torch.cat([p.detach().reshape(-1) for _, p in trainable]).double()
        self.p, self.R, self.k = p0.double().clone(), None, 0
        self.beta, self.r_estimator, self.q = beta, r_estimator, process_noise

    def predict(self, theta, x):
        params, start = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            params[name] = theta[start : start + shape.numel()].reshape(shape)
            start += shape.numel()
        return torch.softmax(functional_call(self.model, params, (x,)).reshape(-1), 0)

    def step(self, xs, ys):
        self.k += 1
        xs = [x.double() for x in xs]
        y_hat = torch.stack([self.predict(self.theta, x) for x in xs])
        H = torch.stack([jacrev(self.predict)(self.theta, x) for x in xs])
        B, m = y_hat.shape
        if self.R is None:
            self.R = torch.zeros(m, m, dtype=torch.float64)
        p_prior = self.p + self.q
        self.theta, self.p, self.R = loko_step_reference_batch(
            self.theta, self.p, self.R, H, y_hat, torch.stack(ys).double(), self.k,
            beta=self.beta, r_estimator=self.r_estimator, rcond=RTOL, time_update=self.time_update,
        )  # fmt: skip
        # The cut-off must sit in an empty gap of S's spectrum; with softmax outputs and an R whose blocks have the
        # all-ones null vector (every estimator but identity and decay), S has exactly B null directions.
        Hs = H.reshape(B * m, -1)
        blocks = [self.R] * B if self.r_estimator != "softmax" else [
            torch.diag(y) - torch.outer(y, y) for y in y_hat
        ]  # fmt: skip
        eig = torch.linalg.eigvalsh((Hs * p_prior) @ Hs.T + torch.block_diag(*blocks))
        rel = eig.abs() / eig.abs().max()
        assert not ((rel > 1e-13) & (rel < 1e-7)).any(), f"no clean spectral gap: {rel}"
        null = int((rel <= 1e-13).sum())
        assert null == (0 if self.r_estimator in ("identity", "decay") else B), (null, B)
        return y_hat


def batches(stream, size):
    items = list(stream)
    for start in range(0, len(items) - size + 1, size):
        chunk = items[start : start + size]
        yield [x for x, _ in chunk], [y for _, y in chunk]


@pytest.mark.parametrize("r_estimator", ESTIMATORS)
def test_joint_update_matches_float64_stacked_reference(r_estimator):
    """B = 3, float64: the fast joint update equals the dense stacked reference over 40 joint steps (120 samples)."""
    model = mlp()
    opt = LoKO(
        model.parameters(),
        p0=0.3,
        seed=3,
        filter={"name": "covariance", "beta": 0.9, "r_estimator": r_estimator},
        time_update={"process_noise": 1e-4},
    )
    reference = StackedDenseFilter(
        copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator=r_estimator, process_noise=1e-4
    )
    for xs, ys in batches(teacher_stream(120), 3):
        y_ref = reference.step(xs, ys)
        y_fast, _, _ = opt.step(batch_closure(model, xs, ys, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert opt.diagnostics["step"].item() == 40
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # The same float64 arithmetic in another order, as for B = 1 (test_covariance_filter): accumulated relative error
    # near 1e-13 after 40 contracting steps, so 1e-9 leaves room without hiding an algorithmic difference.
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat_cov(opt, model.parameters()), reference.p, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(opt.state[next(model.parameters())]["R"], reference.R, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("r_estimator", ["taylor", "softmax"])
def test_factored_batches_match_float64_stacked_reference(r_estimator, monkeypatch):
    """Every block kind in a batch (factored k > 1 and k = 1, outer, dense): block-diagonal factors are exact."""
    monkeypatch.setattr(sys.modules["loko_lightning.jacobians.reverse"], "factored_is_cheaper", lambda *args: True)
    monkeypatch.setattr(sys.modules["loko_lightning.jacobians.blocks"], "factored_is_cheaper", lambda *args: True)
    torch.manual_seed(3)
    model = SmallConvNet().double()
    opt = LoKO(
        model.parameters(), p0=0.3, seed=3, filter={"name": "covariance", "beta": 0.9, "r_estimator": r_estimator}
    )
    reference = StackedDenseFilter(
        copy.deepcopy(model), flat_cov(opt, model.parameters()), beta=0.9, r_estimator=r_estimator
    )
    kinds = set()
    for xs, ys in batches(conv_stream(40), 4):
        y_ref = reference.step(xs, ys)
        y_fast, _, jacs = opt.step(batch_closure(model, xs, ys, factorize=True))
        kinds |= {type(j).__name__ for j in jacs}
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert kinds == {"FactoredJacobian", "OuterJacobian", "Tensor"}
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat_cov(opt, model.parameters()), reference.p, rtol=1e-9, atol=1e-15)


def test_dense_and_factored_stacking_agree(monkeypatch):
    """The stacking's choice between block-diagonal factors and dense blocks changes only rounding."""
    torch.manual_seed(4)
    model = SmallConvNet().double()
    models = [copy.deepcopy(model) for _ in range(2)]
    opts = [LoKO(m.parameters(), seed=0) for m in models]
    stacking = sys.modules["loko_lightning.jacobians.blocks"]
    for xs, ys in batches(conv_stream(12), 3):
        for choice, net, opt in zip((True, False), models, opts, strict=True):
            monkeypatch.setattr(stacking, "factored_is_cheaper", lambda *args, choice=choice: choice)
            opt.step(batch_closure(net, xs, ys, factorize=True))
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(opts[0].state[p]["cov"], opts[1].state[q]["cov"], rtol=1e-10, atol=1e-15)


def test_float32_joint_step_matches_float64_reference():
    """One float32 joint step of B = 4 from the state of the float64 reference: error at the level of cond(S)·eps32."""
    model64 = mlp()
    model32 = copy.deepcopy(model64).float()
    opt32 = LoKO(model32.parameters(), p0=0.2, seed=0)
    reference = StackedDenseFilter(
        copy.deepcopy(model64), flat_cov(opt32, model32.parameters()), beta=0.95, r_estimator="taylor"
    )
    xs, ys = next(batches(teacher_stream(4), 4))
    reference.step(xs, ys)
    opt32.step(batch_closure(model32, [x.float() for x in xs], [y.float() for y in ys]))
    cond = opt32.diagnostics["cond"].item()
    assert cond < 1e3
    theta32 = torch.cat([p.detach().reshape(-1) for p in model32.parameters()]).double()
    delta_ref = reference.theta - torch.cat([p.detach().reshape(-1) for p in model64.parameters()])
    # A float32 solve has relative error ~ cond(S)·eps32; x10 for the sums over ñ = 78 terms and B·m = 16 rows.
    bound = 10 * cond * torch.finfo(torch.float32).eps
    err = (theta32 - reference.theta).abs().max() / delta_ref.abs().max()
    assert err < bound, (err, bound)


@pytest.mark.parametrize("factorize", [False, True])
def test_batch_of_one_is_the_single_sample_step_bit_for_bit(factorize):
    """B = 1 through the batch path: parameters, p̂, R and the step counter equal to the last bit (float32)."""
    torch.manual_seed(5)
    model = SmallConvNet()
    single, batched = model, copy.deepcopy(model)
    opt_single, opt_batched = LoKO(single.parameters(), seed=1), LoKO(batched.parameters(), seed=1)
    for x, y in conv_stream(15):
        x, y = x.float(), y.float()

        def closure(x=x, y=y):
            prediction, jacs = jacobian(single, x, factorize=factorize)
            return prediction, y, jacs

        opt_single.step(closure)
        opt_batched.step(batch_closure(batched, [x], [y], factorize=factorize))
    for p, q in zip(single.parameters(), batched.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt_single.state[p]["cov"], opt_batched.state[q]["cov"])
    first, first_b = next(single.parameters()), next(batched.parameters())
    for key in ("R", "step", "skipped"):
        assert torch.equal(opt_single.state[first][key], opt_batched.state[first_b][key])


@pytest.mark.parametrize("r_estimator", ["identity", "softmax"])
def test_samples_on_disjoint_parameters_equal_sequential_updates(r_estimator):
    """Sample 1 sees only parameter a, sample 2 only b: H P Hᵀ and S are block-diagonal, so the joint gain splits
    into the two single-sample gains. With an R that has no memory across samples the joint update equals the two
    updates one after the other (the EMA estimators differ by construction: one EMA step against two)."""
    gen = torch.Generator().manual_seed(0)
    m, n_a, n_b = 4, 6, 5

    def observation(n):
        jac = torch.randn(m, n, generator=gen, dtype=torch.float64)
        prediction = torch.softmax(torch.randn(m, generator=gen, dtype=torch.float64), 0)
        return jac - jac.mean(0), prediction, nn.functional.one_hot(torch.tensor(1), m).double()

    (h_a, y_hat_a, y_a), (h_b, y_hat_b, y_b) = observation(n_a), observation(n_b)
    zeros_a, zeros_b = torch.zeros(m, n_a, dtype=torch.float64), torch.zeros(m, n_b, dtype=torch.float64)
    params = [nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (n_a, n_b, n_a, n_b)]
    joint = LoKO(params[:2], p0=0.5, seed=2, filter={"name": "covariance", "r_estimator": r_estimator})
    sequential = LoKO(params[2:], p0=0.5, seed=2, filter={"name": "covariance", "r_estimator": r_estimator})
    joint.step(lambda: (
        torch.stack([y_hat_a, y_hat_b]), torch.stack([y_a, y_b]),
        [torch.stack([h_a, zeros_a]), torch.stack([zeros_b, h_b])],
    ))  # fmt: skip
    sequential.step(lambda: (y_hat_a, y_a, [h_a, zeros_b]))
    sequential.step(lambda: (y_hat_b, y_b, [zeros_a, h_b]))
    assert params[0].abs().max() > 1e-3 and params[1].abs().max() > 1e-3  # both samples moved their parameter
    # Both sides do float64 arithmetic in another order (one 8 x 8 pseudo-inverse against two 4 x 4 ones).
    for p, q in zip(params[:2], params[2:], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(joint.state[p]["cov"], sequential.state[q]["cov"], rtol=1e-10, atol=1e-15)


def test_joint_update_is_not_sequential_when_samples_share_parameters():
    """The same two samples jointly and one after the other differ (diagonal P, shared parameters)."""
    xs, ys = next(batches(teacher_stream(2), 2))
    joint_model, seq_model = mlp(), mlp()
    joint, seq = LoKO(joint_model.parameters(), seed=0), LoKO(seq_model.parameters(), seed=0)
    joint.step(batch_closure(joint_model, xs, ys))
    for x, y in zip(xs, ys, strict=True):
        seq.step(batch_closure(seq_model, [x], [y]))
    pairs = zip(joint_model.parameters(), seq_model.parameters(), strict=True)
    diff = max((p - q).abs().max().item() for p, q in pairs)
    assert diff > 1e-6


def test_batch_shape_errors_name_expected_and_got():
    model = mlp(dtype=torch.float32)
    opt = LoKO(model.parameters(), seed=0)
    xs, ys = next(batches(teacher_stream(2, dtype=torch.float32), 2))
    prediction, target, jacs = batch_closure(model, xs, ys)()
    with pytest.raises(ValueError, match=r"Invalid target: expected shape \(2, 4\) like the prediction, got \(3, 4\)"):
        opt.step(lambda: (prediction, torch.cat([target, target[:1]]), jacs))
    bad = [jacs[0][:1], *jacs[1:]]
    expected = r"Invalid jacobians\[0\]: expected shape \(2, 4, 7, 5\) \(a batch of 2\), got \(1, 4, 7, 5\)"
    with pytest.raises(ValueError, match=expected):
        opt.step(lambda: (prediction, target, bad))
    with pytest.raises(ValueError, match=r"Invalid jacobians: expected 4 \(one per parameter\), got 3"):
        opt.step(lambda: (prediction, target, jacs[:3]))
    single = [j[0] for j in jacs]  # single-sample blocks with a batched prediction
    with pytest.raises(ValueError, match=r"Invalid jacobians\[0\]: expected shape \(2, 4, 7, 5\)"):
        opt.step(lambda: (prediction, target, single))
    assert opt.diagnostics == {}  # nothing was applied
    opt.step(lambda: (prediction, target, jacs))
    # A batch keeps R the noise of one sample: a later single-sample step with the same m continues it.
    assert opt.state[next(model.parameters())]["R"].shape == (4, 4)
    opt.step(batch_closure(model, xs[:1], ys[:1]))
    assert opt.diagnostics["step"].item() == 2
