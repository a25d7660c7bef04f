"""LoKO's keyword arguments: which it takes, where the settings it no longer takes went, and those of a saved state.

Each setting has one owner: the filter's on the filter (``filter={"name": "covariance", "beta": 0.9}``), the time
update's in ``time_update`` (``{"process_noise": 1e-6}``), the prior's (``p0``, ``p0_init``) and the average's on
:class:`~loko_lightning.LoKO`. A keyword of before (``beta=`` on LoKO) is refused saying where it goes
(:func:`check_arguments`); a checkpoint written then is read into today's arguments (:func:`upgrade_arguments`), and
:func:`saved_arguments` gives the arguments that build the optimizer which wrote a state dict.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters import FILTER_SETTINGS, get_filter
from loko_lightning.kalman.time_update import TimeUpdate

__all__ = ["MOVED", "NO_LR", "check_arguments", "check_new_group", "saved_arguments", "upgrade_arguments"]

#: LoKO's keywords of before each setting had one owner: where each now goes (the covariance filter's three, the
#: time update's fields).
MOVED = {
    **{key: "filter" for key in FILTER_SETTINGS},
    **{key: "time_update" for key in TimeUpdate.group_keys()},
}

NO_LR = (
    "Invalid lr: LoKO has no learning rate; the initial covariance p0 plays that role (the step size of each "
    "parameter is its p-hat, which shrinks as the filter learns). Set p0 instead (the paper's default is 0.2)"
)


def check_arguments(unexpected: dict[str, Any], seed: Any, owner: type | None = None) -> None:
    """Refuse LoKO's keywords it does not take, saying where each moved, and a ``seed`` that is not an int.

    ``lr`` says that ``p0`` plays its role; ``beta``, ``r_estimator``, ``rcond`` are the filter's
    (``filter={"name": "covariance", "beta": 0.9}``); ``process_noise`` ... ``forgetting`` the time update's
    (``time_update={"process_noise": 1e-6}``).
    """
    if "lr" in unexpected:
        raise ConfigError(NO_LR, field="lr", owner=owner)
    for key, value in unexpected.items():
        if key in MOVED:
            where = MOVED[key]
            name = "'name': 'covariance', " if where == "filter" else ""
            raise ConfigError(
                f"Invalid {key}: a setting of the {where.replace('_', ' ')}, not of LoKO: give it there, "
                f"{where}={{{name}{key!r}: {value!r}}} (a config file: {where}: {{{name.replace(chr(39), '')}"
                f"{key}: {value}}})",
                field=key,
                owner=owner,
            )
    if unexpected:
        raise TypeError(f"LoKO got unexpected keyword arguments: {', '.join(sorted(unexpected))}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(
            f"Invalid seed: {seed!r} ({type(seed).__name__}; must be an int or None)", field="seed", owner=owner
        )


def check_new_group(group: dict[str, Any], sharded: bool) -> None:
    """Refuse a group with a learning rate or a filter setting, or any new group once the update is ``sharded``."""
    if "lr" in group:
        raise ValueError(NO_LR)
    stray = [key for key in FILTER_SETTINGS if key in group]
    if stray:
        raise ValueError(
            f"Invalid param group: {', '.join(stray)} describe the single filter, not a group: set them on the "
            "filter (LoKO(filter={'name': 'covariance', 'beta': ...}))"
        )
    if sharded:
        raise ValueError(
            "add_param_group after sharded steps: the parameters are split between the processes already; "
            "consolidate_state_dict() and state_dict() on every process, then build a LoKO with every group and "
            "load that state"
        )


def upgrade_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """LoKO's keyword arguments of before each setting had one owner, as today's (today's pass unchanged).

    ``beta``, ``r_estimator`` and ``rcond`` join the filter's config where its family has them (the others ignored
    them); the time update's fields join ``time_update``.
    """
    kwargs = dict(kwargs)
    settings = {key: kwargs.pop(key) for key in FILTER_SETTINGS if key in kwargs}
    spec = kwargs.get("filter", "covariance")
    if isinstance(spec, str):
        known = {f.name for f in fields(get_filter(spec))}
        settings = {key: value for key, value in settings.items() if value is not None and key in known}
        if settings:
            kwargs["filter"] = {"name": spec, **settings}
    times = {key: kwargs.pop(key) for key in TimeUpdate.group_keys() if key in kwargs}
    if times:
        kwargs["time_update"] = {**times, **(kwargs.get("time_update") or {})}
    return kwargs


def saved_arguments(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that build the LoKO which wrote ``state_dict``: what a served or rebuilt one runs.

    Its first param group's prior, time update, observation and filter with the filter's settings, the average's
    decay and the arithmetic dtype (that of ``R``): ``LoKO(params, **saved_arguments(state))`` then loads ``state``.
    """
    group = (state_dict.get("param_groups") or [{}])[0]
    keys = ("p0", "p0_init", *TimeUpdate.group_keys(), *FILTER_SETTINGS, "observation", "filter")
    kwargs = upgrade_arguments({key: group[key] for key in keys if key in group})
    if state_dict.get("average"):
        kwargs["average"] = state_dict["average"]
    shared = next((values for values in state_dict.get("state", {}).values() if "R" in values), None)
    if shared is not None:
        kwargs["dtype"] = shared["R"].dtype
    return kwargs
