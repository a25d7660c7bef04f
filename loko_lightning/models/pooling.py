"""What a text model's new classification head reads: the sentence embedding the backbone was trained to produce.

``transformers``' sequence classifiers put the head on the library's own pooled output (BERT: the CLS token through
the pooler's dense + tanh layer). A sentence-transformers backbone (all-MiniLM-L6-v2) was trained to produce another
embedding, the mean of its token embeddings, and its model folder says so: ``modules.json`` lists a
``sentence_transformers.models.Pooling`` module whose ``config.json`` sets ``pooling_mode_mean_tokens`` (or
``pooling_mode_cls_token``). :func:`sentence_pooling` reads it; :class:`PooledSequenceClassifier` puts the head on
that embedding.

``pooling`` (:class:`~loko_lightning.models.text.TransformersClassifier`'s option):

- ``"mean"``: the attention-mask weighted mean of the last hidden states;
- ``"cls"``: the last hidden state of the first token, without the pooler;
- ``"pooler"``: the library's own head and its input (BERT's pooler output, RoBERTa's classification head);
- ``"auto"``: what the model folder's sentence-transformers configuration says, else ``"pooler"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from torch import Tensor, nn

from loko_lightning.errors import ConfigError

Pooling = Literal["auto", "mean", "cls", "pooler"]
POOLINGS: tuple[str, ...] = ("auto", "mean", "cls", "pooler")
SENTENCE_POOLING = "sentence_transformers.models.Pooling"


def sentence_pooling(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers model folder declares (``"mean"`` or ``"cls"``), or ``None``.

    ``None``: no folder, no ``modules.json`` with a pooling module, or a mode without an equivalent here (max, mean
    over sqrt(length)): the library's head is kept.
    """
    folder = Path(folder).expanduser()
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    paths = [module.get("path", "") for module in modules if module.get("type") == SENTENCE_POOLING]
    if not paths or not (folder / paths[0] / "config.json").is_file():
        return None
    config = json.loads((folder / paths[0] / "config.json").read_text())
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if modes == ["pooling_mode_mean_tokens"]:
        return "mean"
    if modes == ["pooling_mode_cls_token"]:
        return "cls"
    return None


def resolve_pooling(pooling: str, source: str) -> str:
    """``pooling`` with ``"auto"`` replaced by what the model folder ``source`` declares (else ``"pooler"``).

    Raises:
        ConfigError: ``pooling`` is not one of :data:`POOLINGS`.
    """
    if pooling not in POOLINGS:
        raise ConfigError(
            f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}. To fix it: mean (the token average, a "
            "sentence-transformers model's embedding), cls, pooler (the library's head) or auto (the model folder's "
            "1_Pooling config)",
            field="pooling",
        )
    if pooling != "auto":
        return pooling
    declared = sentence_pooling(source) if Path(source).expanduser().is_dir() else None
    return declared or "pooler"


def pool(hidden: Tensor, attention_mask: Tensor | None, pooling: str) -> Tensor:
    """``(B, H)`` sentence embeddings of ``(B, L, H)`` hidden states: their masked mean, or the first token's."""
    if pooling == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        return hidden.mean(1)
    weight = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weight).sum(1) / weight.sum(1).clamp_min(1.0)


class PooledSequenceClassifier(nn.Module):
    """A (peft-wrapped) ``AutoModelForSequenceClassification`` whose classifier reads a pooled sentence embedding.

    The backbone (``model.<base_model_prefix>``, e.g. ``bert``, with its adapters) gives the last hidden states, the
    model's ``classifier`` (an ``nn.Linear``, trained as the new head) maps their pooling to logits. The library's
    pooler is not used.

    Args:
        model: the sequence classifier, its head an ``nn.Linear`` named ``classifier`` over the hidden size.
        input_names: the keys of ``inputs`` the model takes.
        pooling: ``"mean"`` or ``"cls"``.
    """

    def __init__(self, model: nn.Module, input_names: tuple[str, ...], pooling: str) -> None:
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names)
        self.pooling = pooling
        base = self.transformer_model()
        head = getattr(base, "classifier", None)
        inner = getattr(head, "modules_to_save", None)
        linear = next(iter(inner.values())) if inner is not None else head
        hidden = getattr(base.config, "hidden_size", None)
        if not isinstance(linear, nn.Linear) or linear.in_features != hidden:
            raise ConfigError(
                f"pooling={pooling!r} puts the head on the {hidden}-dimensional sentence embedding, but the "
                f"{type(base).__name__} head is {type(linear).__name__}. To fix it: pooling pooler (the library's "
                "head) for this backbone, or a BERT-family backbone",
                field="pooling",
            )

    def transformer_model(self) -> nn.Module:
        """The transformers model under peft (its modules carry the adapters)."""
        get_base = getattr(self.model, "get_base_model", None)
        return get_base() if callable(get_base) else self.model

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """``(B, m)`` logits of the pooled embedding of ``inputs`` (``input_ids``, ``attention_mask``, ...)."""
        if not isinstance(inputs, Mapping):
            raise ValueError(
                f"Invalid inputs: a text model takes a dict of token tensors (input_ids, attention_mask), got "
                f"{type(inputs).__name__}; is an image stream feeding a text model?"
            )
        base = self.transformer_model()
        encoder = getattr(base, base.base_model_prefix)
        given = {k: v for k, v in inputs.items() if k in self.input_names}
        hidden = encoder(**given).last_hidden_state
        return base.classifier(pool(hidden, given.get("attention_mask"), self.pooling))
