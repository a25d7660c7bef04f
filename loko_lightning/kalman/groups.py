r"""What a param group of :class:`~loko_lightning.LoKO` says: its prior, its time update, whether its rows share Σ.

The prior: :math:`\hat p_0` of every parameter from its group's ``p0``, ``p0_scale`` and ``p0_init``:

- ``"uniform"`` (the paper's method 2, the default): a draw from :math:`U(0, p_0]` per entry;
- ``"constant"`` (method 1): :math:`p_0` everywhere;
- ``"fan_in"`` (not the paper): the constant :math:`p_0 / \text{fan\_in}`, ``fan_in`` the product of the shape
  after the first dimension (1 for vectors).

A group's ``p0_scale`` multiplies its ``p0`` (:func:`group_p0`), so a ``p0`` chosen online keeps the ratio between
groups. The reference variance of stabilised forgetting is the largest :math:`\hat p_0` the group draws
(:func:`reference_cov`). The time update of each parameter is its group's (:func:`group_time_updates`), and a group
may let the rows of its matrices share one full covariance (``shared_rows``, the covariance filter's; where it is not
built it is refused, :func:`check_shared_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.time_update import TimeUpdate, real_number

__all__ = [
    "P0_INITS",
    "P0Init",
    "check_group",
    "check_shared_rows",
    "group_p0",
    "group_shared_rows",
    "group_time_updates",
    "initial_cov",
    "reference_cov",
]

P0Init = Literal["uniform", "constant", "fan_in"]
P0_INITS: tuple[str, ...] = get_args(P0Init)


def group_p0(group: dict[str, Any]) -> float:
    """A param group's prior scale: its ``p0`` times its ``p0_scale`` (1 when the group sets none)."""
    return float(group["p0"]) * float(group.get("p0_scale", 1.0))


def _fan_in(param: Tensor) -> int:
    return param.shape[1:].numel() if param.dim() > 1 else 1


def initial_cov(param: Tensor, group: dict[str, Any], dtype: torch.dtype, generator: torch.Generator | None) -> Tensor:
    """``p̂_0`` of one parameter: the constant ``p0``, ``p0 / fan_in`` or a draw from ``U(0, p0]``."""
    p0 = group_p0(group)
    if group["p0_init"] == "constant":
        return torch.full(param.shape, p0, dtype=dtype, device=param.device)
    if group["p0_init"] == "fan_in":
        return torch.full(param.shape, p0 / _fan_in(param), dtype=dtype, device=param.device)
    draw = torch.rand(param.shape, generator=generator, dtype=torch.float64)
    # U(0, p0) includes 0; a zero entry would freeze its parameter forever, so draw from (0, p0].
    draw = (1.0 - draw) * p0
    return draw.to(dtype=dtype, device=param.device)


def reference_cov(param: Tensor, group: dict[str, Any]) -> float:
    """The reference variance of ``forgetting``: the largest ``p̂₀`` the group's ``p0_init`` draws (``p0``)."""
    if group["p0_init"] == "fan_in":
        return group_p0(group) / _fan_in(param)
    return group_p0(group)


def check_group(group: dict[str, Any], owner: type | None = None) -> None:
    """Refuse a param group's prior or time update outside its range, naming the field, or a parameter not real."""
    p0 = group["p0"]
    if not (real_number(p0) and p0 > 0 and p0 < float("inf")):
        auto = ""
        if p0 == "auto":
            auto = "; p0: auto is for OnlineClassifier (loko fit) or loko_lightning.learner.selection"
        message = (
            f"Invalid p0: {p0!r} ({type(p0).__name__}; must be a finite number > 0, an int or a float; the paper's "
            f"default is 0.2{auto})"
        )
        raise ConfigError(message, field="p0", owner=owner)
    scale = group.get("p0_scale", 1.0)
    if not (real_number(scale) and 0 < scale < float("inf")):
        raise ConfigError(
            f"Invalid p0_scale: {scale!r} (a group's factor on p0: must be a finite number > 0; 1 is the group's p0)",
            field="p0_scale",
            owner=owner,
        )
    if group["p0_init"] not in P0_INITS:
        raise ConfigError(
            f"Invalid p0_init: {group['p0_init']!r} (expected one of {P0_INITS})", field="p0_init", owner=owner
        )
    TimeUpdate.of_group(group).validate(owner=owner)
    for param in group["params"]:
        if param.is_complex() or not param.is_floating_point():
            raise ValueError(f"Invalid parameter: LoKO needs real floating-point parameters, got {param.dtype}")


def group_time_updates(groups: Sequence[dict[str, Any]], owned: Sequence[int]) -> tuple[TimeUpdate, ...]:
    """The time update of each parameter in ``owned`` (indices in parameter order), from its param group."""
    settings = []
    for group in groups:
        update = TimeUpdate.of_group(group)
        for param in group["params"]:
            # The reference variance matters only where forgetting is on: nothing to derive per step otherwise.
            forgets = group["forgetting"]
            settings.append(replace(update, reference=reference_cov(param, group)) if forgets else update)
    return tuple(settings[i] for i in owned)


def group_shared_rows(groups: Sequence[dict[str, Any]], owned: Sequence[int]) -> tuple[bool, ...]:
    """Whether each parameter in ``owned`` (indices in parameter order) shares its rows' covariance."""
    flags = [bool(group.get("shared_rows")) for group in groups for _ in group["params"]]
    return tuple(flags[i] for i in owned)


def check_shared_rows(filter: Any, group: dict[str, Any], shard: bool, owner: type | None = None) -> bool:  # noqa: A002
    """The group's ``shared_rows`` (``False`` when absent); refused where it is not built, naming the field."""
    shared = group.get("shared_rows", False)
    if not isinstance(shared, bool):
        problem = f"{shared!r} (must be true or false)"
    elif not shared:
        return False
    elif not filter.shares_rows:
        problem = f"filter {filter.spec!r} keeps no full covariance; only filter 'covariance' does"
    elif shard:
        problem = "the sharded update does not split a shared covariance; use shard=False"
    elif unbuilt := [key for key in TimeUpdate.group_keys() if key != "process_noise" and group[key]]:
        problem = (
            f"the time updates {', '.join(unbuilt)} are not built for a shared covariance (process_noise is: Σ + q I); "
            "set them to 0 in this group"
        )
    elif any(param.dim() < 2 for param in group["params"]):
        problem = "every parameter of the group must be a matrix (rows share Σ); put biases in another group"
    else:
        return True
    raise ConfigError(
        f"Invalid shared_rows: {problem}. shared_rows gives a weight's rows one full covariance (not the paper)",
        field="shared_rows",
        owner=owner,
    )
