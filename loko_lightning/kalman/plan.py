"""The layout of one update: the parameters in one flat order, the Jacobian blocks by kind, and writing a step.

Notation follows the paper: ``H`` is the ``m x ñ`` Jacobian of the prediction ``ŷ`` with respect to the trainable
parameters ``θ̃``, ``p̂`` the diagonal of the covariance ``P``. A Jacobian block is dense ``(m, *param.shape)``, an
:class:`~loko_lightning.OuterJacobian` or a :class:`~loko_lightning.FactoredJacobian`; the update never
materialises a factored block: every product it needs has a closed form in the factors
(:mod:`loko_lightning.kalman.algebra`, one class per kind). Dense blocks are treated as one ``m x n`` matrix (without
a copy when they come from :func:`loko_lightning.jacobian`, which lays them out side by side in one buffer).

An :class:`UpdatePlan` depends only on the layout (the kinds and shapes of the blocks, the time updates), so the
optimizer builds one per layout and every filter (:mod:`loko_lightning.kalman.filters`) works on its flat vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.algebra import Blocks, DenseBlocks, FactoredBlocks, OuterBlocks
from loko_lightning.kalman.shared_rows import SharedRowBlocks
from loko_lightning.kalman.time_update import CompiledTimeUpdate, TimeUpdate

__all__ = ["UpdatePlan", "innovation_covariance"]


def innovation_covariance(jacobians: Sequence[JacobianBlock], covs: Sequence[Tensor]) -> Tensor:
    """``H P Hᵀ`` summed over parameter blocks (``P`` diagonal, one ``cov`` per parameter).

    Args:
        jacobians: per-parameter Jacobians, dense ``(m, *shape)``, :class:`OuterJacobian` or
            :class:`FactoredJacobian`.
        covs: per-parameter diagonal covariances ``p̂``, each of the parameter's shape.

    Returns:
        The ``m x m`` matrix ``H P Hᵀ``.
    """
    if not jacobians:
        raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
    plan = UpdatePlan(jacobians, [c.shape for c in covs], covs[0].dtype, covs[0].device)
    return plan.hpht(jacobians, plan.flatten(covs))


class UpdatePlan:
    """The part of an update that depends only on the layout of the Jacobian, computed once per layout.

    Parameters are put in one flat order: dense blocks first (together they are one ``(m, n)`` matrix ``H``),
    then blocks with one position (``k = 1``, :class:`OuterJacobian`-like), then factored blocks with ``k > 1``,
    each kind grouped by shape so that a group is processed by batched products (factored groups ordered by ``k``:
    their left factors are one matrix, and the products on them run once per ``k``). Each kind's algebra lives
    in one object (:attr:`kinds`, see :mod:`loko_lightning.kalman.algebra`). Everything elementwise (``p̂``, the
    gain, the covariance update) runs on flat vectors in that order. :class:`~loko_lightning.LoKO` keeps ``p̂`` in
    such a flat vector (the per-parameter state tensors are views of it) and reuses one plan while the layout
    does not change, so a step does no planning, no concatenation of ``p̂`` and no copy back.

    Args:
        jacobians: one block per parameter (only the kinds and shapes are used).
        shapes: the parameters' shapes.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
        samples: ``B``, the number of samples the ``m`` rows of the blocks stack (the multistream update):
            ``m / B`` outputs each, with a block-diagonal ``R``. 1: the paper's single observation.
        time_updates: one :class:`~loko_lightning.kalman.time_update.TimeUpdate` per parameter (default: none, the
            paper's identity process model), compiled into :attr:`time`.
        shared_rows: one flag per parameter: its rows share one full covariance (:attr:`rows`, last in the flat
            order; not the paper). Default: none, every parameter diagonal.
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device,
        samples: int = 1,
        time_updates: Sequence[TimeUpdate] | None = None,
        shared_rows: Sequence[bool] | None = None,
    ) -> None:
        if not jacobians:
            raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
        self.dtype, self.device = dtype, device
        self.m = m = jacobians[0].shape[0]
        if samples < 1 or m % samples:
            raise ValueError(f"Invalid samples: {samples} (must be >= 1 and divide the {m} rows of the Jacobian)")
        self.samples = samples
        self.shapes = [torch.Size(s) for s in shapes]
        shared = frozenset(i for i, flag in enumerate(shared_rows or ()) if flag)
        self.dense = DenseBlocks(jacobians, self.shapes, m, dtype, device, exclude=shared)
        self.outer = OuterBlocks(jacobians, self.dense.end, m, dtype, device, exclude=shared)
        self.factored = FactoredBlocks(jacobians, self.outer.end, m, dtype, device, exclude=shared)
        #: The kinds whose update is ``p̂ ⊙ Hᵀ w`` (every filter's).
        self.kinds: list[Blocks] = [kind for kind in (self.dense, self.outer, self.factored) if kind]
        #: The parameters whose rows share one full covariance (the covariance filter's option), last in the order.
        self.rows = SharedRowBlocks(jacobians, self.shapes, sorted(shared), self.factored.end, m, dtype, device)
        self.order = [i for kind in self.kinds for i in kind.order] + self.rows.order
        self.n = self.rows.end
        numels = [s.numel() for s in self.shapes]
        self.offsets = [0] * len(numels)
        position = 0
        for i in self.order:
            self.offsets[i] = position
            position += numels[i]
        if time_updates is None:
            time_updates = [TimeUpdate()] * len(numels)
        #: The time updates as per-entry factors in this plan's order.
        self.time = CompiledTimeUpdate(time_updates, self.order, numels, dtype, device)
        # The shared rows' process noise is added to Σ (q I on every row's block), not to their entries of p̂.
        self.rows.process_noise = [float(time_updates[i].process_noise) for i in self.rows.order]
        # Work vectors of every step: the update (K e, or the information form's) and a second one (the new p̂).
        self._update = torch.empty(self.n, dtype=dtype, device=device)
        self._quad = torch.empty(self.n, dtype=dtype, device=device)
        self._update_views = self.views(self._update)
        # Constants of every step.
        self.eye = torch.eye(m, dtype=dtype, device=device)
        self.one = torch.ones((), dtype=dtype, device=device)
        self.zero = torch.zeros((), dtype=dtype, device=device)

    @property
    def update(self) -> Tensor:
        """The work vector holding the proposed update (this plan's order), the applied one after :meth:`apply`."""
        return self._update

    @property
    def work(self) -> Tensor:
        """The second work vector of a step (a filter proposes the new ``p̂`` in it)."""
        return self._quad

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat vector in this plan's order, shaped like the parameters, in parameter order."""
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)]

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """One flat vector (in this plan's order and dtype) from per-parameter tensors (in parameter order)."""
        return torch.cat([tensors[i].reshape(-1).to(device=self.device, dtype=self.dtype) for i in self.order])

    def flatten_rows(self, blocks: Sequence[Tensor]) -> Tensor:
        """One ``(n, L)`` tensor in this plan's order from per-parameter ``(numel, L)`` blocks (LoFi's ``W``)."""
        return torch.cat([blocks[i].to(self.dtype) for i in self.order])

    def scatter_rows(self, flat: Tensor, blocks: Sequence[Tensor]) -> None:
        """Copy a flat ``(n, L)`` tensor (this plan's order) back into the per-parameter blocks, in parameter order."""
        for block, start in zip(blocks, self.offsets, strict=True):
            block.copy_(flat[start : start + block.shape[0]])

    def hpht(self, jacobians: Sequence[JacobianBlock], prior: Tensor) -> Tensor:
        """``H P Hᵀ`` for ``p̂ = prior`` (flat, this plan's order): the sum of every kind's term."""
        terms = [kind.hpht(jacobians, prior) for kind in self.kinds]
        if not terms:  # every parameter shares its rows' covariance (the filter adds that term)
            return torch.zeros(self.m, self.m, dtype=self.dtype, device=self.device)
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)

    def rows_matrix(self, jacobians: Sequence[JacobianBlock]) -> Tensor:
        """``H`` as one ``(rows, n)`` matrix in this plan's order (factored blocks multiplied out)."""
        parts = [self.dense.matrix(jacobians).to(self.dtype)] if self.dense else []
        for kind in (self.outer, self.factored, self.rows):
            parts += [_dense(jacobians[i]).reshape(self.m, -1).to(self.dtype) for i in kind.order]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def apply(self, params: Sequence[Tensor], cov: Tensor, posterior: Tensor, finite: Tensor) -> Tensor:
        """Write the new ``p̂`` into ``cov`` and add :attr:`update` to ``params``, unless anything is non-finite.

        The shrinkage time update scales the parameters first (on applied steps only). Returns whether the step was
        applied (a NaN or Inf anywhere makes a sum non-finite; so does an overflowing sum, skipped too). The decision
        is made on the device with :func:`torch.where`: no host sync.
        """
        update = self._update
        applied = finite & torch.isfinite(update.sum() + posterior.sum())
        torch.where(applied, update, self.zero, out=update)
        torch.where(applied, posterior, cov, out=cov)
        keep = self.time.keep
        if keep is not None:  # θ̃ ← (1 − λ)(θ̃ + K e): the shrinkage time update, on applied steps only
            keep = torch.where(applied, keep, self.one)
            update.mul_(keep)
            factors = self.views(keep) if keep.dim() else [keep] * len(params)
            for param, factor in zip(params, factors, strict=True):
                param.mul_(factor.to(param.dtype))
        if all(p.dtype == self.dtype for p in params):
            torch._foreach_add_(list(params), self._update_views)
        else:
            for param, d in zip(params, self._update_views, strict=True):
                param.add_(d.to(param.dtype))
        return applied

    def statistics(self, cov: Tensor) -> dict[str, Tensor]:
        """``p_mean``, ``p_min``, ``p_max`` of the flat ``p̂`` ``cov`` and ``gain_norm`` of the last update."""
        p_min, p_max = torch.aminmax(cov)
        return {
            "p_mean": cov.sum() / cov.numel(),
            "p_min": p_min,
            "p_max": p_max,
            "gain_norm": torch.linalg.vector_norm(self._update),
        }


def _dense(block: JacobianBlock) -> Tensor:
    return block if isinstance(block, Tensor) else block.to_dense()
