"""The filter families, one module each, behind one interface (:class:`~loko_lightning.kalman.filters.base.Filter`).

- :mod:`~loko_lightning.kalman.filters.covariance`: the paper's Algorithm 1 (``filter: covariance``, the default).
- :mod:`~loko_lightning.kalman.filters.information`: the diagonal natural-gradient filter in information form
  (``natural``: the empirical Fisher, one reverse row; ``natural_sampled``: a sampled label's, two rows;
  ``natural_exact``: the exact one, ``m + 1`` rows).
- :mod:`~loko_lightning.kalman.filters.low_rank`: LoFi, a low-rank plus diagonal precision (``lofi<L>``, e.g.
  ``lofi10``; ``lofi<L>_empirical`` on the empirical Fisher, ``lofi<L>_sampled`` on a sampled label's).

A new family is one module with a :class:`Filter` subclass, registered in :data:`FILTERS` (or passed to
:class:`~loko_lightning.LoKO` as an instance).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields, replace
from functools import partial
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.filters.base import Belief, Evidence, Filter, Proposal, Reduce
from loko_lightning.kalman.filters.covariance import Covariance, psd_pinv
from loko_lightning.kalman.filters.information import FISHERS, DiagonalInformation, FisherRows
from loko_lightning.kalman.filters.low_rank import LowRankPrecision
from loko_lightning.kalman.noise import R_ESTIMATORS
from loko_lightning.observation import Observation

__all__ = [
    "FILTERS",
    "FILTER_SETTINGS",
    "FISHERS",
    "Belief",
    "Covariance",
    "DiagonalInformation",
    "Evidence",
    "Filter",
    "FisherRows",
    "LowRankPrecision",
    "Proposal",
    "Reduce",
    "filter_for",
    "get_filter",
    "psd_pinv",
]

#: The filters by name, as ``filter: <name>`` selects them; ``lofi<L>``, ``lofi<L>_empirical`` and ``lofi<L>_sampled``
#: (any rank ``L``) are :class:`LowRankPrecision` too.
FILTERS: dict[str, Callable[..., Filter]] = {
    "covariance": Covariance,
    "natural": DiagonalInformation,
    "natural_exact": partial(DiagonalInformation, fisher="exact"),
    "natural_sampled": partial(DiagonalInformation, fisher="sampled"),
}


#: The covariance filter's settings, which LoKO and its param groups took before the filter owned them: refused there
#: (saying where they go), read from the checkpoints of then.
FILTER_SETTINGS = ("beta", "r_estimator", "rcond")


def get_filter(spec: str | Filter | dict[str, Any], *, owner: type | None = None, **settings: Any) -> Filter:
    """A :class:`Filter` from its name, from its :meth:`Filter.config`, or the instance itself.

    The names are those of :data:`FILTERS` and ``lofi<L>[_empirical|_sampled]``; a config is
    ``{"name": ..., **settings}``, what a checkpoint saves.

    Args:
        spec: the name, a config, or a :class:`Filter`.
        owner: the class whose ``filter`` argument this is, for the error.
        settings: the family's settings with a name (e.g. the covariance filter's ``beta``, ``r_estimator``,
            ``rcond``); a config carries its own.

    Raises:
        ConfigError: an unknown name, or a setting the family does not have (``field="filter"``).
    """
    if isinstance(spec, Filter):
        return spec
    if isinstance(spec, dict):
        settings = {**{key: value for key, value in spec.items() if key != "name"}, **settings}
        spec = spec.get("name")
    lofi = re.fullmatch(r"lofi(\d+)(?:_(empirical|sampled))?", spec) if isinstance(spec, str) else None
    if lofi is not None:
        built: Filter = LowRankPrecision(rank=int(lofi[1]), fisher=lofi[2] or "exact")
    else:
        build = FILTERS.get(spec) if isinstance(spec, str) else None
        if build is None:
            raise ConfigError(
                f"Invalid filter: {spec!r} (expected one of {tuple(FILTERS)}, lofi<rank> such as lofi10, "
                "lofi<rank>_empirical, lofi<rank>_sampled, or a Filter)",
                field="filter",
                owner=owner,
            )
        built = build()
    if not settings:
        return built
    known = {f.name for f in fields(built)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(
            f"Invalid filter: {built.spec!r} has no setting {', '.join(unknown)} (its settings: {sorted(known)})",
            field="filter",
            owner=owner,
        )
    try:
        return replace(built, **settings)
    except ConfigError as err:  # a setting out of range, given in a config: the filter argument is where to fix it
        if owner is None:
            raise
        raise ConfigError(str(err), field="filter", owner=owner) from None


def filter_for(spec: str | Filter | dict[str, Any], observation: Observation, owner: type | None = None) -> Filter:
    """The filter an optimizer runs on ``observation``: ``spec`` (:func:`get_filter`), its noise estimator checked.

    A noise estimator that does not apply to ``observation`` with the filter (:meth:`Filter.r_estimators`) is
    refused, naming ``r_estimator``.
    """
    built = get_filter(spec, owner=owner)
    allowed = built.r_estimators(observation)
    chosen = getattr(built, "r_estimator", None) or allowed[0]
    if chosen not in allowed:
        raise ConfigError(
            f"Invalid r_estimator: {chosen!r} does not apply to observation {observation.spec!r} with filter "
            f"{built.spec!r} ({R_ESTIMATORS[chosen].doc}); choose one of {allowed}",
            field="r_estimator",
            owner=owner,
        )
    return built
