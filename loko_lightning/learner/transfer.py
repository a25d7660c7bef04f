"""Adapter transfer: a checkpoint's adapters (and, where the filter allows, what it learned about them) into a new run.

A new label set on trained adapters: the LoRA weights carry over with their covariance ``p̂`` when both runs are LoKO and
the saved filter's belief about a parameter is ``p̂`` alone; the head, ``R`` and the counters start fresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import get_filter
from loko_lightning.models.adapters import parameter_kind

__all__ = ["data_preprocessing", "load_adapters"]


def load_adapters(module: Any, path: str) -> None:
    """The adapters of the checkpoint at ``path`` into ``module`` (an ``OnlineClassifier`` whose optimizer is built).

    See :meth:`~loko_lightning.OnlineClassifier.load_adapters`.
    """
    field = "adapters_from"
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"no checkpoint file at {path!r}", field=field, owner=type(module))
    checkpoint = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=True)
    saved_spec = (checkpoint.get("hyper_parameters") or {}).get("network") or {}
    spec = module.network_factory.spec()
    saved_args, own_args = dict(saved_spec.get("init_args") or {}), dict(spec["init_args"])
    saved_args.pop("num_classes", None), own_args.pop("num_classes", None)
    differ = sorted(k for k in set(saved_args) | set(own_args) if saved_args.get(k) != own_args.get(k))
    if saved_spec.get("class_path") != spec["class_path"] or differ:
        said = ", ".join(f"{k}: {saved_args.get(k)!r} there, {own_args.get(k)!r} here" for k in differ)
        raise ConfigError(
            f"{path} holds adapters of a network configured otherwise ({said or saved_spec.get('class_path')}); "
            "only num_classes may differ. To fix it: configure model.network as that run did",
            field=field,
            owner=type(module),
        )
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    adapters = [i for i, name in enumerate(names) if parameter_kind(name) != "head"]
    saved_state = checkpoint["state_dict"]
    with torch.no_grad():
        for i in adapters:
            parameter = module.get_parameter(names[i])
            parameter.copy_(saved_state[names[i]].to(parameter.device, parameter.dtype))
    kept = "their weights"
    saved_optimizer = (checkpoint.get("optimizer_states") or [{}])[0]
    saved_filter = saved_optimizer.get("state") or {}
    if module.is_kalman and module.select is None and saved_filter and _covariance_alone(saved_optimizer):
        optimizer = module.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        trainable = module.trainable_parameters
        for i in adapters:
            cov = (saved_filter.get(i) or {}).get("cov")
            own = optimizer.state[trainable[i]]
            if cov is not None and "cov" in own and own["cov"].shape == cov.shape:
                own["cov"].copy_(cov.to(own["cov"].device, own["cov"].dtype))
        kept = "their weights and covariance"
    rank_zero_info(
        f"Starting from the adapters of {path} ({len(adapters)} tensors, {kept}) with a new "
        f"{module.num_classes}-class head"
    )


def _covariance_alone(state: dict[str, Any]) -> bool:
    """Whether a saved LoKO state's ``p̂`` is its filter's whole belief about each parameter (it carries over alone).

    Not where the filter keeps a per-entry state besides it (LoFi's ``W`` couples every parameter).
    """
    spec = ((state.get("param_groups") or [{}])[0]).get("filter", "covariance")
    try:
        return not get_filter(spec).entries()
    except ConfigError:  # a filter this package does not know: its state cannot be read here
        return False


def data_preprocessing(datamodule: Any) -> dict[str, Any] | None:
    """What the data module does to a sample, as plain values; ``None`` when it does not say.

    Images: timm's data config (after the data module's overrides); text: ``{"tokenizer", "max_length"}``.
    """
    data_config = getattr(datamodule, "data_config", None)
    if isinstance(data_config, dict):
        return {key: list(value) if isinstance(value, tuple) else value for key, value in data_config.items()}
    transform = getattr(datamodule, "transform", None)
    tokenizer, max_length = getattr(transform, "source", None), getattr(transform, "max_length", None)
    if isinstance(tokenizer, str) and isinstance(max_length, int):
        return {"tokenizer": tokenizer, "max_length": max_length}
    return None
