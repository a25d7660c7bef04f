"""The covariance filter's ``softmax_noise`` (not the paper): ``diag(ŷ) − ŷ ŷᵀ`` added to the noise in ``S``.

Held to the dense float64 references (the diagonal filter with and without the prior's scale set online, the shared
head rows one sample and joint), which add the blocks to ``S`` and to the prior scale's ``S`` but not to ``R_k``; a
filter without it beside goes elsewhere, so the references can tell the two apart.
"""

import copy

import pytest
import torch
from loko_helpers import DenseModelFilter, assert_matches_dense, flat_cov, loko_closure, mlp, teacher_stream
from test_covariance_filter import step_beside
from test_multistream import batch_closure, batches
from test_shared_rows import SharedRowsReference, assert_matches, mlp_optimizer

from loko_lightning import LoKO
from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import get_filter
from loko_lightning.kalman.noise import softmax_covariance

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_blocks_are_each_samples_categorical_covariance():
    """``B = 2``: each block ``diag(ŷ_b) − ŷ_b ŷ_bᵀ`` (rows sum to 0), zeros off the blocks."""
    y = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64)
    blocks = softmax_covariance(y.reshape(-1), 2)
    for b in range(2):
        want = torch.diag(y[b]) - torch.outer(y[b], y[b])
        assert torch.equal(blocks[3 * b : 3 * b + 3, 3 * b : 3 * b + 3], want)
    assert torch.equal(blocks[:3, 3:], torch.zeros(3, 3, dtype=torch.float64))
    assert blocks.sum(1).abs().max() < 1e-15
    assert torch.equal(softmax_covariance(y[0]), torch.diag(y[0]) - torch.outer(y[0], y[0]))


@pytest.mark.parametrize("rate", [0.0, 0.03])
def test_diagonal_filter_matches_float64_reference(rate):
    """120 samples with ``softmax_noise`` (and the prior's scale set online at ``η`` 0.03) against the reference."""
    model = mlp()
    settings = {"name": "covariance", "beta": 0.9, "debias": True, "prior_scale_rate": rate, "softmax_noise": True}
    opt = LoKO(model.parameters(), p0=3.0, seed=3, filter=settings)
    p0 = flat_cov(opt, model.parameters())
    reference = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", debias=True,
                                 prior_scale_rate=rate, softmax_noise=True)  # fmt: skip
    without = DenseModelFilter(copy.deepcopy(model), p0, beta=0.9, r_estimator="taylor", debias=True,
                               prior_scale_rate=rate)  # fmt: skip
    step_beside(model, opt, reference, without)
    theta = assert_matches_dense(model, opt, reference)
    assert (theta - without.theta).abs().max() > 1e-3
    # More noise in S: the gains are smaller, so the covariance shrank less than without it.
    assert reference.p.mean() > without.p.mean()


def test_shared_head_rows_match_the_dense_reference_one_sample_and_joint():
    """The head's rows sharing ``Σ``, with the prior's scale set online: one sample and ``B = 3`` joint steps."""
    settings = {"name": "covariance", "beta": 0.9, "debias": True, "prior_scale_rate": 0.1, "softmax_noise": True}
    options = {"beta": 0.9, "debias": True, "prior_scale_rate": 0.1, "softmax_noise": True}
    model = mlp()
    opt = mlp_optimizer(model, p0=3.0, filter=settings)
    reference = SharedRowsReference(model, opt, shared=[2])
    for x, y in teacher_stream(40):
        y_ref = reference.step([x], [y], **options)[0]
        y_fast, _, _ = opt.step(loko_closure(model, x, y, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert_matches(model, opt, reference, shared=[2])
    model = mlp()
    opt = mlp_optimizer(model, p0=3.0, filter=settings)
    reference = SharedRowsReference(model, opt, shared=[2])
    for xs, ys in batches(teacher_stream(60), 3):
        y_ref = reference.step(xs, ys, **options)
        y_fast, _, _ = opt.step(batch_closure(model, xs, ys, factorize=True))
        torch.testing.assert_close(y_fast, y_ref, rtol=1e-9, atol=1e-12)
    assert_matches(model, opt, reference, shared=[2])


def test_it_is_a_filter_setting_checked_and_kept():
    """It round-trips through the filter's config (a checkpoint rebuilds it), is off by default (the paper), and a
    bad value or an observation that is not the softmax's is refused, naming the field."""
    config = get_filter({"name": "covariance", "softmax_noise": True}).config()
    assert config["softmax_noise"] is True and get_filter(config) == get_filter(config)
    assert get_filter("covariance").softmax_noise is False
    with pytest.raises(ConfigError, match=r"Invalid softmax_noise: 'yes' \(must be true or false\)"):
        LoKO(mlp().parameters(), filter={"name": "covariance", "softmax_noise": "yes"})
    for observation in ("topk2", "regression"):
        with pytest.raises(ConfigError, match=r"Invalid softmax_noise: true with the .* observation.*softmax"):
            LoKO(mlp().parameters(), observation=observation, filter={"name": "covariance", "softmax_noise": True})
