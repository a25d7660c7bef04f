"""Models, streams and the dense float64 filter shared by the optimizer and update tests."""

import math
import re

import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn import functional as F

from loko_lightning import jacobian
from loko_lightning.jacobians.blocks import FactoredJacobian
from loko_lightning.kalman.reference import loko_step_reference
from loko_lightning.kalman.time_update import TimeUpdate

# S is singular by construction with softmax outputs; its spurious eigenvalue along the all-ones vector is
# rounding noise (|λ| ≲ 1e-14 λ_max in float64), genuine ones are far above 1e-10 λ_max in these tests
# (asserted in DenseModelFilter.step), so the cut-off sits in a wide, empty gap of the spectrum.
RTOL = 1e-10


class DenseModelFilter:
    """LoKO on a model the slow way: θ̃ one flat float64 vector, H from ``jacrev``, each step
    :func:`~loko_lightning.kalman.reference.loko_step_reference`. Shares no code with the fast path but the
    reference."""

    def __init__(self, model, p0, *, beta, r_estimator, output="softmax", debias=False, prior_scale_rate=0.0,
                 prior_scale_until=0, softmax_noise=False, **time_update):  # fmt: skip
        self.model = model
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.shapes = [p.shape for _, p in trainable]
        self.theta = torch.cat([p.detach().reshape(-1) for _, p in trainable]).double()
        self.p = p0.double().clone()
        self.R = None
        self.k = 0
        self.beta, self.r_estimator, self.output, self.debias = beta, r_estimator, output, debias
        self.prior_scale_rate, self.prior_scale_until = prior_scale_rate, prior_scale_until
        self.softmax_noise = softmax_noise
        self.time_update = TimeUpdate(**time_update)

    def unflatten(self, theta):
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            out[name] = theta[start : start + n].reshape(shape)
            start += n
        return out

    def predict(self, theta, x):
        logits = functional_call(self.model, self.unflatten(theta), (x,)).reshape(-1)
        if not isinstance(self.output, str):  # an Observation
            return self.output.predict(logits)
        return torch.softmax(logits, 0) if self.output == "softmax" else logits

    def step(self, x, y):
        x, y = x.double(), y.double()
        self.k += 1
        y_hat = self.predict(self.theta, x)
        H = jacrev(self.predict)(self.theta, x)
        if self.R is None:
            self.R = torch.zeros(y.shape[0], y.shape[0], dtype=torch.float64)
        p_prior = self.p + self.time_update.process_noise
        self.theta, self.p, self.R = loko_step_reference(
            self.theta, self.p, self.R, H, y_hat, y, self.k, beta=self.beta, r_estimator=self.r_estimator, rcond=RTOL,
            time_update=self.time_update, debias=self.debias, prior_scale_rate=self.prior_scale_rate,
            prior_scale_until=self.prior_scale_until, softmax_noise=self.softmax_noise,
        )  # fmt: skip
        noise = self.R / (1 - self.beta**self.k) if self.debias else self.R
        if self.softmax_noise:
            noise = noise + torch.diag(y_hat) - torch.outer(y_hat, y_hat)
        eig = torch.linalg.eigvalsh((H * p_prior) @ H.T + noise)  # S
        rel = eig.abs() / eig.abs().max()
        assert not ((rel > 1e-13) & (rel < 1e-7)).any(), f"no clean spectral gap: {rel}"
        return y_hat


def assert_matches_dense(model, opt, reference):
    """The fast path's θ̃, p̂ and R against a :class:`DenseModelFilter` after the same samples; returns θ̃.

    The same float64 arithmetic in another order: after ~100 steps of a contracting filter the relative error stays
    near 1e-13, so 1e-9 leaves room without hiding an algorithmic difference.
    """
    params = list(model.parameters())
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(theta, reference.theta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(flat_cov(opt, params), reference.p, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(opt.state[params[0]]["R"], reference.R, rtol=1e-9, atol=1e-15)
    return theta


def mlp(d_in=5, hidden=7, m=4, dtype=torch.float64):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, m)).to(dtype)


def teacher_stream(n, d_in=5, m=4, seed=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(m, d_in, generator=gen, dtype=dtype)
    for _ in range(n):
        x = torch.randn(1, d_in, generator=gen, dtype=dtype)
        yield x, F.one_hot((x @ w.T).argmax(), m).to(dtype)


def loko_closure(model, x, y, **kwargs):
    def closure():
        prediction, jacobians = jacobian(model, x, **kwargs)
        return prediction, y, jacobians

    return closure


def flat(tensors):
    """Tensors as one flat vector, in order."""
    return torch.cat([t.reshape(-1) for t in tensors])


def flat_cov(opt, params):
    return flat(opt.state[p]["cov"] for p in params)


def jacrev_rows(model, x, *, probabilities):
    """``∂ŷ/∂θ̃`` (``probabilities``: of the softmax) or ``∂z/∂θ̃`` of the logits, one ``(m, ñ)`` matrix, and ``ŷ``,
    by ``jacrev`` on one sample (nothing of the Jacobian engine)."""
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]

    def outputs(*values):
        z = functional_call(model, dict(zip(names, values, strict=True)), (x,))[0]
        return torch.softmax(z, -1) if probabilities else z

    jac = jacrev(outputs, argnums=tuple(range(len(params))))(*params)
    out = outputs(*params)
    y_hat = out if probabilities else torch.softmax(out, -1)
    return torch.cat([j.reshape(out.shape[0], -1) for j in jac], 1), y_hat


class SmallConvNet(nn.Module):
    """Conv layers with few and many positions, a Linear on tokens and a head: every Jacobian block kind."""

    def __init__(self, m=4):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.conv3 = nn.Conv2d(4, 5, 2)  # one output position
        self.tokens = nn.Linear(4, 4)
        self.head = nn.Linear(5 + 4, m)

    def forward(self, x):
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))  # (1, 4, 2, 2)
        pooled = torch.tanh(self.conv3(h)).flatten(1)  # (1, 5)
        tokens = torch.tanh(self.tokens(h.flatten(2).transpose(1, 2))).mean(1)  # (1, 4)
        return self.head(torch.cat([pooled, tokens], 1))


def conv_stream(n, m=4, seed=5):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(m, 2 * 4 * 4, generator=gen, dtype=torch.float64)
    for _ in range(n):
        x = torch.randn(1, 2, 4, 4, generator=gen, dtype=torch.float64)
        yield x, F.one_hot((x.reshape(1, -1) @ w.T).argmax(), m).to(torch.float64)


def factor_dense(jac, param):
    """An exact factorization of a dense block: left = the dense rows, right = identity (k = cols)."""
    m, rows = jac.shape[0], param.shape[0]
    cols = param[0].numel()
    return FactoredJacobian(jac.reshape(m, rows, cols), torch.eye(cols, dtype=jac.dtype), param.shape)


def variant(name):
    """LoKO's keyword for a variant named in a test: a filter (``natural``, ``lofi3``, ...) or an observation."""
    filters = r"covariance|natural(_exact|_sampled)?|lofi\d+(_empirical|_sampled)?"
    return {"filter": name} if re.fullmatch(filters, name) else {"observation": name}
