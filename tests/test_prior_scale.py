"""The covariance filter's ``prior_scale_rate`` (not the paper): the prior's scale set by its predictive likelihood.

Before each update the step's prior covariance is multiplied by ``s = exp(clip(η g, ±0.5))``, ``g`` the derivative in
``log s`` of the log density of the innovation under ``N(0, s·HPHᵀ + R)``. Held to: that derivative taken by finite
differences of the density itself, and the dense float64 references of the diagonal filter and of the shared head
rows (one sample and joint steps), which scale ``P`` as a matrix.
"""

import copy
import math

import pytest
import torch
from loko_helpers import DenseModelFilter, assert_matches_dense, flat_cov, loko_closure, mlp, teacher_stream
from test_covariance_filter import step_beside
from test_multistream import batch_closure, batches
from test_shared_rows import SharedRowsReference, assert_matches, mlp_optimizer

from loko_lightning import LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import covariance as covariance_module
from loko_lightning.kalman.filters import get_filter
from loko_lightning.kalman.filters.covariance import prior_scale_gradient
from loko_lightning.kalman.reference import covariance as reference_module
from loko_lightning.kalman.reference import prior_scale_reference
from loko_lightning.kalman.shared_rows import Downdate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def scales(monkeypatch):
    """Every scale the float64 reference computes (``η > 0``), in order."""
    record = []

    def recorded(*args):
        record.append(prior_scale_reference(*args))
        return record[-1]

    monkeypatch.setattr(reference_module, "prior_scale_reference", recorded)
    return record


def _log_density_on_range(e, A, R, log_s, basis):
    """``log N(Qᵀe; 0, Qᵀ(e^{log s} A + R)Q)``, ``Q`` an orthonormal basis of the range of ``S``."""
    S = basis.T @ (torch.exp(log_s) * A + R) @ basis
    z = basis.T @ e
    return -0.5 * (z @ torch.linalg.solve(S, z) + torch.logdet(S))


@pytest.mark.parametrize("softmax", [False, True], ids=["regular S", "softmax: S singular"])
def test_gradient_is_the_derivative_of_the_innovations_log_density(softmax):
    """``g`` against a central difference of the log density in ``log s`` (float64, step 1e-5: truncation error
    ~1e-10 relative, rounding ~1e-16/1e-5 = 1e-11; 1e-7 is far above both, far below any algebraic slip)."""
    gen = torch.Generator().manual_seed(0)
    m = 5
    for _ in range(5):
        J = torch.randn(m, 8, generator=gen, dtype=torch.float64)
        noise_root = torch.randn(m, m, generator=gen, dtype=torch.float64)
        e = torch.randn(m, generator=gen, dtype=torch.float64)
        basis = torch.eye(m, dtype=torch.float64)
        if softmax:  # outputs summing to one: A, R and e orthogonal to the all-ones vector
            centre = torch.eye(m, dtype=torch.float64) - 1.0 / m
            J, noise_root, e = centre @ J, centre @ noise_root, centre @ e
            basis = torch.linalg.qr(centre)[0][:, : m - 1]
        A = J @ J.T * torch.rand((), generator=gen, dtype=torch.float64) * 10
        R = noise_root @ noise_root.T + (0 if softmax else 0.1 * torch.eye(m, dtype=torch.float64))
        h = 1e-5
        numeric = (
            _log_density_on_range(e, A, R, torch.tensor(h, dtype=torch.float64), basis)
            - _log_density_on_range(e, A, R, torch.tensor(-h, dtype=torch.float64), basis)
        ) / (2 * h)
        closed = prior_scale_gradient(A, A + R, e, rcond=1e-10)
        torch.testing.assert_close(closed, numeric, rtol=1e-7, atol=1e-9)
        # The reference (its own arithmetic) gives the same g, through its factor at a rate small enough not to clip.
        rate = 1e-3
        assert abs(prior_scale_reference(A, R, e, rate, 1e-10) - torch.exp(rate * numeric).item()) < 1e-12


def test_a_prior_too_wide_shrinks_and_one_too_narrow_grows():
    """The sign: innovations small against ``H P Hᵀ`` give ``g < 0``; large ones ``g > 0``."""
    A, R = 100.0 * torch.eye(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    assert prior_scale_gradient(A, A + R, torch.full((3,), 0.1, dtype=torch.float64)) < 0
    A = 0.01 * torch.eye(3, dtype=torch.float64)
    assert prior_scale_gradient(A, A + R, torch.full((3,), 5.0, dtype=torch.float64)) > 0


@pytest.mark.parametrize("rate", [0.03, 1.0])
def test_diagonal_filter_matches_float64_reference(rate, scales):
    """120 samples of the paper's filter with the prior's scale set online against the dense reference.

    Rate 1 takes the clip on some steps, 0.03 on none (both asserted); the paper's filter beside goes elsewhere.
    """
    model = mlp()
    settings = {"name": "covariance", "beta": 0.9, "debias": True, "prior_scale_rate": rate}
    opt = LoKO(model.parameters(), p0=3.0, seed=3, filter=settings)
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", debias=True,
                                 prior_scale_rate=rate)  # fmt: skip
    paper = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", debias=True)
    step_beside(model, opt, reference, paper)
    theta = assert_matches_dense(model, opt, reference)
    assert (theta - paper.theta).abs().max() > 1e-3
    clipped = sum(abs(abs(math.log(s)) - 0.5) < 1e-12 for s in scales if s != 1.0)
    assert (clipped > 0) == (rate == 1.0), (rate, clipped)
    # p0 3 is too wide for this stream: the rule shrank the prior below the paper's filter's.
    assert reference.p.mean() < paper.p.mean()


def test_the_scale_is_kept_after_prior_scale_until_updates(scales):
    """``prior_scale_until`` 30: the scale moves on steps 2-30 and is 1 from step 31 on (the reference's record, which
    the fast path matches); the filter then runs as the paper's from the scaled prior."""
    model = mlp()
    settings = {"name": "covariance", "beta": 0.9, "debias": True, "prior_scale_rate": 0.3, "prior_scale_until": 30}
    opt = LoKO(model.parameters(), p0=3.0, seed=3, filter=settings)
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", debias=True,
                                 prior_scale_rate=0.3, prior_scale_until=30)  # fmt: skip
    unlimited = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", debias=True,
                                 prior_scale_rate=0.3)  # fmt: skip
    step_beside(model, opt, reference, unlimited, steps=60)
    theta = assert_matches_dense(model, opt, reference)
    # The reference computed a scale on steps 2-30 for the limited filter and on steps 2-60 for the other.
    assert len(scales) == 29 + 59 and all(s != 1.0 for s in scales)
    assert (theta - unlimited.theta).abs().max() > 1e-6


def test_shared_head_rows_match_the_dense_reference_one_sample_and_joint():
    """The head's ``Σ`` scaled with ``p̂``: one sample (an outer-product block, the in-place downdate) and ``B = 3``."""
    settings = {"name": "covariance", "beta": 0.9, "debias": True, "prior_scale_rate": 0.1}
    model = mlp()
    opt = mlp_optimizer(model, p0=3.0, filter=settings)
    reference = SharedRowsReference(model, opt, shared=[2])
    for x, y in teacher_stream(40):
        y_ref = reference.step([x], [y], beta=0.9, debias=True, prior_scale_rate=0.1)[0]
        y_fast, _, jacs = opt.step(loko_closure(model, x, y, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert type(jacs[2]).__name__ == "OuterJacobian"
    assert_matches(model, opt, reference, shared=[2])
    model = mlp()
    opt = mlp_optimizer(model, p0=3.0, filter=settings)
    reference = SharedRowsReference(model, opt, shared=[2])
    for xs, ys in batches(teacher_stream(60), 3):
        y_ref = reference.step(xs, ys, beta=0.9, debias=True, prior_scale_rate=0.1)
        y_fast, _, _ = opt.step(batch_closure(model, xs, ys, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert_matches(model, opt, reference, shared=[2])


def test_the_prediction_covariance_is_the_belief_before_the_samples_scale():
    """``prediction_cov`` (what ``predictive: posterior`` averages over) is ``H P Hᵀ`` before the scale: the scale
    reads the sample's label, a prediction made before the sample must not. Step 1 (``s = 1``) leaves both filters in
    one state; at step 2 the scaled one's ``prediction_cov`` equals the unscaled one's bit for bit (the same
    arithmetic on the same state) while its update differs (the scale was taken: rate 1, clipped at ``±0.5``)."""
    stream = list(teacher_stream(2))
    model = mlp()
    scaled = mlp_optimizer(model, p0=3.0, filter={"name": "covariance", "beta": 0.9, "prior_scale_rate": 1.0})
    plain_model = copy.deepcopy(model)
    plain = mlp_optimizer(plain_model, p0=3.0, filter={"name": "covariance", "beta": 0.9})
    for x, y in stream:
        scaled.step(loko_closure(model, x, y, factorize=True))
        plain.step(loko_closure(plain_model, x, y, factorize=True))
    assert torch.equal(scaled.prediction_cov, plain.prediction_cov)
    difference = max((a - b).abs().max() for a, b in zip(model.parameters(), plain_model.parameters(), strict=True))
    assert difference > 1e-6


def _five_steps_in():
    """A scaled filter with shared head rows after five samples of a teacher stream, and the stream's sixth."""
    model = mlp()
    opt = mlp_optimizer(model, p0=3.0, filter={"name": "covariance", "prior_scale_rate": 0.1})
    stream = list(teacher_stream(6))
    for x, y in stream[:5]:
        opt.step(loko_closure(model, x, y, factorize=True))
    return model, opt, list(model.parameters()), stream[5]


def test_a_skipped_step_leaves_the_scaled_state_alone():
    """A non-finite sample: ``p̂``, ``Σ`` and ``R`` exactly as they were, though the step's scale is not finite."""
    model, opt, params, (x, y) = _five_steps_in()
    before = {k: v.clone() for k, v in [("cov", flat_cov(opt, params)), ("row_cov", opt.state[params[2]]["row_cov"]),
                                        ("R", opt.state[params[0]]["R"])]}  # fmt: skip
    opt.step(loko_closure(model, x, y * float("nan"), factorize=True))
    assert not opt.diagnostics["applied"]
    assert torch.equal(flat_cov(opt, params), before["cov"])
    assert torch.equal(opt.state[params[2]]["row_cov"], before["row_cov"])
    assert torch.equal(opt.state[params[0]]["R"], before["R"])
    sigma = before["row_cov"].clone()
    Downdate(torch.ones(sigma.shape[0], dtype=sigma.dtype), torch.tensor(float("nan"))).commit(
        sigma, torch.tensor(False)
    )
    assert torch.equal(sigma, before["row_cov"])


def test_a_scale_that_is_not_finite_skips_the_step(monkeypatch):
    """A finite sample whose prior scale is not (seen on text with ``r_estimator: softmax``: ``H P Hᵀ`` and ``R``
    collapsed to ~1e-38 and ~1e-22 in float32 and ``g`` came out NaN) is skipped like a non-finite sample, its state
    kept: it must not reach the eigendecomposition (LAPACK raised there) nor scale ``P``."""
    model, opt, params, (x, y) = _five_steps_in()

    def states():
        return [flat_cov(opt, params), opt.state[params[2]]["row_cov"], opt.state[params[0]]["R"]]

    before = [p.detach().clone() for p in params] + [state.clone() for state in states()]
    monkeypatch.setattr(covariance_module, "prior_scale_gradient", lambda *args: torch.tensor(float("nan")))
    opt.step(loko_closure(model, x, y, factorize=True))
    assert not opt.diagnostics["applied"]
    assert int(opt.diagnostics["skipped"]) == 1
    after = [p.detach() for p in params] + states()
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_rate_is_a_filter_setting_checked_and_kept():
    """It round-trips through the filter's config (a checkpoint rebuilds it); a bad value names the field."""
    config = get_filter({"name": "covariance", "prior_scale_rate": 0.03}).config()
    assert config["prior_scale_rate"] == 0.03 and get_filter(config) == get_filter(config)
    assert get_filter("covariance").prior_scale_rate == 0.0  # the paper's update by default
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match=r"Invalid prior_scale_until: .*must be a number of updates >= 0"):
            LoKO(mlp().parameters(), filter={"name": "covariance", "prior_scale_until": bad})
    for bad in (-0.1, 2.0, "fast", float("nan")):
        with pytest.raises(ConfigError, match=r"Invalid prior_scale_rate: .*must be a number in \[0, 1\]"):
            LoKO(mlp().parameters(), filter={"name": "covariance", "prior_scale_rate": bad})
    with pytest.raises(
        ConfigError, match=r"Invalid prior_scale_rate: 0.03 with the top-k observation.*observation: softmax"
    ):
        LoKO(mlp().parameters(), observation="topk2", filter={"name": "covariance", "prior_scale_rate": 0.03})
