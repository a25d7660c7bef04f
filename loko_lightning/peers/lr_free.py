"""Learning-rate-free fine-tuners from their own packages, on the same LoRA parameters and head as AdamW.

Each estimates its step size from the gradients it sees, so it has no learning rate to choose (``lr`` stays a factor
on the estimate, 1 by default). The learner steps them as any gradient optimizer
(:class:`~loko_lightning.learner.steps.GradientStep`: the prediction scored for a sample is made before the step on it).

- :class:`Prodigy` (``prodigyopt``, Mishchenko & Defazio 2024): Adam whose step size ``d`` grows from ``d0`` by an
  estimate of the distance to the solution.
- :class:`DAdaptAdam` (``dadaptation``, Defazio & Mishchenko 2023): D-Adaptation's Adam, the same idea with a lower
  bound on that distance.
- :class:`DoG` (``dog-optimizer``, Ivgi et al. 2023): distance over gradients, SGD with the step the largest distance
  from the start over the root of the summed squared gradient norms.
- :class:`MechanicAdamW` (``mechanic-pytorch``, Cutkosky et al. 2023): torch's AdamW whose updates are scaled by
  Mechanic's learned factor ``s`` (from ``s_init``).
"""

from __future__ import annotations

import torch

from loko_lightning.peers.packages import require

prodigyopt = require("prodigyopt", "prodigyopt", "Prodigy")
dadaptation = require("dadaptation", "dadaptation", "D-Adaptation (DAdaptAdam)")
dog = require("dog", "dog-optimizer", "DoG")
mechanic_pytorch = require("mechanic_pytorch", "mechanic-pytorch", "Mechanic (MechanicAdamW)")


class Prodigy(prodigyopt.Prodigy):
    """``prodigyopt.Prodigy``, with its own arguments (``lr`` a factor on ``d``, ``d0``, ``weight_decay``, ...)."""


class DAdaptAdam(dadaptation.DAdaptAdam):
    """``dadaptation.DAdaptAdam``, with its own arguments (``lr`` a factor on ``d``, ``d0``, ``weight_decay``, ...)."""


class DoG(dog.DoG):
    """``dog.DoG``, with its own arguments (``reps_rel``: the first step's distance relative to the weights, ...)."""


class MechanicAdamW(mechanic_pytorch.mechanize(torch.optim.AdamW)):
    """``mechanic_pytorch.mechanize(torch.optim.AdamW)``: AdamW's arguments; Mechanic's own at their defaults."""
