r"""The time update: how the belief moves from one step's posterior to the next step's prior.

Algorithm 1's process model is the identity with process noise ``q``. :class:`TimeUpdate` holds that and the other
process models this package offers (none of them the paper's when not 0), for one parameter:

- ``process_noise`` ``q``: :math:`\hat p_{k|k-1} = \hat p_{k-1} + q` before the observation (Algorithm 1);
- ``shrinkage`` ``λ``: :math:`\tilde\theta_{k+1|k} = (1 - \lambda)\tilde\theta_k` after an applied update, ``p̂``
  kept (the Kalman form of decoupled weight decay);
- ``inflation`` ``α``: :math:`\hat p \leftarrow (1 + \alpha)\hat p` after an applied update;
- ``forgetting`` ``γ``: stabilised forgetting, :math:`1/\hat p \leftarrow (1 - \gamma)/\hat p + \gamma/p_{ref}`,
  with the reference variance ``reference`` (``p0``, or ``p0 / fan_in``);
- ``p_floor``: :math:`\hat p \leftarrow \max(\hat p, \text{p\_floor})` after all of these.

A param group of :class:`~loko_lightning.LoKO` carries these values under the same names
(:meth:`TimeUpdate.of_group`), and every filter, the sharded update and the references read them through this class:
one :class:`TimeUpdate` per parameter, compiled once per Jacobian layout into flat per-entry factors
(:class:`CompiledTimeUpdate`). Its float64 specification is
:func:`loko_lightning.kalman.reference.time_update_reference`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError

__all__ = ["CompiledTimeUpdate", "TimeUpdate", "real_number"]


def real_number(value: Any) -> bool:
    """A plain real number: an int or a float, not a bool, a string or a tensor."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TimeUpdate:
    """The process model of one parameter (or, with tensors, of every entry: the references take those).

    Attributes:
        process_noise: ``q >= 0`` added to ``p̂`` before each observation.
        p_floor: the floor on ``p̂`` after the update (0: none).
        shrinkage: ``λ`` in ``[0, 1)``: the parameters scaled by ``1 − λ`` after each applied update.
        inflation: ``α >= 0``: ``p̂`` scaled by ``1 + α`` after each applied update.
        forgetting: ``γ`` in ``[0, 1)``: the precision mixed with the reference one after each applied update.
        reference: the reference variance of ``forgetting`` (unused without it).
    """

    process_noise: float | Tensor = 0.0
    p_floor: float | Tensor = 0.0
    shrinkage: float | Tensor = 0.0
    inflation: float | Tensor = 0.0
    forgetting: float | Tensor = 0.0
    reference: float | Tensor = 1.0

    @classmethod
    def group_keys(cls) -> tuple[str, ...]:
        """The settings a param group holds (every field but the derived ``reference``)."""
        return tuple(f.name for f in fields(cls) if f.name != "reference")

    @classmethod
    def group_defaults(cls, given: TimeUpdate | dict[str, Any] | None, owner: type | None = None) -> dict[str, Any]:
        """Every group setting (:meth:`group_keys`): those ``given`` (a mapping or a :class:`TimeUpdate`), 0 else.

        Raises:
            ConfigError: ``given`` names a field the time update does not have, or is neither (``field="time_update"``).
        """
        if isinstance(given, TimeUpdate):
            given = {key: getattr(given, key) for key in cls.group_keys()}
        if given is None:
            given = {}
        if not isinstance(given, dict):
            raise ConfigError(
                f"Invalid time_update: {given!r} (a mapping of {', '.join(cls.group_keys())} to numbers, e.g. "
                "{'process_noise': 1e-6}, or None: the paper's identity process model)",
                field="time_update",
                owner=owner,
            )
        unknown = sorted(set(given) - set(cls.group_keys()))
        if unknown:
            raise ConfigError(
                f"Invalid time_update: no field {', '.join(map(repr, unknown))} (its fields: "
                f"{', '.join(cls.group_keys())})",
                field="time_update",
                owner=owner,
            )
        return {key: given.get(key, 0.0) for key in cls.group_keys()}

    @classmethod
    def of_group(cls, group: dict[str, Any], reference: float = 1.0) -> TimeUpdate:
        """The time update of a param group's parameter; ``reference`` its forgetting's reference variance."""
        return cls(*(group[key] for key in cls.group_keys()), reference)

    def validate(self, owner: type | None = None) -> None:
        """Refuse a value outside its range, naming the field (:class:`~loko_lightning.errors.ConfigError`)."""
        q, floor, lam, alpha, gamma = (getattr(self, key) for key in self.group_keys())
        if not (real_number(q) and 0 <= q < math.inf):
            raise ConfigError(
                f"Invalid process_noise: {q} (must be a finite number >= 0)", field="process_noise", owner=owner
            )
        if not (real_number(floor) and 0 <= floor < math.inf):
            raise ConfigError(
                f"Invalid p_floor: {floor} (must be a finite number >= 0; 0 is no floor, the paper)",
                field="p_floor",
                owner=owner,
            )
        if not (real_number(lam) and 0 <= lam < 1):
            raise ConfigError(
                f"Invalid shrinkage: {lam!r} (must be a number in [0, 1); 0 is the paper's identity process model)",
                field="shrinkage",
                owner=owner,
            )
        if not (real_number(alpha) and 0 <= alpha < math.inf):
            raise ConfigError(
                f"Invalid inflation: {alpha!r} (must be a finite number >= 0; 0 is none, the paper)",
                field="inflation",
                owner=owner,
            )
        if not (real_number(gamma) and 0 <= gamma < 1):
            raise ConfigError(
                f"Invalid forgetting: {gamma!r} (must be a number in [0, 1): the weight of the reference precision "
                "per step, e.g. 1e-3 forgets over about 1,000 steps; 0 is none, the paper)",
                field="forgetting",
                owner=owner,
            )


class CompiledTimeUpdate:
    """The time updates of every parameter as per-entry factors in an update plan's flat order.

    Each factor is ``None`` (0 everywhere: nothing to do), a float (one value for every entry) or a vector.

    Args:
        updates: one :class:`TimeUpdate` per parameter, in parameter order.
        order: the parameters' indices in the flat order.
        numels: the parameters' sizes, in parameter order.
        dtype: the arithmetic dtype.
        device: where the factors live.
    """

    def __init__(
        self,
        updates: Sequence[TimeUpdate],
        order: Sequence[int],
        numels: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.order, self.numels, self.dtype, self.device = list(order), list(numels), dtype, device
        self.q = self._per_entry([u.process_noise for u in updates])
        self.floor = self._per_entry([u.p_floor for u in updates])
        lam = self._per_entry([u.shrinkage for u in updates])
        alpha = self._per_entry([u.inflation for u in updates])
        #: ``1 − λ`` (shrinkage), or ``None``.
        self.keep = None if lam is None else torch.as_tensor(1.0 - lam, dtype=dtype, device=device)
        #: ``1 + α`` (inflation), or ``None``.
        self.scale = None if alpha is None else torch.as_tensor(1.0 + alpha, dtype=dtype, device=device)
        # Stabilised forgetting: 1/p̂ ← (1 − γ)/p̂ + γ/reference, i.e. p̂ ← p̂ / ((1 − γ) + (γ/ref) p̂).
        self.forget_keep = self.forget_rate = None
        gammas = [u.forgetting for u in updates]
        if any(gammas):
            rates = [u.forgetting / u.reference if u.forgetting else 0.0 for u in updates]
            self.forget_keep = torch.as_tensor(1.0 - self._per_entry(gammas), dtype=dtype, device=device)
            rate = self._per_entry(rates)
            self.forget_rate = torch.as_tensor(0.0 if rate is None else rate, dtype=dtype, device=device)

    def _per_entry(self, values: Sequence[float]) -> Tensor | float | None:
        """One value per parameter as the flat arithmetic uses it: None (all 0), a float (all equal) or a vector."""
        ordered = [float(values[i]) for i in self.order]
        if not any(ordered):
            return None
        if len(set(ordered)) == 1:
            return ordered[0]
        fills = zip(self.order, ordered, strict=True)
        return torch.cat([torch.full((self.numels[i],), v, dtype=self.dtype, device=self.device) for i, v in fills])

    def prior(self, cov: Tensor) -> Tensor:
        """``p̂_{k|k-1} = p̂_{k-1} + q`` (``cov`` itself without process noise)."""
        return cov if self.q is None else cov + self.q

    @property
    def updates_covariance(self) -> bool:
        """Whether the time update changes ``p̂`` (inflation or forgetting), not only the mean (shrinkage)."""
        return self.scale is not None or self.forget_keep is not None

    def covariance(self, posterior: Tensor) -> Tensor:
        """``p̂`` of the next step's prior, in place: inflation, forgetting, then the floor."""
        if self.scale is not None:
            posterior.mul_(self.scale)
        if self.forget_keep is not None:  # p̂ / ((1 − γ) + (γ/ref) p̂): the precision's mixture with the reference
            posterior.div_(torch.addcmul(self.forget_keep, posterior, self.forget_rate))
        return self.floored(posterior)

    def floored(self, posterior: Tensor) -> Tensor:
        """The floor on ``p̂``, in place: steps stay above a minimum however long the stream."""
        if isinstance(self.floor, Tensor):
            torch.maximum(posterior, self.floor, out=posterior)
        elif self.floor is not None:
            posterior.clamp_min_(self.floor)
        return posterior

    def low_rank(self, factor: Tensor) -> Tensor:
        """``W`` of the next step's prior: ``Λ`` scaled by ``(1 − γ)/(1 + α)`` scales ``W`` by its square root."""
        if self.scale is not None:
            factor = factor / self.scale.sqrt().reshape(-1, 1)  # one factor or one per row
        if self.forget_keep is not None:
            factor = factor * self.forget_keep.sqrt().reshape(-1, 1)
        return factor
