"""IVON, the improved variational online Newton method (Shen et al. 2024, arXiv 2402.17641), from ``ivon-opt``.

IVON keeps a diagonal Gaussian posterior over the parameters: the mean (the parameters themselves), a Hessian
estimate ``h`` and a momentum. Each step draws the parameters from the posterior (``optimizer.sampled_params``),
takes the gradient there and updates the mean and ``h``. The learner
(:class:`~loko_lightning.learner.peer_steps.IVONStep`) predicts each sample with the mean before drawing, which is also
what evaluation, ``loko predict`` and the checkpoint's weights use.

Its arguments, as ``ivon.IVON`` takes them: ``lr`` (tuned like AdamW's), ``ess`` (the effective sample size: the
number of samples the posterior is for; ``benchmarks/compare.py`` sets it to the stream's length, as IVON's authors
set it to the training set's size), ``hess_init`` (the initial ``h``: the first steps' size is ``lr`` times
``1 / (hess_init + weight_decay)`` times the gradient, and the first draws' spread ``1 / sqrt(ess (hess_init +
weight_decay))``), ``weight_decay`` (the prior's precision per sample), ``beta1``, ``beta2``, ``mc_samples``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loko_lightning.peers.packages import require

ivon = require("ivon", "ivon-opt", "IVON")


class IVON(ivon.IVON):
    """``ivon.IVON`` whose step applies the draws the learner made, and whose state resumes exactly.

    Two changes, neither to the method:

    - :meth:`step` applies the gradients collected by ``sampled_params(train=True)`` (the learner draws them, as
      IVON's README loop does) and ignores a closure's value (Lightning's optimizer wrapper passes one that returns
      nothing). With no draw since the last step (a skipped sample) it changes nothing.
    - :meth:`state_dict` keeps the step counter of the momentum's bias correction, which ``ivon.IVON`` holds as an
      attribute outside its state: without it a resumed run would restart the correction.
    """

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Apply the draws since the last step (none: nothing changes)."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.state["count"] == 0:
            return None
        super().step()
        return None

    def state_dict(self) -> dict[str, Any]:
        """``ivon.IVON``'s state and the step counter."""
        state = super().state_dict()
        state["current_step"] = self.current_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        state = dict(state_dict)
        self.current_step = int(state.pop("current_step", 0))
        super().load_state_dict(state)
