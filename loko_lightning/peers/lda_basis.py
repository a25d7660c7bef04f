r"""Streaming LDA's head in the eigenbasis of its scatter: solved without factorising the covariance each sample.

Streaming LDA (:class:`~loko_lightning.peers.frozen_heads.StreamingLDA`) predicts with ``W_k = Λ μ_k`` and
``b_k = −½ μ_kᵀ Λ μ_k``, ``Λ`` the inverse of its shrunk covariance ``A = (1 − ρ) Σ + ρ ν I``. Factorising the
``d x d`` matrix each sample costs ``d³/3`` (35-60 ms for ``d`` = 1,280 on one CPU core). Instead the scatter is kept
as ``S = S₀ + Uᵀ U``, ``S₀`` folded every ``REFRESH`` samples and eigendecomposed then (``S₀ = V diag(λ) Vᵀ``,
:class:`Eigenbasis`), ``U`` the rows ``√w δ`` since. In ``V``'s basis the shrunk covariance of the last refresh is
diagonal for any ``ρ`` and ``ν``, and the rows since are a Woodbury correction of rank ``r <`` ``REFRESH``:

.. math::

    A = c\,S + e\,I, \quad B = V \mathrm{diag}(c\lambda + e) V^\top, \qquad
    A^{-1} = B^{-1} - c\,B^{-1}U^\top (I_r + c\,U B^{-1} U^\top)^{-1} U B^{-1},

with ``c = (1 − ρ)/N`` and ``e = ρν`` (OAS's ``tr`` and ``‖Σ‖²_F`` from ``λ``, ``VᵀUᵀ`` and ``U Uᵀ`` the same way).
The same head as the Cholesky solve up to float64 rounding, for ``m d²`` a sample (``W = W̃ Vᵀ``, :func:`lda_head`)
plus one eigendecomposition every ``REFRESH`` samples. An owner that scores the features itself keeps the head as
``W̃`` and ``V`` (:func:`lda_factors`, :class:`HeadFactors`) and scores ``W̃ (Vᵀ z) + b``: ``d²`` a sample instead of
``m d²``. Every vector is rotated into the basis by one function, :func:`rotate`, so the same vector gets the same
bits wherever it is rotated; :func:`basis_check` tells whether rotated vectors kept in a state are of a given ``V``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def oas_shrinkage(alpha: Tensor, nu: Tensor, dim: int, samples: float) -> Tensor:
    """OAS's shrinkage ``ρ`` of an empirical covariance ``(d, d)`` estimated from ``samples`` samples.

    The closed form of Chen et al. (2010) as scikit-learn's ``sklearn.covariance.oas`` computes it:
    ``ρ = min(1, (a + ν²) / ((n + 1)(a − ν²/d)))`` with ``a`` (``alpha``) the mean of the covariance's squared entries
    and ``ν = tr Σ / d``; ``ρ = 1`` where the denominator is 0 (a covariance proportional to the identity, or zero).
    """
    numerator = alpha + nu.square()
    denominator = (samples + 1.0) * (alpha - nu.square() / dim)
    if float(denominator) == 0.0:  # one host read per head
        return torch.ones((), dtype=alpha.dtype, device=alpha.device)
    return torch.clamp(numerator / denominator, max=1.0)


def rotate(vectors: Tensor, vector: Tensor) -> Tensor:
    """``Vᵀ x`` of one vector ``(d,)`` in the basis ``vectors`` ``(d, k)``: every rotation of one vector."""
    return torch.mv(vectors.T, vector)


#: Deferred streaming LDA's state in the eigenbasis of its last refresh: the rotated class means and rows, and the
#: :func:`basis_check` of the basis they are in.
ROTATED = ("rotated_mean", "rotated_recent", "basis_check")


def basis_check(vectors: Tensor) -> Tensor:
    """A check of a float64 matrix's bits: equal for the same matrix, and in practice not for another.

    ``(2,)`` int64: the sums of the entries' low and high 32 bits (no overflow below 2³¹ entries).
    """
    bits = vectors.contiguous().view(torch.int64)
    return torch.stack([(bits & 0xFFFFFFFF).sum(), (bits >> 32).sum()])


class Eigenbasis:
    """Streaming LDA's scatter of the last refresh ``S₀ = V diag(λ) Vᵀ`` and the vectors the head reads, rotated.

    In ``V``'s basis: the rows ``U`` since (``U V``) and the class means (``M V``), each rotated once, when it is new.
    Rebuilt from the optimizer's state alone (after a refresh, or a checkpoint loaded), every vector rotated by the
    same matrix-vector product either way: a resumed fit computes the same head, bit for bit.
    """

    def __init__(self, scatter: Tensor, classes: int) -> None:
        values, self.vectors = torch.linalg.eigh(scatter)
        self.values = values.clamp_min(0)  # S₀ is positive semi-definite: a negative eigenvalue is rounding
        self.recent = scatter.new_zeros(0, scatter.shape[0])
        self.means = scatter.new_zeros(classes, scatter.shape[0])
        self.counts: Tensor | None = None  # the class counts the rotated means are of

    def rotate(self, vector: Tensor) -> Tensor:
        """``Vᵀ x`` of one vector ``(d,)`` (:func:`rotate`)."""
        return rotate(self.vectors, vector)

    def update(self, state: dict[str, Tensor]) -> None:
        """Rotate the rows added since the last call and the means of the classes whose count changed."""
        rows = state["recent"]
        if rows.shape[0] > self.recent.shape[0]:
            new = [self.rotate(row) for row in rows[self.recent.shape[0] :]]
            self.recent = torch.cat([self.recent, torch.stack(new)])
        counts = state["count"]
        changed = range(counts.shape[0]) if self.counts is None else (counts != self.counts).nonzero()[:, 0].tolist()
        for k in changed:
            self.means[k] = self.rotate(state["mean"][k])
        self.counts = counts.clone()


class HeadFactors(NamedTuple):
    """A linear head kept as factors: streaming LDA's in the eigenbasis of its last refresh, not multiplied out.

    ``W = F Bᵀ`` (``F`` ``weight``, ``(m, k)``; ``B`` ``basis``, ``(d, k)``, or ``None``: ``W = F``) and the bias
    ``(m,)``, float64. Scoring ``z`` through the basis (``F (Bᵀ z) + b``) costs ``d k + m k`` a sample where forming
    ``W`` costs ``m d k`` (``d = k`` = 1,280, ``m`` = 10: 1.6 M against 16.4 M multiply-adds); the logits are
    ``W z + b``'s up to float64 rounding.
    """

    weight: Tensor
    bias: Tensor
    basis: Tensor | None = None

    def logits(self, features: Tensor) -> Tensor:
        """``W z + b`` of features ``(B, d)``, float64, scored through the basis: ``(B, m)``."""
        return self.score(self.rotate(features))

    def rotate(self, features: Tensor) -> Tensor:
        """``Bᵀ z`` of features ``(B, d)``: ``(B, k)`` (the features themselves without a basis).

        One sample by :func:`rotate`, as :class:`Eigenbasis` rotates it: the same bits.
        """
        if self.basis is None:
            return features
        if features.shape[0] == 1:
            return rotate(self.basis, features[0])[None]
        return features @ self.basis

    def score(self, rotated: Tensor) -> Tensor:
        """The logits ``F r + b`` of features already rotated (:meth:`rotate`): ``(B, m)``."""
        return torch.addmm(self.bias, rotated, self.weight.T)

    def dense(self) -> tuple[Tensor, Tensor]:
        """``(W, b)``, ``W`` multiplied out."""
        return (self.weight if self.basis is None else self.weight @ self.basis.T), self.bias


def lda_factors(state: dict[str, Tensor], basis: Eigenbasis, shrinkage: float | str) -> HeadFactors:
    """Streaming LDA's head (:func:`lda_head`) in ``basis``: ``F_k = Vᵀ Λ μ_k``, ``b_k = −½ F_kᵀ (Vᵀ μ_k)``.

    ``Λ = A⁻¹``, ``A = (1 − ρ) Σ + ρ ν I`` (OAS's ``ρ`` and ``ν = tr Σ / d``, or ``ρ = shrinkage`` and ``ν = 1``),
    applied in ``basis`` (:class:`Eigenbasis`, up to date with ``state``) with the Woodbury correction of the module.
    A zero covariance under OAS (no sample yet differs from its class mean) is the identity: nearest class mean, with
    no basis.
    """
    rotated = _solve(state, basis, shrinkage)
    if rotated is None:
        return _identity(state["mean"])
    return HeadFactors(rotated, -0.5 * (rotated * basis.means).sum(-1), basis.vectors)


def lda_head(state: dict[str, Tensor], basis: Eigenbasis, shrinkage: float | str) -> tuple[Tensor, Tensor]:
    """Streaming LDA's head ``(W, b)`` (``(m, d)``, ``(m,)``): ``W_k = Λ μ_k``, ``b_k = −½ μ_kᵀ Λ μ_k``.

    :func:`lda_factors`'s ``F`` multiplied out, the bias from ``W`` and the means.
    """
    rotated = _solve(state, basis, shrinkage)
    if rotated is None:
        return _identity(state["mean"]).dense()
    weight = rotated @ basis.vectors.T
    return weight, -0.5 * (weight * state["mean"]).sum(-1)


def _identity(means: Tensor) -> HeadFactors:
    """The head of the identity covariance (nearest class mean at unit variance), with no basis."""
    return HeadFactors(means.clone(), -0.5 * means.square().sum(-1))


def _solve(state: dict[str, Tensor], basis: Eigenbasis, shrinkage: float | str) -> Tensor | None:
    """The rows ``F_k = Vᵀ Λ μ_k`` ``(m, k)``; ``None`` for a zero covariance under OAS (the identity's head)."""
    means, rows = state["mean"], state["recent"]
    dim = means.shape[1]
    count = float(state["samples"].clamp_min(1))
    trace = basis.values.sum() + rows.square().sum()  # tr S
    if shrinkage == "oas":
        nu = trace / (count * dim)
        if float(nu) == 0.0:
            return None
        # ‖S‖²_F = Σ λ² + 2 Σ_i λ_i ‖(U V)_{:, i}‖² + ‖U Uᵀ‖²_F
        frobenius = basis.values.square().sum() + 2 * (basis.recent.square().sum(0) * basis.values).sum()
        frobenius = frobenius + (rows @ rows.T).square().sum()
        rho = oas_shrinkage(frobenius / (count * dim) ** 2, nu, dim, float(state["samples"]))
        scale, ridge = (1.0 - rho) / count, rho * nu
    else:
        scale, ridge = (1.0 - shrinkage) / count, means.new_tensor(float(shrinkage))
    inverse = 1.0 / (scale * basis.values + ridge)  # B⁻¹ in V's basis
    rotated = basis.means * inverse  # rows B⁻¹ μ_k
    if rows.shape[0]:
        spread = basis.recent * inverse  # rows B⁻¹ u_i
        capacitance = torch.eye(rows.shape[0], dtype=means.dtype, device=means.device)
        capacitance = capacitance + scale * (basis.recent @ spread.T)
        solved = torch.cholesky_solve(basis.recent @ rotated.T, torch.linalg.cholesky(capacitance))
        rotated = rotated - scale * (solved.T @ spread)
    return rotated
