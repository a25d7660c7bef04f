r"""LoFi: the natural-gradient filter with a low-rank plus diagonal precision (Chang et al. 2023).

Not the paper's update. The observation is :class:`~loko_lightning.kalman.filters.information.FisherRows`', by
default with the exact Fisher (``m + 1`` rows: :math:`d = J_z^\top e` and the factors :math:`f_r = J_z^\top a_r`,
:math:`\sum_r f_r f_r^\top = F`; ``fisher="empirical"``: one row, :math:`d` itself is the only factor, :math:`F
\approx d d^\top`), and the filter keeps the precision :math:`\Lambda = \mathrm{diag}(\upsilon) + W W^\top` with
``W`` of ``rank`` columns. With :math:`\tilde W = [W, f_{b,r}]` (``n x (L + B m)``, or ``n x (L + B)``) and
:math:`u = 1/\upsilon_{k|k-1}`:

.. math::

    \tilde\theta_k = \tilde\theta_{k-1} + u \odot d - u \odot \tilde W (I + \tilde W^\top (u \odot
    \tilde W))^{-1} \tilde W^\top (u \odot d), \qquad d = \sum_b d_b

(Woodbury: one ``(rank + B m)``-square solve), then the eigendecomposition :math:`\tilde W^\top \tilde W = U \Sigma
U^\top` gives :math:`\tilde W U` (the left singular vectors times the singular values): the ``L`` leading columns
are the new ``W``, the squares of the others are added to :math:`\upsilon`, so :math:`\Lambda`'s diagonal is kept
exactly. :math:`\upsilon_0 = 1/\hat p_0`; the process noise ``q`` acts on the diagonal (:math:`\upsilon \leftarrow
1/(1/\upsilon + q)`); inflation and forgetting also scale ``W``, by :math:`\sqrt{(1 - \gamma)/(1 + \alpha)}`.

Cost per step: the reverse rows of the Fisher and :math:`O(n (\text{rank} + m)^2)` (empirical: :math:`O(n
(\text{rank} + 1)^2)`, whatever ``m``). Memory: ``rank`` more copies of the adapted parameters. Its float64
specification is :func:`loko_lightning.kalman.reference.lofi_step_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters.base import Belief, Evidence, Filter, Proposal, Reduce
from loko_lightning.kalman.filters.information import FisherRows, categorical_rows, check_fisher
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.observation import Observation

__all__ = ["LowRankPrecision"]


@dataclass(frozen=True)
class LowRankPrecision(Filter):
    """LoFi (the module's equations).

    Args:
        rank: the columns ``L`` of the low-rank factor ``W``, an int >= 1.
        fisher: ``"exact"`` (``m + 1`` reverse rows, the default), ``"empirical"`` (one) or ``"sampled"`` (two:
            the gradient and one sampled label's factor, the exact Fisher in expectation).
    """

    name: ClassVar[str] = "lofi"
    # W couples every parameter, which the sharded update does not split.
    shardable: ClassVar[bool] = False

    rank: int = 10
    fisher: str = "exact"

    def __post_init__(self) -> None:
        check_fisher(self.fisher, type(self))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(
                f"Invalid rank: {self.rank!r} (the columns of the low-rank precision, an int >= 1; e.g. lofi10)",
                field="filter",
                owner=type(self),
            )

    @property
    def spec(self) -> str:
        """``"lofi<rank>"`` (exact Fisher), ``"lofi<rank>_empirical"`` or ``"lofi<rank>_sampled"``."""
        return f"lofi{self.rank}" + ("" if self.fisher == "exact" else f"_{self.fisher}")

    def observation_for(self, observation: Observation) -> Observation:
        """:class:`FisherRows` of this filter's ``fisher`` (the observation must be ``softmax``)."""
        return categorical_rows(observation, self.fisher, type(self))

    def r_estimators(self, observation: Observation) -> tuple[str, ...]:
        """``("softmax",)``: the categorical noise."""
        return FisherRows.r_estimators

    def entries(self) -> dict[str, int]:
        """``{"W": rank}``: the low-rank factor of the precision, ``(numel, rank)`` per parameter (zeros at first)."""
        return {"W": self.rank}

    def propose(self, plan: UpdatePlan, evidence: Evidence, belief: Belief, reduce: Reduce | None = None) -> Proposal:
        """The update (into :attr:`UpdatePlan.update`), ``1/υ_k`` and ``W_k`` without writing any state."""
        dtype, n = plan.dtype, plan.n
        low_rank = belief.entries["W"]
        prior = plan.time.prior(belief.cov)
        innovation = evidence.target.to(dtype) - evidence.prediction.to(dtype)
        rows = plan.rows_matrix(evidence.blocks).view(plan.samples, plan.m // plan.samples, n)
        update = plan.update
        direction = rows[:, 0].sum(0)
        rank = low_rank.shape[1]
        factors = rows[:, :1] if rows.shape[1] == 1 else rows[:, 1:]  # the empirical Fisher: d_b is the factor
        # (sampled: rows[:, 1:] is the one factor of the drawn label)
        wide = torch.cat([low_rank, factors.reshape(-1, n).T], dim=1)  # n x (L + B m), or n x (L + B)
        finite = torch.isfinite(innovation).all() & torch.isfinite(wide.sum())
        wide = torch.where(finite, wide, 0.0)
        scaled = prior[:, None] * wide
        inner = torch.eye(wide.shape[1], dtype=dtype, device=plan.device) + wide.T @ scaled
        v = prior * direction
        torch.sub(v, scaled @ torch.linalg.solve(inner, wide.T @ v), out=update)
        gram = wide.T @ wide
        _, vectors = torch.linalg.eigh(
            torch.where(finite, gram, torch.eye(gram.shape[0], dtype=dtype, device=plan.device))
        )
        rotated = wide @ vectors  # ascending: the last L columns are the leading directions
        dropped = rotated[:, : rotated.shape[1] - rank].square().sum(1)
        posterior = plan.work
        torch.reciprocal(prior, out=posterior).add_(dropped).reciprocal_()
        kept = rotated[:, rotated.shape[1] - rank :]
        plan.time.covariance(posterior)
        kept = plan.time.low_rank(kept)
        return Proposal(posterior=posterior, finite=finite, innovation=innovation, entries={"W": kept})
