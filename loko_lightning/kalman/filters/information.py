r"""The diagonal natural-gradient filter: the categorical observation noise, in information form.

Not the paper's update. The observation is the paper's (class probabilities :math:`\hat y = \mathrm{softmax}(z)`),
with the categorical noise :math:`R = \mathrm{diag}(\hat y) - \hat y\hat y^\top` instead of an estimate. With
:math:`H = J_s J_z` (:math:`J_z = \partial z/\partial\tilde\theta` for the logits ``z``, :math:`J_s = \partial\hat
y/\partial z = R`) and :math:`e = y - \hat y` (which sums to zero, like every column of :math:`J_s`),
:math:`H^\top R^{+} e = J_z^\top e = -\nabla_{\tilde\theta}\,\mathrm{CE}` and :math:`H^\top R^{+} H = J_z^\top J_s
J_z = F`, the Fisher information of the softmax likelihood. The filter keeps the diagonal precision
:math:`\lambda = 1/\hat p`:

.. math::

    \lambda_k = \frac{1}{\hat p_{k-1} + q} + \operatorname{diag}(F_k), \qquad
    \tilde\theta_k = \tilde\theta_{k-1} + \lambda_k^{-1} \odot J_z^\top e_k

(Ollivier 2018; the diagonal EKF in information form of Chang, Jones & Murphy 2022). It needs ``rows`` reverse
rows, not ``m - 1``, and no ``m x m`` solve:

- ``fisher="empirical"`` (1 row, the default): :math:`\operatorname{diag}(F) \approx (J_z^\top e)^{\odot 2}`, the
  squared gradient of the observed label;
- ``fisher="exact"`` (``m + 1`` rows): :math:`\operatorname{diag}(F) = \sum_r (J_z^\top a_r)^{\odot 2}` with
  :math:`a_r = \sqrt{\hat y_r}(u_r - \hat y)` (:math:`\sum_r a_r a_r^\top = J_s`, :math:`u_r` the unit vectors);
- ``fisher="sampled"`` (2 rows): :math:`\operatorname{diag}(F) \approx (J_z^\top (u_s - \hat y))^{\odot 2}` with
  a label :math:`s \sim \mathrm{Cat}(\hat y)` drawn from the prediction (the Monte Carlo Fisher of K-FAC, Martens &
  Grosse 2015): :math:`\mathbb E_s[(u_s - \hat y)(u_s - \hat y)^\top] = J_s`, so it is the exact Fisher in
  expectation, where the empirical one (the observed label's gradient) is biased (Kunstner et al. 2019).

Its float64 specification is :func:`loko_lightning.kalman.reference.natural_step_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters.base import Belief, Evidence, Filter, Proposal, Reduce
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.observation import Observation, Softmax

__all__ = ["FISHERS", "DiagonalInformation", "FisherRows", "sum_rows"]

#: What ``fisher`` of the information-form filters may be.
FISHERS = ("empirical", "exact", "sampled")


class FisherRows(Softmax):
    r"""The softmax observation with the rows of ``H`` the information-form filters read, chosen from the label.

    Row 0 is :math:`d = J_z^\top e`; with ``fisher="exact"`` rows ``1 … m`` are the factors :math:`J_z^\top a_r` of
    the Fisher (:math:`a_r = \sqrt{\hat y_r}(u_r - \hat y)`); with ``"sampled"`` row 1 is the one factor
    :math:`J_z^\top (u_s - \hat y)` of a label :math:`s` drawn from :math:`\hat y` (by inverse CDF from a uniform of
    :attr:`generator`, a CPU generator whose state the optimizer saves and restores); with ``"empirical"`` row 0 is
    the only one. The categorical noise is known, so the only ``r_estimator`` is ``"softmax"``.
    """

    r_estimators = ("softmax",)
    needs_label = True

    def __init__(self, fisher: str = "empirical", seed: int = 0) -> None:
        self.fisher = fisher
        #: The draws of ``fisher="sampled"`` (None for the others).
        self.generator = torch.Generator().manual_seed(seed) if fisher == "sampled" else None

    def rows(self, m: int) -> int:
        """1 (the gradient, whose square is the empirical Fisher), 2 (and a sampled label's) or ``m + 1``."""
        return {"empirical": 1, "sampled": 2}.get(self.fisher, m + 1)

    def reverse_rows(self, m: int) -> int:
        """As :meth:`rows`: the cotangents are chosen from the label, none follows from the others."""
        return self.rows(m)

    def draw(self, prediction: Tensor) -> Tensor:
        """A label from each row of ``prediction`` (``(..., m)`` class probabilities), by inverse CDF: ``(...)``."""
        uniform = torch.rand(prediction.shape[:-1], generator=self.generator, dtype=torch.float64)
        uniform = uniform.to(device=prediction.device, dtype=prediction.dtype)
        below = (prediction.cumsum(-1) <= uniform[..., None]).sum(-1)
        return below.clamp_(max=prediction.shape[-1] - 1)

    def cotangents(self, prediction: Tensor, target: Tensor) -> Tensor:
        """``e = y - ŷ``, then the ``m`` rows ``a_r = √ŷ_r (u_r - ŷ)`` (exact) or ``u_s - ŷ`` (sampled)."""
        rows = [target - prediction]
        if self.fisher == "exact":
            m = prediction.shape[-1]
            eye = torch.eye(m, dtype=prediction.dtype, device=prediction.device)
            roots = prediction.clamp_min(0).sqrt()
            a = roots[..., :, None] * (eye - prediction[..., None, :])  # (..., m, m): row r is a_r
            rows.extend(a.movedim(-2, 0).unbind(0))
        elif self.fisher == "sampled":
            drawn = torch.nn.functional.one_hot(self.draw(prediction), prediction.shape[-1]).to(prediction.dtype)
            rows.append(drawn - prediction)
        return torch.stack(rows)

    def __repr__(self) -> str:
        return f"FisherRows(fisher={self.fisher!r})"


def categorical_rows(observation: Observation, fisher: str, owner: type) -> FisherRows:
    """The rows an information-form filter needs for ``observation``, which must be the plain softmax one.

    Raises:
        ConfigError: another observation (``field="observation"``).
    """
    if type(observation) is not Softmax and not isinstance(observation, FisherRows):
        raise ConfigError(
            f"Invalid observation: {observation.spec!r} with filter {owner.name!r}: the information-form filters "
            "observe the class probabilities with the categorical noise, so the observation must be 'softmax' (the "
            "default); for top-k or regression observations use filter 'covariance'",
            field="observation",
            owner=owner,
        )
    return FisherRows(fisher)


def check_fisher(fisher: str, owner: type) -> None:
    """Refuse a ``fisher`` outside :data:`FISHERS`."""
    if fisher not in FISHERS:
        raise ConfigError(f"Invalid fisher: {fisher!r} (expected one of {FISHERS})", field="fisher", owner=owner)


def sum_rows(rows: Tensor, out: Tensor, square: bool = False) -> Tensor:
    """``Σ_r rows[r]`` (or of their squares) into ``out``, each entry summed in an order that depends on ``r`` only.

    Elementwise adds round every entry alike wherever its column sits, so a shard of the columns
    (:mod:`loko_lightning.kalman.sharded`) gets the same bits; a reduction kernel's order can depend on the column's
    place in the vector lanes. Up to 16 rows are added one after another; more in a pairwise tree (row ``i`` with row
    ``i + half``), ``log2`` of the rows in kernel launches.
    """
    count = rows.shape[0]
    if count <= 16:
        if square:
            torch.mul(rows[0], rows[0], out=out)
        else:
            out.copy_(rows[0])
        scratch = torch.empty_like(out) if square and count > 1 else None
        for row in rows[1:]:
            out.add_(torch.mul(row, row, out=scratch) if square else row)
        return out
    level = rows * rows if square else rows
    while level.shape[0] > 1:
        half = level.shape[0] // 2
        paired = level[:half] + level[half : 2 * half]
        if level.shape[0] % 2:
            paired[-1] += level[-1]
        level = paired
    return out.copy_(level[0])


@dataclass(frozen=True)
class DiagonalInformation(Filter):
    r"""The diagonal natural-gradient filter (the module's equations), on ``B`` samples at once.

    Each sample's rows of ``H`` are :class:`FisherRows`': row 0 the direction :math:`d_b = H_b^\top R_b^{+} e_b`, the
    other rows (row 0 itself when there is one) factors :math:`f_{b,r}` of the information
    :math:`\operatorname{diag}(H_b^\top R_b^{+} H_b) \approx \sum_r f_{b,r}^{\odot 2}`:

    .. math::

        \hat p_k = \Big(\frac{1}{\hat p_{k-1} + q} + \sum_{b,r} f_{b,r}^{\odot 2}\Big)^{-1}, \qquad
        \tilde\theta_k = \tilde\theta_{k-1} + \hat p_k \odot \sum_b d_b

    (computed as :math:`\hat p_{k|k-1} / (1 + \hat p_{k|k-1} \odot \sum f^2)`, which never divides by 0). ``R`` is
    not a filter state (the categorical noise is known). Every entry depends on its own column of ``H`` only, so a
    shard of the parameters needs only its columns.

    Args:
        fisher: ``"empirical"`` (one reverse row), ``"sampled"`` (two) or ``"exact"`` (``m + 1``).
    """

    name: ClassVar[str] = "natural"

    fisher: str = "empirical"

    def __post_init__(self) -> None:
        check_fisher(self.fisher, type(self))

    @property
    def spec(self) -> str:
        """``"natural"``, ``"natural_exact"`` or ``"natural_sampled"``."""
        return "natural" if self.fisher == "empirical" else f"natural_{self.fisher}"

    def observation_for(self, observation: Observation) -> Observation:
        """:class:`FisherRows` of this filter's ``fisher`` (the observation must be ``softmax``)."""
        return categorical_rows(observation, self.fisher, type(self))

    def r_estimators(self, observation: Observation) -> tuple[str, ...]:
        """``("softmax",)``: the categorical noise."""
        return FisherRows.r_estimators

    def propose(self, plan: UpdatePlan, evidence: Evidence, belief: Belief, reduce: Reduce | None = None) -> Proposal:
        """The update (into :attr:`UpdatePlan.update`) and ``p̂_k`` without writing any state."""
        dtype = plan.dtype
        prior = plan.time.prior(belief.cov)
        innovation = evidence.target.to(dtype) - evidence.prediction.to(dtype)
        rows = plan.rows_matrix(evidence.blocks).view(plan.samples, plan.m // plan.samples, plan.n)
        update, info = plan.update, plan.work
        factors = rows[:, 0] if rows.shape[1] == 1 else rows[:, 1:].reshape(-1, plan.n)
        sum_rows(rows[:, 0], update)
        sum_rows(factors, info, square=True)
        # p̂_k = p̂_{k|k-1} / (1 + p̂_{k|k-1} ⊙ info), the mean with the posterior p̂_k.
        posterior = info.mul_(prior).add_(plan.one).reciprocal_().mul_(prior)
        update.mul_(plan.time.floored(posterior))
        if plan.time.updates_covariance:  # the time update of p̂ after the mean used the posterior
            plan.time.covariance(posterior)
        return Proposal(posterior=posterior, finite=torch.isfinite(innovation).all(), innovation=innovation)
