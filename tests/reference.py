"""A slow, obviously correct float64 reference of LoKO (Algorithm 1) with dense matrices.

Nothing here is shared with the package: the state is one flat vector, P is a dense diagonal matrix, the
Jacobian comes from ``torch.func.jacrev`` and the gain from ``torch.linalg.pinv``.
"""

import math

import torch
from torch.func import functional_call, jacrev

# S is singular by construction with softmax outputs; its spurious eigenvalue along the all-ones vector is
# rounding noise (|λ| ≲ 1e-14 λ_max in float64), genuine ones are far above 1e-10 λ_max in these tests
# (asserted below), so the cut-off sits in a wide, empty gap of the spectrum.
RTOL = 1e-10


class ReferenceLoKO:
    def __init__(self, model, p0_vector, *, beta, r_estimator, process_noise=0.0, output="softmax"):
        self.model = model
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shapes = [p.shape for n, p in model.named_parameters() if p.requires_grad]
        self.theta = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if p.requires_grad])
        self.theta = self.theta.double()
        self.P = None if p0_vector is None else torch.diag(p0_vector.double().clone())
        self.R = None
        self.k = 0
        self.beta, self.r_estimator, self.q, self.output = beta, r_estimator, process_noise, output

    def unflatten(self, theta):
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = math.prod(shape)
            out[name] = theta[start : start + n].reshape(shape)
            start += n
        return out

    def predict(self, theta, x):
        logits = functional_call(self.model, self.unflatten(theta), (x,)).reshape(-1)
        return torch.softmax(logits, 0) if self.output == "softmax" else logits

    def step(self, x, y):
        x, y = x.double(), y.double()
        self.k += 1
        self.P = self.P + self.q * torch.eye(self.P.shape[0], dtype=torch.float64)
        y_hat = self.predict(self.theta, x)
        H = jacrev(self.predict)(self.theta, x)
        m = y.shape[0]
        e = y - y_hat
        HPHt = H @ self.P @ H.T
        if self.R is None:
            self.R = torch.zeros(m, m, dtype=torch.float64)
        if self.r_estimator == "taylor":
            self.R = self.beta * self.R + (1 - self.beta) * (torch.outer(e, e) + HPHt)
        elif self.r_estimator == "residual":
            self.R = self.beta * self.R + (1 - self.beta) * torch.outer(e, e)
        elif self.r_estimator == "identity":
            self.R = torch.eye(m, dtype=torch.float64)
        elif self.r_estimator == "decay":
            self.R = torch.eye(m, dtype=torch.float64) * math.exp(-self.k / 50)
        elif self.r_estimator == "softmax":
            self.R = torch.diag(y_hat) - torch.outer(y_hat, y_hat)
        S = HPHt + self.R
        eig = torch.linalg.eigvalsh(S)
        rel = eig.abs() / eig.abs().max()
        assert not ((rel > 1e-13) & (rel < 1e-7)).any(), f"no clean spectral gap: {rel}"
        K = self.P @ H.T @ torch.linalg.pinv(S, rtol=RTOL, hermitian=True)
        self.theta = self.theta + K @ e
        # (p_k)_i = (p_{k|k-1})_i - (K H)_ii (p_{k|k-1})_i: the diagonal of P - K H P.
        self.P = torch.diag(torch.diag(self.P) - torch.diag(K @ H) * torch.diag(self.P))
        return y_hat
