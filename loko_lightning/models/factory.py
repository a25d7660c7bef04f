"""Network factories: what the learner trains, chosen in the config by ``class_path``.

A factory is configured cheaply (its arguments are checked, nothing is downloaded or allocated), says what
preprocessing its network needs (:meth:`NetworkFactory.preprocessing`: the data module follows it) and builds the
network when called. The learner (:class:`~loko_lightning.learner.module.OnlineClassifier`) validates the optimizer's
hyperparameters first and only then calls the factory, so a bad config fails before any backbone is built. The
network maps a batch's ``inputs`` to ``(batch, num_classes)`` logits; its trainable parameters are what the optimizer
updates.

:class:`NetworkFactory` is the base of every factory. :class:`LoraClassifier` is the template of the families that put
peft LoRA/DoRA adapters and a new head on a pretrained backbone: :class:`~loko_lightning.models.vision.TimmClassifier`
(timm, images) and :class:`~loko_lightning.models.text.TransformersClassifier` (Hugging Face transformers, text). A new
family is one module with a subclass of either; the data layer does not change.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from numbers import Real
from typing import Any, ClassVar

import torch
from peft import PeftModel
from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.models.adapters import adapt, check_target, lora_config, resolve_targets
from loko_lightning.preprocessing import Preprocessing


class NetworkFactory:
    """Base class of the network factories a learner accepts.

    A subclass checks its arguments in ``__init__`` (:meth:`check_arguments`), builds the network in :meth:`_build`
    and says what its network's inputs must be in :meth:`preprocessing`. Calling the factory builds the network; a
    :class:`~loko_lightning.errors.ConfigError` raised while building names the factory as its owner.

    Attributes:
        modality: the kind of sample the network takes (``"image"`` or ``"text"``), checked against the dataset's.
        head_inits: the initialisations of the new head the family offers. ``"zeros"`` starts the head's output layer
            at 0 (the first prediction is uniform, cross-entropy ``log m``); any other keeps the library's own.
        backbone: name of the backbone (messages and logs).
        num_classes: number of classes (outputs) of the network, ``m``.
        dropout: dropout the factory puts into trainable parts (LoKO's Jacobian needs 0).
        head_init: the chosen head initialisation.
    """

    modality: ClassVar[str] = "image"
    head_inits: ClassVar[tuple[str, ...]] = ("zeros",)
    backbone: str
    num_classes: int
    dropout: float = 0.0
    head_init: str = "zeros"
    _init_args: dict[str, Any] | None = None
    #: Arguments a spec saved before they existed stands for (a default that changed stays the old one there).
    saved_before: ClassVar[dict[str, Any]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> NetworkFactory:
        """Record the arguments the factory is configured with (:meth:`spec`), before ``__init__`` checks them."""
        factory = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(factory, *args, **kwargs)
        except TypeError:  # copy/pickle call __new__ without arguments; __init__ reports a real mismatch itself
            return factory
        bound.apply_defaults()
        arguments = dict(list(bound.arguments.items())[1:])
        factory._init_args = {name: value for name, value in arguments.items() if name not in ("args", "kwargs")}
        return factory

    def spec(self) -> dict[str, Any]:
        """The factory as a configuration: ``{"class_path": ..., "init_args": {...}}`` (what a config file holds).

        The learner saves it in its checkpoints' hyperparameters, so that
        :meth:`~loko_lightning.learner.module.OnlineClassifier.load_from_checkpoint` rebuilds the network with no
        other argument; :meth:`from_spec` reads it back.
        """
        cls = type(self)
        init_args = {name: _plain(value) for name, value in (self._init_args or {}).items()}
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}

    @staticmethod
    def from_spec(spec: Mapping[str, Any]) -> NetworkFactory:
        """The factory a :meth:`spec` describes.

        Only a class that is already imported and is a :class:`NetworkFactory` is built: a checkpoint names the
        class, so nothing is imported (no module's code runs) because a file said so.

        Raises:
            ConfigError: the spec is not a ``class_path``/``init_args`` mapping, or names no known factory.
        """
        class_path = spec.get("class_path") if isinstance(spec, Mapping) else None
        init_args = spec.get("init_args", {}) if isinstance(spec, Mapping) else None
        if not isinstance(class_path, str) or not isinstance(init_args, Mapping):
            raise ConfigError(
                f"network must be a network factory or a mapping with class_path and init_args, got {spec!r}",
                field="network",
            )
        known = {f"{c.__module__}.{c.__qualname__}": c for c in _subclasses(NetworkFactory)}
        if class_path not in known:
            raise ConfigError(
                f"network class_path {class_path!r} is not an imported NetworkFactory (known: {sorted(known)}); "
                "import the module that defines it before loading",
                field="network",
            )
        cls = known[class_path]
        return cls(**{**cls.saved_before, **init_args})

    def __call__(self) -> nn.Module:
        """Build the network (weights are loaded here, not at configuration time)."""
        try:
            return self._build()
        except ConfigError as err:  # raised by the builders, about one of this factory's arguments
            err.owner = err.owner or type(self)
            raise

    def _build(self) -> nn.Module:
        raise NotImplementedError

    def preprocessing(self) -> Preprocessing:
        """What the network needs its inputs to be; the data module turns it into the transform of its samples.

        Read from the factory's arguments and the backbone's published configuration, without building the network.
        """
        raise NotImplementedError(f"{type(self).__name__} does not say what preprocessing its network needs")

    def check_arguments(self, **arguments: Any) -> None:
        """Check the arguments factories share (only those given).

        Args:
            **arguments: any of ``backbone``, ``num_classes``, ``target``, ``r``, ``alpha``, ``dropout``,
                ``head_init``, by name.

        Raises:
            ConfigError: naming the first bad argument, with this factory as its owner.
        """
        for name, value in arguments.items():
            try:
                if name == "target":
                    check_target(value)
                    continue
                problem = _problem(name, value, self.head_inits)
            except ConfigError as err:
                err.owner = type(self)
                raise
            if problem is not None:
                raise ConfigError(f"{problem}, got {value!r}", field=name, owner=self)

    def init_head(self, layer: nn.Linear) -> None:
        """Initialise the new head's output layer as :attr:`head_init` says (``"zeros"``: weight and bias 0)."""
        if self.head_init != "zeros":
            return
        with torch.no_grad():
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()


def _plain(value: Any) -> Any:
    """A configuration value as plain Python (a tuple becomes a list, as a config file would hold it)."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _subclasses(cls: type) -> list[type]:
    """Every imported subclass of ``cls``, recursively."""
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _problem(name: str, value: Any, head_inits: tuple[str, ...]) -> str | None:
    """What is wrong with one shared argument (the start of its message), or ``None``."""
    number = isinstance(value, Real) and not isinstance(value, bool)
    positive_integer = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if name == "backbone" and not (isinstance(value, str) and value):
        return "backbone must be a model name or directory"
    if name == "num_classes" and not positive_integer:
        return "num_classes must be a positive integer"
    if name == "r" and not positive_integer:
        return "r (the adapter rank) must be a positive integer"
    if name == "alpha" and value is not None and not (number and value > 0):
        return "alpha (the LoRA scaling numerator) must be a positive number, or null for r"
    if name == "dropout" and not (number and 0.0 <= value < 1.0):
        return "dropout must lie in [0, 1)"
    if name == "head_init" and value not in head_inits:
        return f"head_init must be {' or '.join(repr(choice) for choice in head_inits)}"
    return None


class LoraClassifier(NetworkFactory):
    """A pretrained backbone with a new ``num_classes`` head and peft LoRA (or DoRA) adapters; the rest frozen.

    The template of the peft families. Building loads the backbone with its new head (:meth:`_load`), initialises
    the head's output layer (:meth:`~NetworkFactory.init_head`), places the adapters
    (:func:`~loko_lightning.models.adapters.resolve_targets`, never in the head) and wraps the model with peft
    (:func:`~loko_lightning.models.adapters.lora_config`), in that order, so the same seed gives the same initial
    weights. A family fills in :meth:`_load`, :meth:`_head` and :meth:`preprocessing`, and where it needs to,
    :meth:`_peft_options` and :meth:`_finish`.

    Args:
        backbone: the pretrained backbone's name (the family says which names it knows).
        num_classes: classes of the new head (``m``).
        pretrained: load the backbone's weights (``False``: random weights of the same architecture).
        weights: where the weights come from instead of the hub (the family says what it takes).
        target: adapter placement: a preset (``"convs"``, ``"query"``), a list of module names, or a regex over
            module names (see :mod:`~loko_lightning.models.adapters`).
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); default ``r``.
        dropout: LoRA dropout (baselines only: LoKO's Jacobian needs a deterministic network).
        use_dora: DoRA instead of LoRA.
        head_init: the new head's initialisation, one of the family's :attr:`~NetworkFactory.head_inits`.
    """

    def __init__(
        self,
        backbone: str,
        num_classes: int,
        pretrained: bool = True,
        weights: str | None = None,
        target: str | list[str] = "convs",
        r: int = 4,
        alpha: float | None = None,
        dropout: float = 0.0,
        use_dora: bool = False,
        head_init: str = "zeros",
    ) -> None:
        self.check_arguments(
            backbone=backbone, num_classes=num_classes, target=target, r=r, alpha=alpha, dropout=dropout,
            head_init=head_init,
        )  # fmt: skip
        self.backbone, self.num_classes = backbone, num_classes
        self.pretrained, self.weights = pretrained, None if weights is None else str(weights)
        self.target = target if isinstance(target, str) else list(target)
        self.r, self.alpha, self.dropout, self.use_dora, self.head_init = r, alpha, dropout, use_dora, head_init

    def _build(self) -> nn.Module:
        model = self._load()
        head, output = self._head(model)
        self.init_head(output)
        targets = resolve_targets(model, self.target, rank=self.r, exclude=head)
        config = lora_config(
            targets, r=self.r, alpha=self.alpha, dropout=self.dropout, use_dora=self.use_dora,
            **self._peft_options(head),
        )  # fmt: skip
        return self._finish(adapt(model, config))

    def _load(self) -> nn.Module:
        """The backbone with a new ``num_classes`` head (weights loaded as ``pretrained``/``weights`` say)."""
        raise NotImplementedError

    def _head(self, model: nn.Module) -> tuple[str, nn.Linear]:
        """The name of the new head (trained in full, never adapted) and its output layer."""
        raise NotImplementedError

    def _peft_options(self, head: str) -> dict[str, Any]:
        """What the family adds to the ``LoraConfig``: by default, the head trained in full (``modules_to_save``)."""
        return {"modules_to_save": [head]}

    def _finish(self, network: PeftModel) -> nn.Module:
        """The network the learner trains, from the peft model (by default the peft model itself)."""
        return network

    def __repr__(self) -> str:
        source = self.weights if self.weights is not None else ("hub" if self.pretrained else "random")
        return (
            f"{type(self).__name__}({self.backbone!r}, num_classes={self.num_classes}, weights={source}, "
            f"target={self.target!r})"
        )
