"""LoKO's state as the step reads it: per-entry states kept flat in the plan's order, and the checks of a saved state.

:class:`~loko_lightning.LoKO` keeps its state in ``optimizer.state`` (one dict per parameter), so that
``state_dict()``/``load_state_dict()`` carry it with no extra machinery. A step reads the per-entry states (``p̂``,
``"cov"``, and each filter's own, e.g. LoFi's ``"W"``: :meth:`~loko_lightning.kalman.filters.Filter.entries`) as one
flat tensor in the update plan's order; :class:`FlatState` keeps that tensor and makes the per-parameter states views
of it, so a step gathers and copies nothing while the layout and the states stay the same.

The counters and ``R`` are held once, on the first parameter (:data:`SHARED_KEYS`).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError
from loko_lightning.kalman.plan import UpdatePlan

__all__ = ["SHARED_KEYS", "FlatState", "check_block", "check_loadable", "check_saved_state", "shared_state"]

#: The states held once for the whole optimizer, on its first parameter: the observation noise and the counters.
SHARED_KEYS = ("R", "step", "skipped")


class FlatState:
    """One per-entry state key of the step's parameters as one flat tensor in the plan's order.

    Args:
        key: the per-parameter state key (``"cov"``, ``"W"``).
        columns: 0 for one value per entry (the state is shaped like its parameter), ``L`` for a ``(numel, L)`` block.
    """

    def __init__(self, key: str, columns: int = 0) -> None:
        self.key, self.columns = key, columns
        self.flat: Tensor | None = None
        self._views: list[Tensor] = []

    def reset(self) -> None:
        """Forget the flat tensor (a new plan, or states replaced)."""
        self.flat, self._views = None, []

    @property
    def kept(self) -> bool:
        """Whether the per-parameter states are views of :attr:`flat` (written in place by the step)."""
        return self.flat is not None

    def read(
        self, plan: UpdatePlan, params: Sequence[Tensor], states: MutableMapping[Tensor, dict], keep: bool = True
    ) -> Tensor:
        """The flat tensor of ``params``' states (their order in ``plan``).

        Kept (the states made views of it) when ``keep`` and every state has the plan's dtype and device; otherwise a
        gathered copy, which :meth:`write` copies back after the step.
        """
        blocks = [states[p][self.key] for p in params]
        if self.flat is not None and all(b is v for b, v in zip(blocks, self._views, strict=True)):
            return self.flat
        if not keep or any(b.dtype != plan.dtype or b.device != plan.device for b in blocks):
            self.reset()
            return self._flatten(plan, blocks)
        self.flat = self._flatten(plan, blocks)
        self._views = self._split(plan, self.flat, params)
        for param, view in zip(params, self._views, strict=True):
            states[param][self.key] = view
        return self.flat

    def read_entries(
        self, plan: UpdatePlan, params: Sequence[Tensor], states: MutableMapping[Tensor, dict], keep: bool
    ) -> Tensor:
        """:meth:`read` of a filter's per-entry state, created as zeros in ``p̂``'s dtype where a state has none."""
        for param in params:
            state = states[param]
            if self.key not in state:
                shape = (param.numel(), self.columns) if self.columns else param.shape
                state[self.key] = torch.zeros(shape, dtype=state["cov"].dtype, device=state["cov"].device)
        return self.read(plan, params, states, keep=keep)

    def write(self, plan: UpdatePlan, flat: Tensor, params: Sequence[Tensor], states: MutableMapping) -> None:
        """Copy a gathered flat tensor back into the states (nothing to do when they are its views)."""
        if self.flat is None:
            blocks = [states[p][self.key] for p in params]
            torch._foreach_copy_(blocks, self._split(plan, flat, params))

    def _flatten(self, plan: UpdatePlan, blocks: Sequence[Tensor]) -> Tensor:
        return plan.flatten_rows(blocks) if self.columns else plan.flatten(blocks)

    def _split(self, plan: UpdatePlan, flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
        if not self.columns:
            return plan.views(flat)
        return [flat[plan.offsets[i] : plan.offsets[i] + p.numel()] for i, p in enumerate(params)]


def shared_state(first: dict[str, Any], m: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The first parameter's state with ``R`` (``m x m``, zeros at first) and the counters; refuse another ``m``."""
    if "R" not in first or first["R"].shape != (m, m):
        if "R" in first:
            raise ValueError(f"Invalid prediction: expected {first['R'].shape[0]} outputs, got {m}")
        first["R"] = torch.zeros(m, m, dtype=dtype, device=device)
        first["step"] = torch.zeros((), dtype=torch.int64, device=device)
        first["skipped"] = torch.zeros((), dtype=torch.int64, device=device)
    return first


def check_saved_state(saved: dict[Any, dict[str, Any]], params: Sequence[Tensor], known: Iterable[str]) -> None:
    """Refuse a state dict that is not LoKO's (another optimizer's), or whose ``p̂`` has other shapes.

    Args:
        saved: the per-parameter states by index.
        params: the optimizer's parameters.
        known: every per-parameter key this optimizer's filter, average and counters keep.
    """
    if not saved:
        return
    known = set(known)
    foreign = sorted({key for state in saved.values() for key in state} - known)
    if foreign or any("cov" not in state for state in saved.values()):
        raise ValueError(
            f"Invalid state dict: it is not LoKO's (its per-parameter state holds {foreign or 'no cov'}; this LoKO "
            f"keeps {sorted(known)}): it comes from another optimizer (e.g. AdamW), or from a LoKO with another filter "
            "or average. Load it into that optimizer, or start LoKO from its initial state"
        )
    for index, state in saved.items():
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        cov = state["cov"]
        if param is None or not isinstance(cov, Tensor) or tuple(cov.shape) != tuple(param.shape):
            got = tuple(cov.shape) if isinstance(cov, Tensor) else type(cov).__name__
            want = tuple(param.shape) if param is not None else f"one of {len(params)} parameters"
            raise ValueError(
                f"Invalid state dict: parameter {index}'s covariance has shape {got}, this optimizer's parameter is "
                f"{want}: the state comes from another model (other adapters, rank or head); load it into that "
                "model's optimizer"
            )


def check_block(index: Any, what: str, value: Any, shape: tuple[int, ...]) -> None:
    """Refuse a saved per-parameter block of the wrong shape (a filter's own state), naming what it is."""
    if not isinstance(value, Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"Invalid state dict: parameter {index}'s {what} has shape {got}, expected {shape}: the state comes from "
            "another model; load it into that model's optimizer"
        )


def check_loadable(
    state_dict: dict[str, Any],
    params: Sequence[Tensor],
    filter: Any,  # noqa: A002
    groups: Sequence[dict[str, Any]],
    owner: type | None = None,
) -> dict[Any, dict[str, Any]]:
    """The per-parameter states of ``state_dict`` (copied dicts), refused if they cannot load into this optimizer.

    Refused: another optimizer's state, another model's shapes (the filter's own states included), another filter (its
    settings included) or another ``shared_rows`` layout of the param ``groups``.
    """
    saved = {index: dict(state) for index, state in state_dict["state"].items()}
    check_saved_state(saved, params, {"cov", "average", *SHARED_KEYS, *filter.state_keys()})
    for index, state in saved.items():
        filter.check_param(index, params[index], state)
    saved_groups = state_dict.get("param_groups", [])
    own_rows = [bool(group.get("shared_rows")) for group in groups]
    saved_rows = [bool(group.get("shared_rows")) for group in saved_groups]
    if len(saved_rows) == len(own_rows) and saved_rows != own_rows:
        raise ValueError(
            f"Invalid state dict: its param groups' shared_rows are {saved_rows}, this optimizer's {own_rows}: "
            "the state comes from a run with the other covariance of the head; configure this run as that one "
            "(OnlineClassifier's head_covariance)"
        )
    saved_filter = saved_groups[0].get("filter") if saved_groups else None
    if isinstance(saved_filter, dict) and saved_filter != filter.config():
        raise ConfigError(
            f"Invalid state dict: it was written by filter {saved_filter}, this optimizer runs "
            f"{filter.config()}: resume with the checkpoint's filter (LoKO.arguments(state) builds it)",
            field="filter",
            owner=owner,
        )
    return saved
