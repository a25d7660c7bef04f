"""The networks LoKO adapts: factories that build a pretrained backbone with peft adapters and a new head."""

from loko_lightning.models.networks import NetworkFactory, TimmClassifier, TransformersClassifier

__all__ = ["NetworkFactory", "TimmClassifier", "TransformersClassifier"]
