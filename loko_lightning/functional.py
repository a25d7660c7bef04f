"""The LoKO Kalman update on plain tensors.

Everything here is stateless: the optimizer (:mod:`loko_lightning.optim`) owns the state and calls
:func:`loko_update`. Notation follows the paper: ``H`` is the ``m x ñ`` Jacobian of the prediction ``ŷ``
with respect to the trainable parameters ``θ̃``, ``p`` the diagonal of the covariance ``P``, ``e = y - ŷ``
the innovation, ``R`` the ``m x m`` observation noise, ``S = H P Hᵀ + R`` and ``K = P Hᵀ S⁻¹``.

The Jacobian of one parameter is a dense tensor of shape ``(m, *param.shape)``, an :class:`OuterJacobian`
(the exact factored form of a Linear layer's weight Jacobian for a single input vector) or a
:class:`FactoredJacobian` (the same for a Linear/Conv2d layer that saw ``k`` positions: pixels, tokens). The
update never materialises a factored block: every product it needs has a closed form in the factors. Dense
blocks are treated as one ``m x n`` matrix (without a copy when they come from
:func:`loko_lightning.jacobian`, which lays them out side by side in one buffer), so the work on them is a few
large matrix products whatever the number of parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

REstimator = Literal["taylor", "residual", "identity", "decay", "softmax"]
R_ESTIMATORS: tuple[str, ...] = ("taylor", "residual", "identity", "decay", "softmax")


@dataclass(frozen=True)
class OuterJacobian:
    """Jacobian of ``m`` outputs w.r.t. a weight ``W`` (``out x in``) of a Linear layer seen by one input.

    For ``z = W f + b`` with a single input vector ``f``, ``∂ŷ_a/∂W_jk = left[a, j] * right[k]`` where
    ``left = ∂ŷ/∂z`` (``m x out``) and ``right = f`` (``in``). Storing the two factors costs
    ``m·out + in`` numbers instead of ``m·out·in``, and every Kalman product on this block has a closed form.

    Args:
        left: ``∂ŷ/∂z``, shape ``(m, out)``.
        right: the layer's input ``f``, shape ``(in,)``.
    """

    left: Tensor
    right: Tensor

    @property
    def shape(self) -> torch.Size:
        """Shape of the dense Jacobian this object stands for, ``(m, out, in)``."""
        return torch.Size((*self.left.shape, *self.right.shape))

    def to_dense(self) -> Tensor:
        """Materialise the dense ``(m, out, in)`` Jacobian (for tests and debugging)."""
        return self.left[:, :, None] * self.right[None, None, :]

    def to(self, dtype: torch.dtype) -> OuterJacobian:
        """Return a copy with both factors cast to ``dtype``."""
        return OuterJacobian(self.left.to(dtype), self.right.to(dtype))


@dataclass(frozen=True)
class FactoredJacobian:
    """Exact factored Jacobian of a Linear or Conv2d weight that sees ``k`` input positions.

    A layer ``z_p = W x_p (+ b)`` applied at ``k`` positions ``p`` (the output pixels of a convolution, with
    ``x_p`` the unfolded input patch, or the tokens of a Linear layer) has
    ``∂ŷ_a/∂W_ij = Σ_p left[a, i, p] · right[j, p]``, with ``left[a, :, p] = ∂ŷ_a/∂z_p`` and
    ``right[:, p] = x_p``. For ``W`` of shape ``(rows, *rest)`` the Jacobian of sample row ``a`` is
    ``left[a] @ right.T`` reshaped to ``W``'s shape. It is the per-sample-gradient structure that LoRA factors
    inherit, and it generalises :class:`OuterJacobian` (``k = 1``). Storing ``m·rows·k + cols·k`` numbers
    instead of ``m·rows·cols`` pays off, and makes the Kalman products cheaper, when ``k`` is small against
    ``m`` (deep layers with few pixels, many classes); see :func:`factored_is_cheaper`.

    Args:
        left: cotangents at the layer output, shape ``(m, rows, k)``.
        right: the layer input at each position, shape ``(cols, k)`` with ``cols = prod(param_shape[1:])``.
        param_shape: shape of the weight, ``(rows, *rest)``.
    """

    left: Tensor
    right: Tensor
    param_shape: torch.Size

    @property
    def shape(self) -> torch.Size:
        """Shape of the dense Jacobian this object stands for, ``(m, *param_shape)``."""
        return torch.Size((self.left.shape[0], *self.param_shape))

    def to_dense(self) -> Tensor:
        """Materialise the dense ``(m, *param_shape)`` Jacobian (for tests and debugging)."""
        return torch.matmul(self.left, self.right.T).reshape(self.shape)

    def to(self, dtype: torch.dtype) -> FactoredJacobian:
        """Return a copy with both factors cast to ``dtype``."""
        return FactoredJacobian(self.left.to(dtype), self.right.to(dtype), self.param_shape)


JacobianBlock = Tensor | OuterJacobian | FactoredJacobian

# Equivalent multiply-adds charged for the dozen small tensor ops a factored block with k > 1 adds; a dense
# block instead joins one big matrix product with all the other dense blocks, and blocks with k = 1 are
# processed together (see loko_update).
_BLOCK_OVERHEAD = 5e5
_OUTER_OVERHEAD = 2e5


def factored_is_cheaper(m: int, rows: int, cols: int, k: int) -> bool:
    """Whether the Kalman update costs less with a :class:`FactoredJacobian` than with its dense form.

    Rough multiply-add counts per step: dense ``m·rows·cols·(k + 2m)`` (forming the block, then ``H P Hᵀ`` and
    ``diag(Hᵀ S⁺ H)``); factored ``rows·cols·k·(2k + 4) + 2·rows·m·k·(k + m)`` plus a fixed overhead per
    block (``k = 1``: ``2·m²·rows`` plus a few passes over ``rows·cols``). Either form gives the same update to
    rounding; this only picks the faster one.

    Args:
        m: number of outputs (Jacobian rows).
        rows: the weight's first dimension.
        cols: the product of its other dimensions.
        k: number of input positions the layer saw.
    """
    dense = m * rows * cols * (k + 2 * m + 3)
    if k == 1:
        factored = 2 * m * rows * (m + 1) + 4 * rows * cols + _OUTER_OVERHEAD
    else:
        factored = rows * cols * k * (2 * k + 4) + 2 * rows * m * k * (k + m) + _BLOCK_OVERHEAD
    return factored < dense


def _as_factored(jac: OuterJacobian | FactoredJacobian) -> FactoredJacobian:
    if isinstance(jac, FactoredJacobian):
        return jac
    return FactoredJacobian(jac.left[:, :, None], jac.right[:, None], jac.shape[1:])


def _factored_hpht(jac: FactoredJacobian, cov: Tensor) -> Tensor:
    """``H P Hᵀ`` of one factored block."""
    left = jac.left
    m, rows, k = left.shape
    if k == 1:
        # Σ_ij L_ai R_j² p_ij L_bi = L diag(p R²) Lᵀ
        lvec = left[:, :, 0]
        return (lvec * (cov.view(rows, -1) @ jac.right[:, 0].square())) @ lvec.T
    # Σ_i L_i M_i L_iᵀ with M_i = Rᵀ diag(p_i) R (k x k per row i)
    left_gram = torch.bmm(left.transpose(0, 1), _row_grams(jac, cov))  # (rows, m, k)
    return left_gram.transpose(0, 1).reshape(m, rows * k) @ left.reshape(m, rows * k).T


def _stack_lefts(jacs: Sequence[FactoredJacobian]) -> Tensor:
    """The left factors of blocks with the same ``k`` side by side, ``(m, Σ rows, k)``."""
    return jacs[0].left if len(jacs) == 1 else torch.cat([j.left for j in jacs], dim=1)


def _row_grams(jac: FactoredJacobian, cov: Tensor) -> Tensor:
    """``M_i = Rᵀ diag(p_i) R`` for every row ``i`` of a factored block, ``(rows, k, k)``."""
    right = jac.right
    cov = cov.view(jac.left.shape[1], right.shape[0])
    return torch.matmul(right.T, cov[:, :, None] * right)


def _dense_stack(jacs: Sequence[Tensor], m: int, dtype: torch.dtype) -> Tensor:
    """Dense blocks side by side as one ``(m, n)`` matrix ``H``.

    :func:`loko_lightning.jacobian` lays its dense blocks out as consecutive column blocks of one buffer; then
    this is a view of that buffer, without a copy. Any other layout is copied.
    """
    flats = [j.reshape(m, -1) for j in jacs]
    first = flats[0]
    row_stride = first.stride(0)
    offset, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    tiled = True
    for flat in flats:
        n = flat.shape[1]
        tiled = (
            flat.dtype == dtype
            and (flat.stride(0) == row_stride or m == 1)
            and (flat.stride(1) == 1 or n == 1)
            and flat.untyped_storage().data_ptr() == ptr
            and flat.storage_offset() == offset
        )
        if not tiled:
            break
        offset += n
    total = sum(flat.shape[1] for flat in flats)
    if tiled and (m == 1 or row_stride >= total):
        return torch.as_strided(first, (m, total), (row_stride, 1), first.storage_offset())
    return torch.cat(flats, dim=1).to(dtype)


def _weighted_gram(jac: Tensor, weight: Tensor) -> Tensor:
    """``H diag(w) Hᵀ`` for a wide ``(m, n)`` matrix ``H``.

    BLAS runs a product with a huge inner dimension and a small output at low efficiency; splitting the inner
    dimension (a batch of products for small ``m``, cache-sized chunks for large ``m``) and summing the parts is
    exact up to the order of summation and markedly faster.
    """
    m, n = jac.shape
    if m >= 32:
        chunk = 8192
        if n <= chunk:
            return (jac * weight) @ jac.T
        gram = torch.zeros(m, m, dtype=jac.dtype, device=jac.device)
        scratch = torch.empty(m * chunk, dtype=jac.dtype, device=jac.device)
        for start in range(0, n, chunk):
            part = jac[:, start : start + chunk]
            width = part.shape[1]
            scaled = torch.mul(part, weight[start : start + width], out=scratch[: m * width].view(m, width))
            gram.addmm_(scaled, part.T)
        return gram
    scaled = jac * weight
    split = min(16, n // 4096)
    if split < 2:
        return scaled @ jac.T
    body = n - n % split
    a = scaled[:, :body].reshape(m, split, -1).transpose(0, 1)
    b = jac[:, :body].reshape(m, split, -1).permute(1, 2, 0)
    gram = torch.bmm(a, b).sum(0)
    if body < n:
        gram = gram + scaled[:, body:] @ jac[:, body:].T
    return gram


def _gain_quad(jac: Tensor, s_pinv: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """``Hᵀ w`` and ``diag(Hᵀ S⁺ H)`` for a wide ``(m, n)`` matrix ``H``, in one pass over ``H``.

    ``[S⁺ | w]ᵀ H`` gives ``S⁺H`` (``S⁺`` is symmetric) and ``wᵀH`` together; it is formed in chunks of columns
    that stay in cache while they are multiplied by ``H`` and summed.
    """
    m, n = jac.shape
    factor = torch.cat([s_pinv, weights[:, None]], dim=1).T.contiguous()  # (m + 1, m)
    ones = torch.ones(m, dtype=jac.dtype, device=jac.device)
    chunk = max(4096, 409600 // m)
    if n <= chunk:
        products = factor @ jac
        return products[m], ones @ products[:m].mul_(jac)
    gain = torch.empty(n, dtype=jac.dtype, device=jac.device)
    quad = torch.empty(n, dtype=jac.dtype, device=jac.device)
    scratch = torch.empty((m + 1) * chunk, dtype=jac.dtype, device=jac.device)
    for start in range(0, n, chunk):
        part = jac[:, start : start + chunk]
        width = part.shape[1]
        products = torch.mm(factor, part, out=scratch[: (m + 1) * width].view(m + 1, width))
        gain[start : start + width] = products[m]
        torch.mv(products[:m].mul_(part).T, ones, out=quad[start : start + width])
    return gain, quad


def _concat(tensors: Sequence[Tensor]) -> Tensor:
    return tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])


def _concat_noise(blocks: Sequence[tuple[Tensor, float]], dtype: torch.dtype, device: torch.device) -> Tensor | float:
    """The process noise ``q`` of each block, as one scalar if they all agree, else as a flat vector."""
    values = {q for _, q in blocks}
    if len(values) == 1:
        return values.pop()
    return torch.cat([torch.full((t.numel(),), q, dtype=dtype, device=device) for t, q in blocks])


def innovation_covariance(jacobians: Sequence[JacobianBlock], covs: Sequence[Tensor]) -> Tensor:
    """``H P Hᵀ`` summed over parameter blocks (``P`` diagonal, one ``cov`` per parameter).

    Args:
        jacobians: per-parameter Jacobians, dense ``(m, *shape)``, :class:`OuterJacobian` or
            :class:`FactoredJacobian`.
        covs: per-parameter diagonal covariances ``p̂``, each of the parameter's shape.

    Returns:
        The ``m x m`` matrix ``H P Hᵀ``.
    """
    total = None
    for jac, cov in zip(jacobians, covs, strict=True):
        if isinstance(jac, (OuterJacobian, FactoredJacobian)):
            term = _factored_hpht(_as_factored(jac), cov)
        else:
            flat = jac.reshape(jac.shape[0], -1)
            term = (flat * cov.reshape(-1)) @ flat.T
        total = term if total is None else total + term
    if total is None:
        raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
    return total


def observation_noise(
    r_estimator: REstimator,
    previous: Tensor,
    innovation: Tensor,
    hpht: Tensor,
    prediction: Tensor,
    step: Tensor,
    beta: float,
) -> Tensor:
    """Observation-noise covariance ``R_k`` for one step.

    Args:
        r_estimator: ``"taylor"`` (paper method 2): ``R̂ = e eᵀ + H P Hᵀ``; ``"residual"`` (method 1):
            ``R̂ = e eᵀ``; both smoothed as ``R_k = β R_{k-1} + (1-β) R̂``. Literature alternatives, used
            as they are: ``"identity"`` ``R = I``; ``"decay"`` ``R = I e^{-k/50}``; ``"softmax"``
            ``R = diag(ŷ) - ŷ ŷᵀ``.
        previous: ``R_{k-1}``, ``m x m``.
        innovation: ``e = y - ŷ``, shape ``(m,)``.
        hpht: ``H P_{k|k-1} Hᵀ``.
        prediction: ``ŷ``, shape ``(m,)``.
        step: ``k``, the 1-based index of this update (0-d tensor).
        beta: forgetting factor of the EMA.

    Returns:
        ``R_k``.
    """
    if r_estimator in ("taylor", "residual"):
        estimate = torch.outer(innovation, innovation)
        if r_estimator == "taylor":
            estimate = estimate + hpht
        return beta * previous + (1.0 - beta) * estimate
    eye = torch.eye(innovation.shape[0], dtype=hpht.dtype, device=hpht.device)
    if r_estimator == "identity":
        return eye
    if r_estimator == "decay":
        return eye * torch.exp(-step.to(hpht.dtype) / 50.0)
    if r_estimator == "softmax":
        return torch.diag(prediction) - torch.outer(prediction, prediction)
    raise ValueError(f"Invalid r_estimator: {r_estimator!r}; expected one of {R_ESTIMATORS}")


def psd_pinv(matrix: Tensor, rcond: float | None = None) -> tuple[Tensor, Tensor]:
    """Pseudo-inverse of a symmetric positive semi-definite matrix by eigendecomposition.

    With softmax outputs ``S`` is singular by construction (the all-ones vector is in its null space), so a
    plain inverse returns garbage. Eigenvalues at or below ``rcond · λ_max`` (including the small negative
    ones rounding produces) are treated as zero, which also keeps the result positive semi-definite, so the
    covariance update can only shrink ``p̂``.

    Args:
        matrix: symmetric ``m x m`` matrix (symmetrised here against rounding).
        rcond: relative eigenvalue cut-off; default ``m · eps(dtype) · 10``.

    Returns:
        ``(pinv, cond)``: the pseudo-inverse and the condition number of the kept spectrum
        (``λ_max / smallest kept λ``).
    """
    m = matrix.shape[-1]
    if rcond is None:
        rcond = 10.0 * m * torch.finfo(matrix.dtype).eps
    sym = 0.5 * (matrix + matrix.T)
    eigvals, eigvecs = torch.linalg.eigh(sym)
    top = eigvals[-1].clamp_min(torch.finfo(matrix.dtype).tiny)
    keep = eigvals > rcond * top
    inv_vals = torch.where(keep, 1.0 / torch.where(keep, eigvals, top), torch.zeros_like(eigvals))
    pinv = (eigvecs * inv_vals) @ eigvecs.T
    smallest = torch.where(keep, eigvals, torch.full_like(eigvals, math.inf)).min()
    return pinv, top / smallest


@torch.no_grad()
def loko_update(
    params: Sequence[Tensor],
    jacobians: Sequence[JacobianBlock],
    covs: Sequence[Tensor],
    prediction: Tensor,
    target: Tensor,
    noise: Tensor,
    step: Tensor,
    *,
    beta: float,
    r_estimator: REstimator,
    process_noise: Sequence[float] | float = 0.0,
    rcond: float | None = None,
) -> dict[str, Tensor]:
    r"""One LoKO step (Algorithm 1 with a diagonal covariance), in place and without host syncs.

    .. math::

        \\hat p_{k|k-1} &= \\hat p_{k-1} + q \\\\
        R_k &= \\beta R_{k-1} + (1-\\beta)\\hat R_k \\\\
        K_k &= \\hat p_{k|k-1} \\bullet H_k^\\top (H_k (\\hat p_{k|k-1} \\bullet H_k^\\top) + R_k)^{+} \\\\
        \\tilde\\theta_k &= \\tilde\\theta_{k|k-1} + K_k (y_k - \\hat y_k) \\\\
        (\\hat p_k)_i &= (\\hat p_{k|k-1})_i - (K_k)_{ij} (H_k)_{ji} (\\hat p_{k|k-1})_i

    The arithmetic runs in the dtype of ``covs``; parameters are updated in their own dtype. If anything
    is non-finite (prediction, target, a Jacobian, the innovation or the resulting update), nothing is
    written: parameters, ``covs``, ``noise`` and ``step`` keep their values and ``diagnostics["applied"]``
    is ``False``. The decision is made on the device with :func:`torch.where`, so no host sync is needed. (The
    update and the new ``p̂`` are tested through their sums, which are non-finite if any entry is; a sum that
    overflows float range also skips the step.)

    Args:
        params: trainable parameters ``θ̃``, updated in place.
        jacobians: per-parameter Jacobians of ``ŷ``: dense ``(m, *shape)``, :class:`OuterJacobian` or
            :class:`FactoredJacobian`.
        covs: per-parameter ``p̂``, updated in place; their dtype is the arithmetic dtype.
        prediction: ``ŷ``, shape ``(m,)``.
        target: ``y``, shape ``(m,)``.
        noise: ``R_{k-1}``, ``m x m``, updated in place to ``R_k``.
        step: number of updates applied so far (0-d integer tensor), incremented in place.
        beta: EMA forgetting factor.
        r_estimator: see :func:`observation_noise`.
        process_noise: ``q`` added to every ``p̂`` in the predict step, one value or one per parameter.
        rcond: relative eigenvalue cut-off of the ``S`` pseudo-inverse (see :func:`psd_pinv`).

    Returns:
        Diagnostics as 0-d tensors: ``applied``, ``innovation_norm``, ``p_mean``, ``p_min``, ``p_max``,
        ``cond`` (of ``S``'s kept spectrum), ``gain_norm`` (``‖K e‖``).
    """
    dtype = covs[0].dtype
    m = prediction.shape[0]
    if isinstance(process_noise, (int, float)):
        process_noise = [float(process_noise)] * len(params)
    process_noise = [float(q) for q in process_noise]
    prediction = prediction.to(dtype)
    innovation = target.to(dtype) - prediction
    blocks = {
        i: _as_factored(j).to(dtype)
        for i, j in enumerate(jacobians)
        if isinstance(j, (OuterJacobian, FactoredJacobian))
    }
    dense = [i for i in range(len(jacobians)) if i not in blocks]
    # Factored blocks are processed in groups of equal shape (k, rows, cols), each group batched.
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for i, j in blocks.items():
        by_shape.setdefault((j.left.shape[2], j.left.shape[1], j.right.shape[0]), []).append(i)
    outer_groups = {shape: group for shape, group in by_shape.items() if shape[0] == 1}
    factored_groups = {shape: group for shape, group in by_shape.items() if shape[0] > 1}
    outer = [i for group in outer_groups.values() for i in group]
    factored = [i for group in factored_groups.values() for i in group]
    # Everything elementwise runs on flat vectors over all parameters, in this order.
    order = dense + outer + factored
    sizes = [covs[i].numel() for i in order]
    cov_flat = _concat([covs[i] for i in order])
    noise_flat = _concat_noise([(covs[i], process_noise[i]) for i in order], dtype, cov_flat.device)
    prior_flat = cov_flat + noise_flat if isinstance(noise_flat, Tensor) or noise_flat else cov_flat
    n_dense = sum(sizes[: len(dense)])

    # H P Hᵀ. All dense blocks are one matrix H (m x n). A block with k = 1 is L ⊗ R: its term is
    # L diag(p R²) Lᵀ, so the L of all of them side by side are one more matrix (m x Σ rows) with weights.
    terms = []
    if dense:
        jac_d = _dense_stack([jacobians[i] for i in dense], m, dtype)
        terms.append(_weighted_gram(jac_d, prior_flat[:n_dense]))
    start = n_dense
    outer_parts = []
    for (_, rows, cols), group in outer_groups.items():
        right = torch.stack([blocks[i].right[:, 0] for i in group])[:, :, None]  # (G, cols, 1)
        prior = prior_flat[start : start + len(group) * rows * cols].view(len(group), rows, cols)
        start += len(group) * rows * cols
        outer_parts.append((right, (prior @ right.square()).view(-1), len(group), rows))
    if outer:
        lefts = [blocks[i].left[:, :, 0] for i in outer]
        outer_left = lefts[0] if len(lefts) == 1 else torch.cat(lefts, dim=1)
        weight_all = torch.cat([weight for _, weight, _, _ in outer_parts])
        terms.append(_weighted_gram(outer_left, weight_all))
    # Blocks with k > 1: Σ_i L_i M_i L_iᵀ over rows i, with M_i = Rᵀ diag(p_i) R (k x k).
    groups = []
    for (k, rows, cols), group in factored_groups.items():
        left = _stack_lefts([blocks[i] for i in group])  # (m, G·rows, k)
        right = torch.stack([blocks[i].right for i in group])[:, None]  # (G, 1, cols, k)
        prior = prior_flat[start : start + len(group) * rows * cols].view(len(group), rows, cols, 1)
        start += len(group) * rows * cols
        grams = (right.transpose(-1, -2) @ (prior * right)).view(-1, k, k)  # (G·rows, k, k)
        left_gram = torch.bmm(left.transpose(0, 1), grams)  # (G·rows, m, k)
        terms.append(left_gram.transpose(0, 1).reshape(m, -1) @ left.reshape(m, -1).T)
        groups.append((left, right, len(group), rows, k))
    if not terms:
        raise ValueError("Invalid jacobians: expected at least one parameter block, got none")
    hpht = terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)

    new_noise = observation_noise(r_estimator, noise, innovation, hpht, prediction, step + 1, beta)
    s_matrix = hpht + new_noise
    finite = torch.isfinite(innovation).all() & torch.isfinite(s_matrix).all()
    # eigh must never see NaN/Inf (LAPACK fails); a skipped step decomposes the identity instead.
    s_matrix = torch.where(finite, s_matrix, torch.eye(s_matrix.shape[0], dtype=dtype, device=s_matrix.device))
    s_pinv, cond = psd_pinv(s_matrix, rcond)
    weights = s_pinv @ torch.where(finite, innovation, torch.zeros_like(innovation))

    # K e = p ⊙ Hᵀ w and (K H)_ii = p_i (Hᵀ S⁺ H)_ii, flat in `order`.
    gains, quads = [], []
    if dense:
        gain, quad = _gain_quad(jac_d, s_pinv, weights)
        gains.append(gain)
        quads.append(quad)
    if outer:
        # For L ⊗ R: Hᵀ w = (Lᵀ w) ⊗ R and diag(Hᵀ S⁺ H) = diag(Lᵀ S⁺ L) ⊗ R².
        gain, quad = _gain_quad(outer_left, s_pinv, weights)
        start = 0
        for right, _, count, rows in outer_parts:
            end = start + count * rows
            gains.append((gain[start:end].view(count, rows, 1) * right.transpose(1, 2)).reshape(-1))
            quads.append((quad[start:end].view(count, rows, 1) * right.square().transpose(1, 2)).reshape(-1))
            start = end
    for left, right, count, rows, k in groups:
        # Hᵀ w = (wᵀ L_i) Rᵀ per row i; diag(Hᵀ S⁺ H)_ij = R_j N_i R_jᵀ with N_i = L_iᵀ S⁺ L_i (k x k).
        flat = left.reshape(m, -1)
        gains.append(((weights @ flat).view(count, 1, rows, k) @ right.transpose(-1, -2)).reshape(-1))
        solved = (s_pinv @ flat).view(m, -1, k)
        inner = torch.bmm(left.permute(1, 2, 0), solved.transpose(0, 1)).view(count, rows, k, k)
        quads.append(((right @ inner) * right).sum(-1).reshape(-1))
    delta = prior_flat * (gains[0] if len(gains) == 1 else torch.cat(gains))
    quad = quads[0] if len(quads) == 1 else torch.cat(quads)
    # (K H)_ii lies in [0, 1] in exact arithmetic; the floor keeps p̂ > 0 under rounding.
    one = torch.ones((), dtype=dtype, device=quad.device)
    posterior = torch.addcmul(one, prior_flat, quad, value=-1.0).clamp_min_(torch.finfo(dtype).eps).mul_(prior_flat)
    # A NaN or Inf anywhere makes the sum non-finite (so does an overflowing sum, which is skipped as well).
    applied = finite & torch.isfinite(delta.sum() + posterior.sum())

    delta = torch.where(applied, delta, 0.0)
    cov_new = torch.where(applied, posterior, cov_flat)
    ordered_params = [params[i] for i in order]
    steps = [d.view_as(p) for d, p in zip(torch.split(delta, sizes), ordered_params, strict=True)]
    if all(p.dtype == dtype for p in ordered_params):
        torch._foreach_add_(ordered_params, steps)
    else:
        for param, d in zip(ordered_params, steps, strict=True):
            param.add_(d.to(param.dtype))
    ordered_covs = [covs[i] for i in order]
    torch._foreach_copy_(
        ordered_covs, [c.view_as(t) for c, t in zip(torch.split(cov_new, sizes), ordered_covs, strict=True)]
    )
    noise.copy_(torch.where(applied, new_noise, noise))
    step.add_(applied.to(step.dtype))

    p_min, p_max = torch.aminmax(cov_new)
    p_mean = cov_new.sum() / cov_new.numel()
    gain_norm = torch.linalg.vector_norm(delta)
    return {
        "applied": applied,
        "innovation_norm": torch.linalg.vector_norm(innovation),
        "p_mean": p_mean,
        "p_min": p_min,
        "p_max": p_max,
        "cond": cond,
        "gain_norm": gain_norm,
    }
