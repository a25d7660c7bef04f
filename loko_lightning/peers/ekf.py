r"""The diagonal empirical-Fisher EKF of ``posteriors`` (``posteriors.ekf.diag_fisher``) as a torch optimizer.

``posteriors`` is functional: a state (the mean and the standard deviations of a diagonal Gaussian) and an update
that reads a log-likelihood function of the parameters. :class:`DiagonalFisherEKF` keeps that state as a torch
optimizer's (the parameters are the mean, ``state[p]["sd"]`` the deviations), so checkpoints, resuming and the
online selection work as for any optimizer, and each step hands the state to ``posteriors.ekf.diag_fisher.update``
unchanged. The learner (:class:`~loko_lightning.learner.peer_steps.FunctionalStep`) supplies the per-sample
log-likelihood of the step's samples; the prediction scored is the one ``posteriors`` computes at the mean before
its update.

The update, with ``g`` the gradient of the log-likelihood averaged over the step's ``B`` samples and ``ε = lr``:

.. math::

    \sigma^2_{k|k-1} = \sigma^2_{k-1} + s^2, \qquad
    \sigma^{-2}_k = \sigma^{-2}_{k|k-1} + \varepsilon\,\overline{g_b^{\odot 2}}, \qquad
    \mu_k = \mu_{k-1} + \varepsilon\,\sigma^2_k \odot \bar g.

With one sample a step, ``lr = 1`` and ``transition_sd`` :math:`= \sqrt q` this is LoKO's ``natural`` filter
(:class:`~loko_lightning.kalman.filters.DiagonalInformation` with the empirical Fisher) started from
``p̂₀ = p0``: the same posterior precision and mean step (``tests/test_peers.py`` checks it in float64). They
differ in a batch (``posteriors`` averages the samples' gradients and squared gradients, ``natural`` sums them,
which is ``lr = B``), in where the process noise enters (``posteriors`` adds it to the variance before the step;
LoKO's time update can also floor, shrink or inflate), and in the first variance (LoKO's ``p0_init: uniform`` draws
each ``p̂₀`` entry; here every entry starts at ``p0``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.peers.packages import require

diag_fisher = require("posteriors.ekf.diag_fisher", "posteriors", "the posteriors EKF (DiagonalFisherEKF)")

LogLikelihood = Callable[[dict[str, Tensor], Any], tuple[Tensor, Tensor]]


def tree(values: list[Tensor]) -> dict[str, Tensor]:
    """The parameters as ``posteriors`` takes them: a dict, ``"p{i}"`` for the optimizer's ``i``-th parameter."""
    return {f"p{index}": value for index, value in enumerate(values)}


class DiagonalFisherEKF(torch.optim.Optimizer):
    """``posteriors.ekf.diag_fisher`` over the parameters, one update per :meth:`step`.

    Args:
        params: the parameters (the mean of the Gaussian).
        p0: the initial variance of every parameter (``init_sds = sqrt(p0)`` in ``posteriors``): the quantity LoKO's
            ``p0`` is, chosen online the same way (``p0: auto``).
        lr: ``posteriors``' inverse temperature of the likelihood (1: the Bayesian update).
        transition_sd: ``posteriors``' standard deviation of the process noise added before each update.

    :meth:`step` takes a closure returning ``(log_likelihood, batch)``: ``log_likelihood(params, batch)`` returns the
    ``(B,)`` log-likelihoods of the samples and, as auxiliary output, the ``(B, m)`` logits, for ``params`` a dict
    of the optimizer's parameters (:func:`tree`: ``"p{i}"`` for the ``i``-th). It returns the logits at the mean
    before the update, and whether the update was applied (a 0-d bool tensor: a non-finite log-likelihood, gradient
    or variance changes nothing).
    """

    def __init__(self, params: Any, p0: float = 0.1, lr: float = 1.0, transition_sd: float = 0.0) -> None:
        for name, value, low in (("p0", p0, "> 0"), ("lr", lr, "> 0"), ("transition_sd", transition_sd, ">= 0")):
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (value < 0 if low == ">= 0" else value <= 0):
                raise ConfigError(f"Invalid {name}: {value!r} (must be a finite number {low})", field=name, owner=self)
        super().__init__(params, {"p0": float(p0), "lr": float(lr), "transition_sd": float(transition_sd)})
        if len(self.param_groups) != 1:
            raise ConfigError(
                "DiagonalFisherEKF takes one parameter group (posteriors updates one tree with one lr)",
                field="params",
                owner=self,
            )

    @property
    def params(self) -> list[Tensor]:
        """The parameters, in the order of the trees handed to ``posteriors``."""
        return list(self.param_groups[0]["params"])

    @torch.no_grad()
    def step(self, closure: Callable[[], tuple[LogLikelihood, Any]]) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """One ``posteriors`` EKF update on the closure's samples (see the class)."""
        if closure is None:
            raise ConfigError(
                "DiagonalFisherEKF.step needs a closure returning (log_likelihood, batch)", field=None, owner=self
            )
        with torch.enable_grad():
            log_likelihood, batch = closure()
        group = self.param_groups[0]
        params = self.params
        sds = [self._sd(p, group["p0"]) for p in params]
        state = diag_fisher.init(tree([p.detach() for p in params]), init_sds=tree(sds))
        new, logits = diag_fisher.update(
            state,
            batch,
            log_likelihood,
            lr=group["lr"],
            transition_sd=group["transition_sd"],
            per_sample=True,
        )
        finite = torch.isfinite(new.log_likelihood).all()
        means, deviations = list(new.params.values()), list(new.sd_diag.values())
        for mean, sd in zip(means, deviations, strict=True):
            finite &= torch.isfinite(mean).all() & torch.isfinite(sd).all()
        if finite:  # one host sync: a non-finite update must not reach the state
            for p, mean, sd in zip(params, means, deviations, strict=True):
                p.copy_(mean)
                self.state[p]["sd"] = sd.detach().clone()
        return logits.detach(), finite

    def _sd(self, param: Tensor, p0: float) -> Tensor:
        state = self.state[param]
        if "sd" not in state:
            state["sd"] = torch.full_like(param, math.sqrt(p0))
        return state["sd"]
