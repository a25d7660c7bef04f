"""``LoKO``: the Low-Rank Kalman Optimizer as a :class:`torch.optim.Optimizer`.

The optimizer keeps θ̃, the counters and the step pipeline (stack, check, plan, the filter's proposal, apply, commit)
and asks the others: the filter for its state, settings and update (:mod:`~loko_lightning.kalman.filters`), the
param groups for the prior ``p̂₀`` and the time update (:mod:`~loko_lightning.kalman.groups`), the exchange for where
the observations come from and the update goes (:mod:`~loko_lightning.kalman.exchange`), the average for ``θ̄``
(:mod:`~loko_lightning.kalman.average`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from loko_lightning.errors import NoLearningRateError
from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.arguments import MOVED, check_arguments, check_new_group, saved_arguments
from loko_lightning.kalman.average import MeanAverage
from loko_lightning.kalman.exchange import Exchange
from loko_lightning.kalman.filters import FILTER_SETTINGS, Belief, Filter, filter_for
from loko_lightning.kalman.groups import (
    P0_INITS,
    P0Init,
    check_group,
    check_shared_rows,
    group_p0,
    group_shared_rows,
    group_time_updates,
    initial_cov,
)
from loko_lightning.kalman.multistream import layout_key
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.state import FlatState, check_loadable, shared_state
from loko_lightning.kalman.time_update import TimeUpdate
from loko_lightning.kalman.validation import (
    CHECK_EVERY,
    ObservationCheck,
    check_closure,
    check_closure_result,
    check_options,
)
from loko_lightning.observation import Observation, get_observation

__all__ = ["CHECK_EVERY", "FILTER_SETTINGS", "P0_INITS", "LoKO", "P0Init", "group_p0"]

Closure = Callable[[], tuple[Tensor, Tensor, Sequence[JacobianBlock]]]


class _ParamGroup(dict):
    """A LoKO param group: reading ``lr`` says why there is none instead of a bare ``KeyError: 'lr'``."""

    def __missing__(self, key: str) -> Any:
        if key in ("lr", "initial_lr"):
            raise NoLearningRateError
        raise KeyError(key)


class LoKO(torch.optim.Optimizer):
    r"""Low-Rank Kalman Optimizer (LoKO): an extended Kalman filter with a diagonal covariance.

    The trainable parameters are the filter state. Each :meth:`step` observes one sample: the closure
    returns the prediction :math:`\hat y_k` (``m`` values), the target :math:`y_k` and the Jacobians
    :math:`H_k = \partial \hat y / \partial \tilde\theta` of every parameter, and the filter performs
    (paper, Proposition 1 and Algorithm 1; :math:`\bullet` is the transposed Khatri–Rao product,
    i.e. row ``i`` of :math:`H^\top` scaled by :math:`\hat p_i`):

    .. math::

        \hat p_{k|k-1} &= \hat p_{k-1} + q \\
        \hat R_k &= e_k e_k^\top + H_k(\hat p_{k|k-1} \bullet H_k^\top), \quad e_k = y_k - \hat y_k \\
        R_k &= \beta R_{k-1} + (1-\beta)\hat R_k, \quad R_0 = 0 \\
        K_k &= \hat p_{k|k-1} \bullet H_k^\top \big(H_k(\hat p_{k|k-1} \bullet H_k^\top) + R_k\big)^{+} \\
        \tilde\theta_k &= \tilde\theta_{k|k-1} + K_k e_k \\
        (\hat p_k)_i &= (\hat p_{k|k-1})_i - (K_k)_{ij}(H_k)_{ji}(\hat p_{k|k-1})_i

    Only an ``m x m`` system is solved, so the cost is :math:`O(m^3 + m^2\tilde n)` whatever the model size. A step
    may also observe ``B`` samples jointly (the multistream EKF of :mod:`loko_lightning.kalman.multistream`: stacked
    :math:`H`, block-diagonal :math:`R`, one ``B·m x B·m`` system, one EMA step of ``R``); ``B = 1`` is the above.
    These are the equations of the default filter (``filter="covariance"``); the others
    (:mod:`loko_lightning.kalman.filters`) run through the same step. With softmax outputs :math:`S` is singular by
    construction (every column of :math:`H` and :math:`e` sum to zero), so :math:`S^{+}` is a pseudo-inverse by
    eigendecomposition with a relative cut-off.

    The filter state is in :attr:`state`, so it round-trips through :meth:`state_dict`: ``state[param]["cov"]`` is
    :math:`\hat p` of that parameter; the first parameter's state also holds the shared ``"R"`` (``m x m``) and
    the counters ``"step"`` (updates applied) and ``"skipped"`` (updates skipped for non-finite input).
    :func:`~loko_lightning.kalman.update.loko_update` is the same step as a function on plain tensors, and
    :func:`~loko_lightning.kalman.reference.loko_step_reference` a slow dense float64 version of it.

    Args:
        params: parameters or param groups; groups may set their own ``p0``, ``p0_init``, time-update fields
            (``process_noise`` ... ``forgetting``), ``p0_scale`` (a factor > 0 on the group's ``p0``: a ``p0`` chosen
            online keeps the ratio between groups; the learner's ``step_scales``) and ``shared_rows`` (not the paper;
            the covariance filter: the rows of each matrix of the group share one full covariance ``Σ``,
            ``state[param]["row_cov"]``; the learner's ``head_covariance="shared"``).
        p0: scale of the initial covariance :math:`\hat p_0` (:mod:`~loko_lightning.kalman.groups`): the upper bound
            of ``U(0, p0)`` or the constant (paper: ``0.2``; too large diverges, too small does not learn).
        p0_init: ``"uniform"`` (paper method 2, default), ``"constant"`` (method 1), or ``"fan_in"`` (not the paper:
            ``p0 / fan_in`` per parameter, so LoRA ``B`` takes larger steps than LoRA ``A`` and the head).
        observation: what the prediction is (:mod:`loko_lightning.observation`): ``"softmax"`` (default, class
            probabilities; logits passed where probabilities belong raise a ``ValueError`` at once on a layout's
            first step, otherwise within :data:`CHECK_EVERY` steps, the failing steps skipped), ``"regression"``
            (any real outputs) or ``"topk<k>"`` (the label, the ``k`` most probable other classes and the rest); an
            :class:`~loko_lightning.observation.Observation` instance works too. Give the Jacobian engine
            :attr:`observation` (the rows this filter needs of it).
        filter: how the belief is updated (:mod:`loko_lightning.kalman.filters`): ``"covariance"`` (default, the
            paper's Algorithm 1); not the paper: ``"natural"``, ``"natural_exact"``, ``"natural_sampled"`` (the
            diagonal natural-gradient filter in information form) and ``"lofi<L>"`` (``_empirical``, ``_sampled``:
            LoFi's low-rank plus diagonal precision of rank ``L``). With its settings: a config
            ``{"name": "covariance", "beta": 0.9, "r_estimator": "residual"}`` (the covariance filter's ``beta``,
            the ``R`` EMA's forgetting factor, paper 0.95; ``r_estimator``, paper ``"taylor"``,
            :mod:`~loko_lightning.kalman.noise`; ``rcond``, the cut-off of the :math:`S` pseudo-inverse; ``debias``,
            not the paper: :math:`R_k / (1 - \beta^k)` in :math:`S`) or a
            :class:`~loko_lightning.kalman.filters.Filter` instance. The param groups save the filter's config:
            :meth:`arguments` builds the same optimizer from a state dict.
        time_update: the process model (:mod:`~loko_lightning.kalman.time_update`), a mapping of its fields, each 0
            (the paper's identity) when not given: ``process_noise`` ``q >= 0`` added to :math:`\hat p` before each
            observation; after each applied update ``p_floor`` (a floor on :math:`\hat p`), ``shrinkage`` ``λ`` in
            ``[0, 1)`` (the parameters scaled by ``1 − λ``), ``inflation`` ``α >= 0`` (:math:`\hat p` by ``1 + α``),
            ``forgetting`` ``γ`` in ``[0, 1)`` (the precision mixed with the prior's). A group may set its own.
        dtype: dtype of the Kalman arithmetic and of :math:`\hat p` and ``R``: ``torch.float32`` or
            ``torch.float64``. Default: the parameters' dtype, promoted to float32 for half precision.
        seed: seed of the generator drawing :math:`\hat p_0` (and the labels of a sampled Fisher, from their own
            generator, saved in :meth:`state_dict`); ``None`` uses the global RNG.
        shard: under ``torch.distributed`` with several processes, split the update between them
            (:mod:`loko_lightning.kalman.sharded`): each process updates its shard of the parameters from every
            process's samples (an all-to-all of the blocks, one all-reduce of :math:`H P H^\top`, an all-gather of
            the new values); equal to the replicated update up to the order of one sum; not for ``"lofi<L>"``.
            :meth:`consolidate_state_dict` (a collective) gathers :math:`\hat p` back before :meth:`state_dict`.
        collective_timeout: seconds each collective of a sharded step may wait for the other processes before it
            raises (a process killed or hung); ``None``: the process group's own timeout.
        average: not the paper's: the decay ``δ`` in ``[0, 1)`` of an exponential average of the filter's mean
            that predicts (:meth:`averaged`, :mod:`~loko_lightning.kalman.average`); 0 (the default): none.

    LoKO has no learning rate: ``lr``, as an argument or in a param group, raises a ``ValueError``; ``p0`` plays
    that role.

    Example:
        >>> import torch
        >>> from loko_lightning import LoKO, jacobian
        >>> model = torch.nn.Linear(4, 3)
        >>> opt = LoKO(model.parameters(), p0=0.1, seed=0)
        >>> x, y = torch.randn(1, 4), torch.nn.functional.one_hot(torch.tensor(2), 3).float()
        >>> def closure():
        ...     prediction, jacobians = jacobian(model, x)
        ...     return prediction, y, jacobians
        >>> prediction, target, _ = opt.step(closure)
        >>> prediction.shape
        torch.Size([3])
    """

    #: The keywords LoKO took before each setting had one owner, and the argument that takes each now.
    moved_arguments = MOVED

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        p0: float | Literal["auto"] = 0.2,
        p0_init: P0Init = "uniform",
        filter: str | Filter | dict[str, Any] = "covariance",  # noqa: A002 (the paper's word)
        observation: str | Observation = "softmax",
        time_update: dict[str, float] | None = None,
        average: float = 0.0,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        shard: bool = False,
        collective_timeout: float | None = None,
        **unexpected: Any,
    ) -> None:
        check_arguments(unexpected, seed, owner=LoKO)
        observed = get_observation(observation, owner=LoKO)
        self.filter = filter_for(filter, observed, owner=LoKO)
        #: The observation the Jacobian engine computes for this filter (its rows of ``H``).
        self.observation = self.filter.observation_for(observed)
        drawing = getattr(self.observation, "generator", None)
        if drawing is not None:  # a sampled Fisher: labels from ``seed``, else from the global RNG (seed_everything)
            drawing.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
        check_options(dtype, shard, self.filter, collective_timeout, owner=LoKO)
        #: The decay ``δ`` of the average of the filter's mean that predicts (:meth:`averaged`,
        #: :class:`~loko_lightning.kalman.average.MeanAverage`); 0: none (the paper).
        self.average = MeanAverage.check(average, owner=LoKO)
        self._average = MeanAverage(self.average) if self.average else None
        self.shard = shard
        #: Where a step's observations come from and its update goes (:class:`~.exchange.Exchange`): replicated, or
        #: sharded with its shards' bookkeeping; ``exchange.gather`` (off by default): under ``torch.distributed``,
        #: the replicated step gathers every process's observations itself.
        self.exchange = Exchange(shard, collective_timeout)
        self._generator_seed = seed
        self._generator: torch.Generator | None = None
        self._dtype = dtype
        # The update plan for the last Jacobian layout; p̂ and the filter's per-entry states flat in its order.
        self._plan: UpdatePlan | None = None
        self._plan_key: tuple | None = None
        self._flats = {"cov": FlatState("cov")} | {k: FlatState(k, c) for k, c in self.filter.entries().items()}
        self._check = ObservationCheck(self.observation)
        defaults = dict(
            p0=p0,
            p0_init=p0_init,
            **TimeUpdate.group_defaults(time_update, owner=LoKO),
            observation=observed.spec,
            filter=self.filter.config(),
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if any(group[key] != defaults[key] for key in ("observation", "filter")):
                raise ValueError(
                    "Invalid param group: observation and filter describe the single shared observation model and "
                    "filter and must be set on the optimizer, not per group"
                )

    @property
    def collective_timeout(self) -> float | None:
        """Seconds each collective of a distributed step may wait (``None``: the process group's own)."""
        return self.exchange.timeout

    @collective_timeout.setter
    def collective_timeout(self, seconds: float | None) -> None:
        self.exchange.timeout = seconds

    @classmethod
    def arguments(cls, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments that build the LoKO which wrote ``state_dict`` (:func:`~.arguments.saved_arguments`).

        ``LoKO(params, **LoKO.arguments(state))`` then loads ``state``: what a served or rebuilt optimizer runs.
        """
        return saved_arguments(state_dict)

    # ------------------------------------------------------------------ state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        r"""Add a param group and draw :math:`\hat p_0` for its parameters (see ``p0``, ``p0_init``)."""
        check_new_group(param_group, sharded=getattr(self, "exchange", None) and self.exchange.shards is not None)
        super().add_param_group(param_group)
        self.param_groups[-1] = _ParamGroup(self.param_groups[-1])
        self._resolve_statistics()
        self._plan = self._plan_key = None
        group = self.param_groups[-1]
        check_group(group, owner=LoKO)
        check_shared_rows(self.filter, group, self.shard, owner=LoKO)
        for param in group["params"]:
            state = self.state[param]
            state["cov"] = self._initial_cov(param, group)
            state.update(self.filter.init_param(param, state["cov"], group))
            if self._average is not None:
                state[MeanAverage.key] = MeanAverage.start(param)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore (``load_state_dict``, unpickling), keeping the param groups' explanation of the missing ``lr``."""
        super().__setstate__(state)
        self.param_groups = [_ParamGroup(group) for group in self.param_groups]

    def _initial_cov(self, param: Tensor, group: dict[str, Any]) -> Tensor:
        if group["p0_init"] == "uniform" and self._generator is None and self._generator_seed is not None:
            self._generator = torch.Generator().manual_seed(self._generator_seed)
        dtype = self._dtype
        if dtype is None:
            dtype = param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32
        return initial_cov(param, group, dtype, self._generator)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def config(self) -> dict[str, Any]:
        """What this optimizer runs, as :meth:`arguments` rebuilds it from a state dict.

        Two equal configs mean one filter (its settings included), observation, prior and time update per group,
        average and arithmetic dtype.
        """
        groups = [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups]
        covs = [state["cov"] for state in self.state.values() if "cov" in state]
        dtype = self._dtype or (covs[0].dtype if covs else None)  # the arithmetic's: that of p̂
        return {"groups": groups, "filter": self.filter, "average": self.average, "dtype": dtype}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state; ``p̂`` and ``R`` keep their saved dtype (torch would cast them to the parameter dtype).

        Refused: another optimizer's state, another model's shapes, another filter (its settings included) or another
        ``shared_rows`` layout.
        """
        params = self._params()
        saved = check_loadable(state_dict, params, self.filter, self.param_groups, owner=LoKO)
        drawing = getattr(self.observation, "generator", None)
        if drawing is not None and "observation_rng" in state_dict:  # after the checks: a refused state changes nothing
            drawing.set_state(state_dict["observation_rng"])
        super().load_state_dict({**state_dict, "state": saved})
        for group in self.param_groups:  # the filter owns its settings: none in a group, the filter's own config
            for key in FILTER_SETTINGS:
                group.pop(key, None)
            group["filter"] = self.filter.config()
        self._resolve_statistics()
        if self.exchange.reset():  # every p̂ is back: the next sharded step splits it again (maybe differently)
            self._plan = self._plan_key = None
        for index, param in enumerate(params):
            for key, value in saved.get(index, {}).items():
                if isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside, the parameters hold the average ``θ̄`` of the filter's mean (with ``average`` > 0); after, ``θ``.

        The values are swapped in and copied back, so predicting inside never changes the filter's trajectory.
        """
        params = [p for p in self._params() if MeanAverage.key in self.state[p]]
        if self._average is None or not params:
            yield
            return
        with self._average.swapped_in(params, [self.state[p][MeanAverage.key] for p in params]):
            yield

    def consolidate_state_dict(self) -> None:
        """Gather every process's shard of ``p̂`` so that :meth:`state_dict` holds the whole filter state.

        A collective: every process must call it (Lightning's checkpointing does, through its strategy's
        ``optimizer_state``, as for torch's ``ZeroRedundancyOptimizer``). Nothing to do unless a sharded step has run.
        """
        self.exchange.consolidate(self.state, self._params())

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (``p̂``, ``R``, the counters) and param groups, as torch's optimizers give it.

        The param groups hold the filter with its settings (``"filter"``) and the time update: :meth:`arguments`
        builds this optimizer again from them. Beside them: the sampled Fisher's generator state (``observation_rng``)
        and, with ``average`` > 0, its decay (``average``).

        After sharded steps it needs :meth:`consolidate_state_dict` first (on every process), which gathers the
        others' ``p̂``; the result then holds every parameter's, as an unsharded optimizer's does.
        """
        state = super().state_dict()
        drawing = getattr(self.observation, "generator", None)
        if drawing is not None:  # the sampled Fisher's draws continue where they were on a resume
            state["observation_rng"] = drawing.get_state()
        if self.average:  # the decay of the averages saved beside p̂: what a served checkpoint goes on averaging with
            state["average"] = self.average
        return self.exchange.saved(state)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> tuple[Tensor, Tensor, Sequence[JacobianBlock]]:  # type: ignore[override]
        """Observe one sample, or a batch of samples jointly, and update the parameters.

        Args:
            closure: callable evaluated with gradients enabled that returns
                ``(prediction, target, jacobians)``: ``prediction`` and ``target`` of shape ``(m,)``,
                ``jacobians`` one per parameter in ``param_groups`` order, each ``(m, *param.shape)``, an
                :class:`~loko_lightning.OuterJacobian` or a :class:`~loko_lightning.FactoredJacobian` (see
                :func:`loko_lightning.jacobian`). A batch of ``B``: ``(B, m)`` and every block with a leading batch
                dimension (:meth:`loko_lightning.JacobianEngine.batch`), one joint update
                (:mod:`loko_lightning.kalman.multistream`; ``B = 1`` is the single-sample step bit for bit).

        Returns:
            What the closure returned. If any of it is non-finite the update is skipped (parameters, filter state and
            average untouched) and counted in ``state["skipped"]``; see :attr:`diagnostics`.
        """
        check_closure(closure)
        with torch.enable_grad():
            result = closure()
        prediction, target, jacobians = check_closure_result(result)
        params = self._params()
        rows = (
            self.observation.rows(prediction.shape[-1]) if isinstance(prediction, Tensor) and prediction.dim() else None
        )
        exchange = self.exchange.current()
        seen = exchange.gather(prediction, target, jacobians, params, rows)
        if seen.shards is not None and self.exchange.shards is None:  # the first sharded step: p̂ of this shard kept
            self.exchange.adopt(self.state, params, seen.shards)
            self._plan = self._plan_key = None
        own = [params[i] for i in seen.owned]
        time_updates = group_time_updates(self.param_groups, seen.owned)
        shared_rows = group_shared_rows(self.param_groups, seen.owned)
        prediction, target, blocks, samples = seen.prediction, seen.target, seen.blocks, seen.samples
        key = layout_key(prediction, target, blocks, (time_updates, shared_rows, samples, seen.layout))
        if key is None or key != self._plan_key:  # a new layout (or bad input, which the checks report)
            self._plan = None
        prediction = self._check(prediction, target, blocks, own, samples, rows, first=self._plan is None)
        m = prediction.shape[0] // samples
        aggregation = None
        aggregated = self.observation.aggregate(prediction.detach().view(samples, m), target.detach().view(samples, m))
        if aggregated is not None:  # an aggregation of the outputs (top-k): the update runs in its coordinates
            aggregation, prediction, target = aggregated[:2], aggregated[2].reshape(-1), aggregated[3].reshape(-1)
        first = self.state[own[0]]["cov"]
        dtype = self.exchange.dtypes[0] if self.exchange.shards is not None else first.dtype
        shared = shared_state(self.state[params[0]], m, prediction.device, dtype)
        if self._plan is None:
            self._plan = UpdatePlan(blocks, [p.shape for p in own], dtype, first.device, samples=samples,
                                    time_updates=time_updates, shared_rows=shared_rows)  # fmt: skip
            self._plan_key = key
            for flat in self._flats.values():
                flat.reset()
        plan, covs = self._plan, self._flats["cov"]
        cov = covs.read(plan, own, self.state)
        entries = {
            key: self._flats[key].read_entries(plan, own, self.state, covs.kept) for key in self.filter.entries()
        }
        row_covs = [self.filter.row_cov(own[i], self.state[own[i]], dtype) for i in plan.rows.order]
        belief = Belief(cov, shared["R"], shared["step"], row_covs, entries)
        with torch.inference_mode():  # cheaper per operation than no_grad; the states written stay ordinary tensors
            evidence = replace(seen, prediction=prediction.detach(), target=target.detach(), aggregation=aggregation)
            proposal = self.filter.propose(plan, evidence, belief, exchange.reduce)
            diagnostics = exchange.apply(plan, params, cov, proposal)
            applied = diagnostics["applied"]
            self.filter.commit(proposal, applied, belief)
            shared["step"].add_(applied.to(shared["step"].dtype))
            shared["skipped"].add_((~applied).to(torch.int64))
            # The prediction's covariance under the prior belief, in the outputs' coordinates only (not top-k's).
            self._prediction_cov = proposal.hpht if aggregation is None else None
            diagnostics["innovation_norm"] = torch.linalg.vector_norm(proposal.innovation)
            diagnostics["cond"] = proposal.cond
            if proposal.cond is None:  # no system solved (the information forms): no condition number
                diagnostics["cond"] = torch.full((), math.nan, dtype=plan.dtype, device=plan.device)
            # p̂'s statistics cost three passes over it: with p̂ kept flat they are computed when diagnostics are read.
            self._statistics_pending = "p_mean" not in diagnostics and covs.kept
            if "p_mean" not in diagnostics and not covs.kept:
                diagnostics.update(plan.statistics(cov))
        covs.write(plan, cov, own, self.state)
        for key, flat in entries.items():
            self._flats[key].write(plan, flat, own, self.state)
        diagnostics["skipped"] = shared["skipped"]
        diagnostics["step"] = shared["step"]
        if self._average is not None:  # every parameter (a sharded step broadcast them all); not on a skipped step
            self._average.update([self.state[p][MeanAverage.key] for p in params], params, shared["step"], applied)
        self._diagnostics = diagnostics
        return result if seen.returned is None else seen.returned

    @property
    def prediction_cov(self) -> Tensor | None:
        """``H P Hᵀ`` of the last step's prediction at the belief before its update (``(B·m) x (B·m)``), or ``None``.

        ``None`` where the filter does not form it (the information forms) or the update ran in other coordinates
        (top-k); :func:`~loko_lightning.kalman.predictive.mean_field_predictive` averages the prediction over it.
        """
        return getattr(self, "_prediction_cov", None)

    @property
    def diagnostics(self) -> dict[str, Tensor]:
        """Diagnostics of the last :meth:`step` as 0-d tensors (no host sync until you read them).

        ``applied`` (bool), ``innovation_norm`` (``‖y - ŷ‖``), ``p_mean``/``p_min``/``p_max`` (of ``p̂`` after
        the step), ``cond`` (condition number of the kept spectrum of ``S``), ``gain_norm`` (``‖K e‖``),
        ``step`` (updates applied) and ``skipped`` (updates skipped for non-finite input). ``applied``,
        ``innovation_norm`` and ``cond`` are inference tensors (see :func:`~loko_lightning.kalman.update.loko_update`).
        """
        self._resolve_statistics()
        return dict(getattr(self, "_diagnostics", {}))

    def _resolve_statistics(self) -> None:
        """Compute the last step's p̂ statistics if they are pending (valid until the next step or a new plan)."""
        if getattr(self, "_statistics_pending", False):
            self._diagnostics.update(self._plan.statistics(self._flats["cov"].flat))
            self._statistics_pending = False
