"""Out-of-distribution (OOD) samples inserted into the stream: a small interface and the paper's image OOD.

A :class:`Perturbation` decides where its samples go (:meth:`~Perturbation.inserted`, :meth:`~Perturbation.locate`)
and makes each one from a raw sample, deterministically from the stream seed and position, so a resumed run sees
the same samples. :class:`RotationJitter` is the paper's robustness experiment: after every ``N`` samples, a copy
of the previous one rotated and jittered in brightness and contrast.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode

from loko_lightning.errors import ConfigError


class Perturbation:
    """Extra stream samples: perturbed copies of normal samples, at positions the perturbation chooses.

    A base class (not a protocol) so that the ``loko`` command lists and takes its subclasses by ``class_path``
    (``--data.perturbation RotationJitter``).

    Attributes:
        every: the period in normal samples of a periodic perturbation, saved with the stream position (a resumed
            run must insert the same samples); ``None`` for another one.
    """

    every: int | None = None

    def inserted(self, num_samples: int) -> int:
        """How many perturbed samples a stream of ``num_samples`` normal samples gets."""
        raise NotImplementedError

    def locate(self, position: int) -> tuple[int, bool]:
        """Which normal sample stream ``position`` shows (an index into the stream order) and whether perturbed."""
        raise NotImplementedError

    def __call__(self, sample: Any, position: int, seed: int) -> Any:
        """The perturbed copy of raw ``sample`` shown at ``position`` of the stream with ``seed``."""
        raise NotImplementedError


class PeriodicPerturbation(Perturbation):
    """One perturbed copy of the previous sample after every ``every`` normal samples; subclasses perturb.

    The stream is ``every`` normal, 1 perturbed, ``every`` normal, 1 perturbed, ...

    Args:
        every: the period, in normal samples.
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ConfigError(
                f"every must be a positive integer (normal samples per OOD sample), got {every}.",
                field="every",
                owner=type(self),
            )
        self.every = every

    def inserted(self, num_samples: int) -> int:
        """``num_samples // every``."""
        return num_samples // self.every

    def locate(self, position: int) -> tuple[int, bool]:
        """In each block of ``every + 1`` positions, the last one shows the previous sample, perturbed."""
        block, offset = divmod(position, self.every + 1)
        if offset == self.every:
            return block * self.every + offset - 1, True
        return block * self.every + offset, False

    def __call__(self, sample: Any, position: int, seed: int) -> Any:
        """Overridden by subclasses."""
        raise NotImplementedError


def ood_params(seed: int, position: int, rotation: float, jitter: float) -> tuple[float, float, float]:
    """Rotation angle and brightness/contrast factors of the OOD sample at ``position`` of stream ``seed``.

    Drawn like ``torchvision.transforms.RandomRotation(rotation)`` and ``ColorJitter(brightness=jitter,
    contrast=jitter)`` would, but from a generator seeded with ``(seed, position)`` instead of the global RNG, so the
    same stream position always gets the same transform, in any process and after any resume.

    Args:
        seed: stream seed.
        position: 0-based stream position of the OOD sample.
        rotation: largest absolute rotation in degrees.
        jitter: brightness and contrast factors are drawn from ``[max(0, 1 - jitter), 1 + jitter]``.

    Returns:
        ``(angle, brightness, contrast)``.
    """
    rng = np.random.default_rng([seed, position])
    angle = float(rng.uniform(-rotation, rotation))
    brightness = float(rng.uniform(max(0.0, 1.0 - jitter), 1.0 + jitter))
    contrast = float(rng.uniform(max(0.0, 1.0 - jitter), 1.0 + jitter))
    return angle, brightness, contrast


class RotationJitter(PeriodicPerturbation):
    """The paper's OOD images: after every ``every`` samples, the previous image rotated and jittered.

    Args:
        every: the period, in normal samples (the paper: 100).
        rotation: largest absolute rotation, in degrees (the paper: 30).
        jitter: brightness and contrast factors are drawn from ``[1 - jitter, 1 + jitter]`` (the paper: 0.5).
    """

    def __init__(self, every: int = 100, rotation: float = 30.0, jitter: float = 0.5) -> None:
        super().__init__(every)
        if not 0 <= rotation <= 180:
            raise ConfigError(
                f"rotation must be in [0, 180] degrees, got {rotation}.", field="rotation", owner=type(self)
            )
        if jitter < 0:
            raise ConfigError(f"jitter must be >= 0, got {jitter}.", field="jitter", owner=type(self))
        self.rotation = rotation
        self.jitter = jitter

    def __call__(self, sample: Image.Image, position: int, seed: int) -> Image.Image:
        """Rotate (bilinear) then adjust brightness and contrast, with :func:`ood_params` of ``(seed, position)``."""
        angle, brightness, contrast = ood_params(seed, position, self.rotation, self.jitter)
        image = TF.rotate(sample, angle, interpolation=InterpolationMode.BILINEAR)
        return TF.adjust_contrast(TF.adjust_brightness(image, brightness), contrast)
