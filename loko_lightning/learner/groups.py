"""The learner's param-group policy, and the optimizer built over its groups.

Which trainable parameters share a factor on the prior (``step_scales``) and a covariance of the head's rows
(``head_covariance``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import nn

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.groups import check_shared_rows
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.models.adapters import PARAMETER_KINDS, parameter_kind

__all__ = ["HEAD_COVARIANCES", "build_optimizer", "check_head_covariance", "check_step_scales", "parameter_groups"]

#: ``OnlineClassifier``'s ``head_covariance``: the paper's diagonal, or one full covariance shared by the head's rows.
HEAD_COVARIANCES = ("diagonal", "shared")


def parameter_groups(
    network: nn.Module, step_scales: Mapping[str, float] | None, head_covariance: str
) -> list[dict[str, Any]]:
    """The trainable parameters in their fixed order, in runs of one factor and one covariance.

    A run's ``"scale"`` is its ``step_scales`` factor, its ``"shared_rows"`` whether it holds the head's matrices
    with ``head_covariance="shared"``.
    """
    groups: list[dict[str, Any]] = []
    for name, param in network.named_parameters():
        if not param.requires_grad:
            continue
        kind = parameter_kind(name)
        scale = float((step_scales or {}).get(kind, 1.0))
        shared = head_covariance == "shared" and kind == "head" and param.dim() >= 2
        if groups and groups[-1]["scale"] == scale and groups[-1]["shared_rows"] == shared:
            groups[-1]["params"].append(param)
        else:
            groups.append({"params": [param], "scale": scale, "shared_rows": shared})
    return groups


def build_optimizer(
    factory: OptimizerCallable,
    groups: list[dict[str, Any]],
    kalman: bool,
    owner: Any = None,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """``factory`` over :func:`parameter_groups`' runs, each with its factor.

    LoKO with each run's ``p0_scale`` (and ``shared_rows``), a gradient optimizer with each run's ``lr`` multiplied by
    its factor; ``overrides`` are the optimizer's keyword arguments a selection tries (``p0=0.3``).
    """
    if kalman:
        return factory(
            [{"params": g["params"], "p0_scale": g["scale"], "shared_rows": g["shared_rows"]} for g in groups],
            **overrides,
        )
    built = factory([{"params": g["params"]} for g in groups], **overrides)
    for group, scaled in zip(built.param_groups, groups, strict=True):
        if "lr" not in group:
            raise ConfigError(
                f"step_scales scales LoKO's p0 or a gradient optimizer's lr; {type(built).__name__} has neither: "
                "remove step_scales",
                field="step_scales",
                owner=owner,
            )
        group["lr"] = group["lr"] * scaled["scale"]
    return built


def check_head_covariance(value: Any, probed: torch.optim.Optimizer, owner: Any) -> str:
    """``head_covariance`` checked: a known value, and ``"shared"`` only where LoKO builds it.

    ``probed`` is the optimizer built on a stand-in parameter.
    """
    if value not in HEAD_COVARIANCES:
        raise ConfigError(
            f"head_covariance must be one of {', '.join(HEAD_COVARIANCES)}, got {value!r}",
            field="head_covariance",
            owner=owner,
        )
    if value == "shared" and not isinstance(probed, LoKO):
        raise ConfigError(
            "head_covariance: shared is a covariance of LoKO's filter; a gradient optimizer keeps none. Remove it, "
            "or use LoKO",
            field="head_covariance",
            owner=owner,
        )
    if value == "shared":  # the filter, shard and time updates the optimizer would refuse the shared group for
        group = {**probed.defaults, "params": [nn.Parameter(torch.zeros(2, 2))], "shared_rows": True}
        try:
            check_shared_rows(probed.filter, group, probed.shard)
        except ConfigError as err:
            raise ConfigError(
                f"head_covariance: shared is refused by the optimizer: {err.args[0]}",
                field="head_covariance",
                owner=owner,
            ) from None
    return value


def check_step_scales(scales: Any, owner: Any) -> dict[str, float] | None:
    """``step_scales`` as ``{kind: factor}``; an unknown kind or a factor that is not finite and > 0 is refused."""
    if scales is None:
        return None
    if not isinstance(scales, Mapping):
        raise ConfigError(
            f"step_scales must map kinds of parameter to factors, e.g. {{'head': 0.1}}, got {scales!r}",
            field="step_scales",
            owner=owner,
        )
    for kind, factor in scales.items():
        if kind not in PARAMETER_KINDS:
            raise ConfigError(
                f"step_scales: unknown kind of parameter {kind!r}; known: {', '.join(PARAMETER_KINDS)}",
                field="step_scales",
                owner=owner,
            )
        number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not (number and 0 < factor < float("inf")):
            raise ConfigError(
                f"step_scales: the factor of {kind} must be a finite number > 0, got {factor!r}",
                field="step_scales",
                owner=owner,
            )
    return {kind: float(factor) for kind, factor in scales.items()}
