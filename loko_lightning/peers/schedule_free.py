"""Schedule-free AdamW (Defazio et al. 2024, arXiv 2405.15682) from the ``schedulefree`` package, unchanged.

The optimizer keeps two points: ``y``, where the gradient is taken (the parameters while it is in train mode), and
the average ``x`` (the parameters after ``optimizer.eval()``), which its guarantees, and a linear-decay schedule's
match without a horizon, are about. The learner (:class:`~loko_lightning.learner.peer_steps.ScheduleFreeStep`) predicts
each sample with ``x`` before the step at ``y``, evaluates and predicts with ``x``, and keeps ``x`` in the
checkpoint's weights (``y`` beside it, for an exact resume).
"""

from __future__ import annotations

from loko_lightning.peers.packages import require

schedulefree = require("schedulefree", "schedulefree", "schedule-free AdamW (ScheduleFreeAdamW)")


class ScheduleFreeAdamW(schedulefree.AdamWScheduleFree):
    """``schedulefree.AdamWScheduleFree``, with its own arguments (``lr``, ``betas``, ``weight_decay``, ...).

    A class of this package so that the learner knows how to step it, and a missing package is one clear error.
    """
