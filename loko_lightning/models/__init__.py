"""The networks LoKO adapts: factories that build a pretrained backbone with peft adapters and a new head.

:class:`NetworkFactory` is the base of every factory (argument check, head policy, preprocessing),
:class:`LoraClassifier` the template of the peft families, :class:`TimmClassifier` (images,
:mod:`~loko_lightning.models.vision`) and :class:`TransformersClassifier` (text, :mod:`~loko_lightning.models.text`) the
families shipped.
"""

from loko_lightning.models.factory import LoraClassifier, NetworkFactory
from loko_lightning.models.text import TransformersClassifier
from loko_lightning.models.vision import TimmClassifier

__all__ = ["LoraClassifier", "NetworkFactory", "TimmClassifier", "TransformersClassifier"]
