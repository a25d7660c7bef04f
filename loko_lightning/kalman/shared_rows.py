"""The shared-row kind of the LoKO update: weights whose rows share one full covariance ``Σ``, ``P_W = I_rows ⊗ Σ``.

A param group's ``shared_rows`` (:func:`~loko_lightning.kalman.groups.group_shared_rows`) puts its matrices here
instead of among the diagonal kinds of :mod:`~loko_lightning.kalman.algebra`: their entries are not updated as
``p̂ ⊙ Hᵀ w`` but with ``Σ`` (:class:`SharedRowBlocks`), which the covariance filter calls itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from loko_lightning.jacobians.blocks import JacobianBlock

__all__ = ["Downdate", "SharedRowBlocks"]


class Downdate:
    """``Σ⁺ = s (Σ + q I) − t tᵀ``, kept as ``t`` until the filter commits it to ``Σ`` in place (one position).

    The outer product's entries ``t_i t_j = t_j t_i`` are exactly symmetric as computed, so ``Σ⁺`` stays exactly
    symmetric without a pass that averages it with its transpose. It is written in place, :attr:`ROWS` rows at a time:
    no new ``cols x cols`` tensor (for EfficientNet-Lite0's head, 1,281², the passes over ``Σ`` were most of the shared
    head's cost), and each block of ``t tᵀ`` is subtracted while it is in the CPU's cache. Each entry is
    ``Σ_ij − t_i t_j``, the product rounded then subtracted, as ``Σ − outer(t, t)`` computes it: the same bits (a fused
    ``addr_`` rounds once, other bits).
    """

    #: Rows of ``t tᵀ`` formed at a time on a CPU (a 128 x 1,281 float32 block is 0.66 MB); on a GPU all at once.
    ROWS = 128

    def __init__(self, t: Tensor, scale: Tensor | None = None, process_noise: float = 0.0) -> None:
        self.t, self.scale, self.process_noise = t, scale, process_noise

    def commit(self, sigma: Tensor, applied: Tensor) -> None:
        """``Σ ← s (Σ + q I) − t tᵀ`` where ``applied`` (0-d bool on the device, no host read); else ``Σ`` as it was.

        ``s``: the step's prior scale (the covariance filter's ``prior_scale_rate``); without one ``Σ`` is not scaled.
        ``q``: the process noise of the step's prior (the time update's ``process_noise``), on the diagonal first.
        """
        scale = None if self.scale is None else torch.where(applied, self.scale, 1.0)  # a skipped step: Σ · 1 is Σ
        t = torch.where(applied, self.t, 0.0)  # a skipped step's t may not be finite: Σ − 0 is Σ
        if self.process_noise:  # Σ + q I where applied (a skipped step: + 0), one pass over the diagonal
            sigma.diagonal().add_(applied.to(sigma.dtype), alpha=self.process_noise)  # q in Σ's dtype, not float32
        step = self.ROWS if t.device.type == "cpu" else t.shape[0]  # a GPU: one kernel each, not a loop of them
        block = t.new_empty(min(step, t.shape[0]), t.shape[0])
        for start in range(0, t.shape[0], step):
            rows = sigma[start : start + step]
            products = block[: rows.shape[0]]
            torch.mul(t[start : start + step, None], t[None, :], out=products)
            if scale is not None:  # s Σ_ij, rounded, then − t_i t_j: in the same pass over the block
                rows.mul_(scale)
            rows.sub_(products)


def with_process_noise(sigma: Tensor, q: float) -> Tensor:
    """``Σ + q I`` as a new tensor (``Σ`` itself when ``q`` is 0): a dense block's prior, or a joint step's."""
    return sigma + q * torch.eye(sigma.shape[0], dtype=sigma.dtype, device=sigma.device) if q else sigma


class SharedRowBlocks:
    r"""Weights whose rows share one full covariance ``Σ`` (``cols x cols``): ``P_W = I_rows ⊗ Σ`` (not the paper).

    A weight ``W`` (``rows x cols``, e.g. the head: one row per class over the ``cols`` features) whose Jacobian
    is ``L_i Rᵀ`` per row ``i`` (``L_i``: ``m x k``, ``R``: ``cols x k``; :class:`~loko_lightning.OuterJacobian`
    has ``k = 1``, a stacked step of ``B`` samples ``k = B``, a dense block ``R = I``) has

    .. math::

        H P H^\top = \sum_i L_i M L_i^\top, \quad M = R^\top \Sigma R, \qquad
        \Delta W_{i,:} = \Sigma R\, L_i^\top w, \qquad
        \Sigma^+ = \Sigma - \Sigma R\, \bar N R^\top \Sigma, \quad
        \bar N = \frac{1}{\mathrm{rows}} \sum_i L_i^\top S^+ L_i .

    The exact posterior ``P − P Hᵀ S⁺ H P`` is not of the form ``I ⊗ Σ``; ``Σ⁺`` is the mean of its diagonal row
    blocks, the Gaussian of that form closest to it in KL divergence (moment matching), and positive semi-definite
    as each block is. Unlike the kinds of :mod:`~loko_lightning.kalman.algebra`, the update of these entries is not
    ``p̂ ⊙ Hᵀ w``: the filter calls :meth:`hpht` and :meth:`update` itself, and ``p̂`` of these entries holds
    ``diag(Σ)`` on every row. A time update's process noise ``q`` (:attr:`process_noise`) makes the step's prior
    ``Σ + q I`` (``P_W + q I``), formed as ``Σ R + q R`` without a new ``cols x cols`` tensor.

    Args:
        jacobians: one block per parameter.
        shapes: the parameters' shapes.
        indices: the parameters of this kind, in parameter order.
        start: where the kind begins in the flat order.
        m: number of outputs.
        dtype: dtype of the Kalman arithmetic.
        device: device of ``p̂``.
    """

    def __init__(
        self,
        jacobians: Sequence[JacobianBlock],
        shapes: Sequence[torch.Size],
        indices: Sequence[int],
        start: int,
        m: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.m, self.dtype, self.device = m, dtype, device
        self.order = list(indices)
        self.spans: list[tuple[int, int, int]] = []  # (start, rows, cols) in the flat order
        for i in self.order:
            rows = shapes[i][0]
            cols = shapes[i].numel() // rows
            self.spans.append((start, rows, cols))
            start += rows * cols
        self.start, self.end = self.spans[0][0] if self.spans else start, start
        self._factors: list[tuple[Tensor, Tensor]] = []  # (L, Σ R) of each parameter between the two calls
        #: Each parameter's process noise ``q`` (in :attr:`order`; set by the update plan from its time updates).
        self.process_noise: list[float] = [0.0] * len(self.order)

    def __bool__(self) -> bool:
        return bool(self.order)

    def _left_right(self, block: JacobianBlock, rows: int, cols: int) -> tuple[Tensor, Tensor | None]:
        """``L`` (``m x rows x k``) and ``R`` (``cols x k``; ``None`` for the identity of a dense block)."""
        if isinstance(block, Tensor):
            return block.reshape(self.m, rows, cols).to(self.dtype), None
        left, right = block.left.to(self.dtype), block.right.to(self.dtype)
        if right.dim() == 1:  # an OuterJacobian: one position
            return left.reshape(self.m, rows, 1), right[:, None]
        return left.reshape(self.m, rows, -1), right.reshape(cols, -1)

    def hpht(self, jacobians: Sequence[JacobianBlock], sigmas: Sequence[Tensor]) -> Tensor:
        """``Σ_i L_i M L_iᵀ`` summed over the kind's parameters, ``sigmas`` their ``Σ`` (in :attr:`order`).

        With process noise ``q`` the prior is ``Σ + q I``: ``Σ R + q R`` and ``M = Rᵀ (Σ R + q R)``.
        """
        total = torch.zeros(self.m, self.m, dtype=self.dtype, device=self.device)
        self._factors = []
        for i, (_, rows, cols), sigma, q in zip(self.order, self.spans, sigmas, self.process_noise, strict=True):
            left, right = self._left_right(jacobians[i], rows, cols)
            if right is None:  # a dense block, R = I: Σ + q I itself
                sigma_r = with_process_noise(sigma, q)
            else:
                sigma_r = sigma @ right if not q else torch.addmm(right, sigma, right, alpha=1.0, beta=q)  # Σ R (+ q R)
            inner = sigma_r if right is None else right.T @ sigma_r  # M = Rᵀ Σ R, (k, k)
            flat = left.reshape(self.m, -1)
            total.addmm_((left @ inner).reshape(self.m, -1), flat.T)
            self._factors.append((flat, sigma_r))
        return total

    def update(
        self, factor: Tensor, sigmas: Sequence[Tensor], update: Tensor, posterior: Tensor, scale: Tensor | None = None
    ) -> list[Tensor | Downdate]:
        """Write ``ΔW`` into ``update`` and ``diag(Σ⁺)`` (every row) into ``posterior``; return the ``Σ⁺``.

        Where the parameter's Jacobian has one position (``k = 1``: an :class:`~loko_lightning.OuterJacobian`, one
        sample) ``Σ⁺`` is returned as its :class:`Downdate`, which the filter commits in place.

        Args:
            factor: ``[Wᵀ; wᵀ]``, ``(m + 1, m)``, with ``S⁺ = W Wᵀ`` and ``w = S⁺ e``.
            sigmas: the ``Σ`` of the step's prior before its process noise, in :attr:`order` (read only).
            update: the whole flat update vector, written at this kind's entries.
            posterior: the whole flat ``p̂`` of the next step, written at this kind's entries.
            scale: the step's prior is ``s Σ`` (0-d; the covariance filter's ``prior_scale_rate``); ``None``: ``Σ``.

        Uses the factors the preceding :meth:`hpht` of the same step received.
        """
        m, new = self.m, []
        factors = zip(self.spans, sigmas, self._factors, self.process_noise, strict=True)
        for (start, rows, cols), sigma, (flat, sigma_r), q in factors:
            products = factor @ flat  # [Wᵀ L; wᵀ L], (m + 1, rows·k)
            k = sigma_r.shape[1]
            if scale is not None:  # the prior s Σ: s Σ R, and s Σ below
                sigma_r = sigma_r * scale
            torch.mm(products[m].view(rows, k), sigma_r.T, out=update[start : start + rows * cols].view(rows, cols))
            rooted = products[:m].reshape(m * rows, k)  # Wᵀ L_i stacked: N̄ = Σ_i (Wᵀ L_i)ᵀ Wᵀ L_i / rows
            mean_inner = rooted.T @ rooted / rows
            entries = posterior[start : start + rows * cols].view(rows, cols)
            if k == 1:  # Σ − t tᵀ, t = Σ R √N̄ (N̄ ≥ 0, 1 x 1): its diagonal Σ_ii − t_i t_i, as the commit computes it
                t = sigma_r[:, 0] * mean_inner[0, 0].sqrt()
                diagonal = sigma.diagonal() + q if q else sigma.diagonal()
                diagonal = diagonal if scale is None else diagonal * scale
                entries.copy_(torch.sub(diagonal, t * t)[None].expand(rows, cols))
                new.append(Downdate(t, scale, q))
                continue
            sigma = with_process_noise(sigma, q)  # the prior Σ + q I
            if scale is not None:
                sigma = sigma * scale
            # Σ − (Σ R N̄) (Σ R)ᵀ, then made exactly symmetric: two cols x cols temporaries at most.
            sigma_new = torch.addmm(sigma, sigma_r @ mean_inner, sigma_r.T, alpha=-1.0)
            sigma_new = torch.add(sigma_new, sigma_new.T).mul_(0.5)
            entries.copy_(sigma_new.diagonal()[None].expand(rows, cols))
            new.append(sigma_new)
        self._factors = []
        return new
