"""``LoKO``: the Low-Rank Kalman Optimizer as a :class:`torch.optim.Optimizer`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from loko_lightning.errors import ConfigError, NoLearningRateError
from loko_lightning.jacobians.blocks import JacobianBlock
from loko_lightning.kalman.exchange import Replicated, Sharded
from loko_lightning.kalman.filters import Belief, Evidence, Filter, get_filter
from loko_lightning.kalman.multistream import check_observation, layout_key
from loko_lightning.kalman.noise import R_ESTIMATORS, REstimator
from loko_lightning.kalman.plan import UpdatePlan
from loko_lightning.kalman.sharded import ShardPlan, gather_shards
from loko_lightning.kalman.time_update import TimeUpdate, real_number
from loko_lightning.observation import Observation, get_observation

P0Init = Literal["uniform", "constant", "fan_in"]
P0_INITS: tuple[str, ...] = get_args(P0Init)
Closure = Callable[[], tuple[Tensor, Tensor, Sequence[JacobianBlock]]]

# Filter state shared by all parameters (the observation noise "R", the counters "step" and "skipped") lives in
# the state of the first parameter, so that ``state_dict()``/``load_state_dict()`` carry it with no extra machinery.
# Steps between the host reads of the observation's check after a layout's first step (that one reads at once): the
# window starts at 1 and doubles after each clean read up to this many, so a prediction that goes wrong right after
# the first step (probabilities, then logits) is refused on its own step, and a long run reads once in CHECK_EVERY.
CHECK_EVERY = 100
_NO_LR = (
    "Invalid lr: LoKO has no learning rate; the initial covariance p0 plays that role (the step size of each "
    "parameter is its p-hat, which shrinks as the filter learns). Set p0 instead (the paper's default is 0.2)"
)


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
        params: parameters or param groups; groups may set their own ``p0``, ``p0_init``, ``process_noise``,
            ``p_floor``, ``shrinkage``, ``inflation`` and ``forgetting``, and ``p0_scale`` (a factor > 0 on the
            group's ``p0``, 1 when absent: its prior is ``p0 × p0_scale``, so a ``p0`` chosen online keeps the
            ratio between groups; :class:`~loko_lightning.learner.OnlineClassifier`'s ``step_scales`` sets it), and
            ``shared_rows`` (not the paper; ``filter="covariance"`` only, no time update in the group, every parameter
            a matrix, not sharded): the rows of each parameter of the group share one full covariance ``Σ``
            (``state[param]["row_cov"]``, ``cols x cols``) instead of a diagonal one
            (:class:`~loko_lightning.kalman.algebra.SharedRowBlocks`; the learner's ``head_covariance="shared"``).
        p0: scale of the initial covariance :math:`\hat p_0`: the upper bound of ``U(0, p0)`` or the
            constant (paper: ``0.2``; too large diverges, too small does not learn; ``"auto"``: OnlineClassifier's).
        p0_init: ``"uniform"`` (paper method 2, default), ``"constant"`` (method 1), or ``"fan_in"`` (not the paper:
            the constant ``p0 / fan_in`` of each parameter, ``fan_in`` = the product of its shape after the first
            dimension, 1 for vectors: a prior variance on the scale of a kaiming initialisation, so LoRA ``B``
            (fan-in ``r``) takes larger steps than LoRA ``A`` and the head; ``p0`` is then the factor ``c``).
        beta: forgetting factor of the ``R`` EMA, in ``(0, 1)`` (paper: 0.95; good range 0.9-0.98).
        r_estimator: ``"taylor"`` (method 2, the default for ``"softmax"`` and ``"regression"``), ``"residual"``
            (method 1, :math:`\hat R = e e^\top`), or the literature baselines ``"identity"`` (:math:`R = I`),
            ``"decay"`` (:math:`R = I e^{-k/50}`, ``k`` = 1-based index of the update) and ``"softmax"``
            (:math:`R = \mathrm{diag}(\hat y) - \hat y \hat y^\top`, the only one ``"natural"`` admits).
            Default: the observation's first (:attr:`~loko_lightning.observation.Observation.r_estimators`).
        process_noise: ``q`` added to every :math:`\hat p` in the predict step; 0 is the paper, a small
            positive value keeps learning alive on non-stationary streams.
        p_floor: a floor on :math:`\hat p` (not the paper; 0, the default, is none): after every update
            :math:`\hat p_k \leftarrow \max(\hat p_k, \text{p\_floor})`, so the steps never shrink below a
            minimum however long the stream. Unlike ``process_noise`` it leaves :math:`\hat p` alone while it is
            above the floor.
        shrinkage: ``λ`` in ``[0, 1)`` of a shrinkage process model :math:`\tilde\theta_{k+1|k} = (1 - \lambda)
            \tilde\theta_k` (not the paper; 0, the default, is the paper's identity model): after every applied
            update the parameters are scaled by :math:`1 - \lambda` and :math:`\hat p` is kept, the Kalman form of
            decoupled weight decay (towards 0: LoRA ``B`` and the head start there).
        inflation: ``α >= 0`` of a multiplicative covariance inflation :math:`P \leftarrow (1 + \alpha) P` after
            every applied update (not the paper; 0, the default, is none): old information loses weight
            geometrically, so :math:`\hat p` does not settle (forgetting, as in rebayes' LoFi).
        forgetting: ``γ`` in ``[0, 1)`` of stabilised forgetting after every applied update (not the paper; 0, the
            default, is none): the precision is mixed with that of the prior's scale,
            :math:`1/\hat p \leftarrow (1 - \gamma)/\hat p + \gamma/p_{\mathrm{ref}}` (``W W^T`` scaled by
            :math:`1 - \gamma` too for ``lofi``), with :math:`p_{\mathrm{ref}}` = ``p0`` (``p0 / fan_in`` for
            ``p0_init="fan_in"``), the mean kept. Information older than about :math:`1/\gamma` steps fades, so the
            steps stop shrinking like :math:`1/k`, and :math:`\hat p` never exceeds :math:`p_{\mathrm{ref}}` (where
            ``inflation`` grows it without bound on parameters the data do not inform).
        rcond: relative eigenvalue cut-off of the :math:`S` pseudo-inverse (default ``10 · m · eps``).
        observation: what the prediction is (:mod:`loko_lightning.observation`). ``"softmax"`` (default): class
            probabilities, the paper's classification setting; when the target is a probability vector (e.g. one-hot)
            and the prediction is not (a negative entry, or a sum off 1 by more than rounding: logits passed where
            probabilities belong), :meth:`step` raises a ``ValueError``: at once on the first step of a layout, and
            otherwise within :data:`CHECK_EVERY` steps, the failing steps skipped (the check runs on the device; its
            count is read after 1, 2, 4, ... steps, then every ``CHECK_EVERY`` steps). ``"regression"``: any real
            outputs, no check (see the p0 advice in the docs' "Regression" section). ``"topk<k>"``: the label, the
            ``k`` most probable other classes and the rest. An :class:`~loko_lightning.observation.Observation`
            instance works too. Give the Jacobian engine
            :attr:`observation` (the rows this filter needs of it).
        filter: how the belief is updated (:mod:`loko_lightning.kalman.filters`). ``"covariance"`` (default): the
            paper's Algorithm 1. Not the paper: ``"natural"`` / ``"natural_exact"``, the diagonal natural-gradient
            filter in information form (the categorical ``R``, the empirical or the exact Fisher diagonal as the
            information, one or ``m + 1`` reverse rows and no ``m x m`` solve; ``"natural_sampled"``: a label drawn
            from the prediction, two rows), and ``"lofi<L>"`` / ``"lofi<L>_empirical"`` / ``"lofi<L>_sampled"``,
            LoFi's low-rank plus diagonal precision of rank ``L``. Their rows of ``H`` come
            from the label, so the closure must return what :meth:`loko_lightning.JacobianEngine.observe` gives for
            :attr:`observation`. A :class:`~loko_lightning.kalman.filters.Filter` instance works too. ``beta``,
            ``r_estimator`` and ``rcond`` are the covariance filter's; the others observe ``"softmax"`` only.
        dtype: dtype of the Kalman arithmetic and of :math:`\hat p` and ``R``: ``torch.float32`` or
            ``torch.float64``. Default: the parameters' dtype, promoted to float32 for half precision.
        seed: seed of the generator drawing :math:`\hat p_0` (and the labels of a sampled Fisher, from their own
            generator, saved in :meth:`state_dict`); ``None`` uses the global RNG.
        shard: under ``torch.distributed`` with several processes, split the update between them
            (:mod:`loko_lightning.kalman.sharded`): each process owns a shard of the parameters (whole tensors),
            receives only its shard's Jacobian blocks for every process's samples (an all-to-all instead of an
            all-gather), sums its part of :math:`H P H^\top` with the others' (one all-reduce) and updates its
            shard; the new parameter values are then all-gathered. The closure returns this process's own
            observations (not gathered), and :meth:`step` returns every process's predictions and targets with this
            process's blocks. Equal to the replicated update up to the order of one sum (bit for bit for
            ``filter="natural"``); not for ``"lofi<L>"``. In one process it does nothing. ``p̂`` of the others'
            parameters is dropped at the first sharded step: :meth:`consolidate_state_dict` (a collective) gathers
            it back before :meth:`state_dict`.
        collective_timeout: seconds each collective of a sharded step may wait for the other processes before it
            raises (a process killed or hung); ``None``: the process group's own timeout (30 minutes by default;
            :class:`~loko_lightning.OnlineClassifier` sets its own ``collective_timeout`` here).
        average: not the paper's: the decay ``δ`` in ``[0, 1)`` of an exponential average of the filter's mean,
            updated after every step (with a warm-up, ``min(δ, (1 + k)/(10 + k))``); the learner predicts with it
            (:meth:`averaged`) and checkpoints it as the weights. The filter's own recursion is unchanged. 0 (the
            default): none, the paper. See ``docs/filters.md``.

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

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        p0: float | Literal["auto"] = 0.2,
        p0_init: P0Init = "uniform",
        beta: float = 0.95,
        r_estimator: REstimator | None = None,
        process_noise: float = 0.0,
        p_floor: float = 0.0,
        shrinkage: float = 0.0,
        inflation: float = 0.0,
        forgetting: float = 0.0,
        rcond: float | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        observation: str | Observation = "softmax",
        filter: str | Filter = "covariance",  # noqa: A002 (the paper's word)
        shard: bool = False,
        collective_timeout: float | None = None,
        average: float = 0.0,
        **unexpected: Any,
    ) -> None:
        if "lr" in unexpected:
            raise ConfigError(_NO_LR, field="lr", owner=LoKO)
        if unexpected:
            raise TypeError(f"LoKO got unexpected keyword arguments: {', '.join(sorted(unexpected))}")
        if not (real_number(beta) and 0.0 < beta < 1.0):
            raise ConfigError(
                f"Invalid beta: {beta!r} ({type(beta).__name__}; must be a number in (0, 1); the paper uses 0.95)",
                field="beta",
                owner=LoKO,
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(
                f"Invalid seed: {seed!r} ({type(seed).__name__}; must be an int or None)", field="seed", owner=LoKO
            )
        observed = get_observation(observation, owner=LoKO)
        self.filter = get_filter(filter, owner=LoKO)
        #: The observation the Jacobian engine computes for this filter (its rows of ``H``).
        self.observation = self.filter.observe(observed)
        drawing = getattr(self.observation, "generator", None)
        if drawing is not None:  # a sampled Fisher: labels from ``seed``, else from the global RNG (seed_everything)
            drawing.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
        allowed = self.filter.r_estimators(observed)
        if r_estimator is None:
            r_estimator = allowed[0]
        if r_estimator not in R_ESTIMATORS:
            raise ConfigError(
                f"Invalid r_estimator: {r_estimator!r} (expected one of {tuple(R_ESTIMATORS)})",
                field="r_estimator",
                owner=LoKO,
            )
        if r_estimator not in allowed:
            raise ConfigError(
                f"Invalid r_estimator: {r_estimator!r} does not apply to observation {observed.spec!r} with filter "
                f"{self.filter.spec!r} ({R_ESTIMATORS[r_estimator].doc}); choose one of {allowed}",
                field="r_estimator",
                owner=LoKO,
            )
        if rcond is not None and not 0.0 <= rcond < 1.0:
            raise ConfigError(f"Invalid rcond: {rcond} (must lie in [0, 1))", field="rcond", owner=LoKO)
        if dtype not in (None, torch.float32, torch.float64):
            raise ConfigError(
                f"Invalid dtype: {dtype} (expected torch.float32, torch.float64 or None)", field="dtype", owner=LoKO
            )
        if not isinstance(shard, bool):
            raise ConfigError(f"Invalid shard: {shard!r} (must be true or false)", field="shard", owner=LoKO)
        if shard and not self.filter.shardable:
            raise ConfigError(
                f"Invalid shard: filter {self.filter.spec!r} (a low-rank precision) couples every parameter "
                "through its factor W, which the sharded update does not split: use shard=False",
                field="shard",
                owner=LoKO,
            )
        timeout_ok = real_number(collective_timeout) and 0 < collective_timeout < math.inf
        if collective_timeout is not None and not timeout_ok:
            raise ConfigError(
                f"Invalid collective_timeout: {collective_timeout!r} (a finite number of seconds > 0, or None)",
                field="collective_timeout",
                owner=LoKO,
            )
        if not (real_number(average) and 0.0 <= average < 1.0):
            raise ConfigError(
                f"Invalid average: {average!r} (the decay of the average of the filter's mean that predicts, in "
                "[0, 1); 0 predicts with the mean itself, the paper; e.g. 0.999)",
                field="average",
                owner=LoKO,
            )
        #: The decay ``δ`` of the exponential average ``θ̄ ← δ_k θ̄ + (1 − δ_k) θ`` of the filter's mean after every
        #: step (``δ_k = min(δ, (1 + k)/(10 + k))``), which predicts (:meth:`averaged`); 0: none (the paper).
        self.average = float(average)
        self.shard = shard
        self.collective_timeout = collective_timeout
        self._shards: ShardPlan | None = None  # the owners of the parameters once a sharded step has run
        self._consolidated: dict[int, Tensor] | None = None  # every p̂, gathered by consolidate_state_dict
        self._shard_dtypes: list[torch.dtype] = []  # p̂'s dtype per parameter when the shards were made
        self._generator_seed = seed
        self._generator: torch.Generator | None = None
        defaults = dict(
            p0=p0,
            p0_init=p0_init,
            beta=beta,
            r_estimator=r_estimator,
            process_noise=process_noise,
            p_floor=p_floor,
            shrinkage=shrinkage,
            inflation=inflation,
            forgetting=forgetting,
            rcond=rcond,
            observation=observed.spec,
            filter=self.filter.spec,
        )
        if isinstance(filter, str) and self.filter.estimates_noise:  # the covariance filter takes its settings
            self.filter = get_filter(filter, owner=LoKO, beta=beta, r_estimator=r_estimator, rcond=rcond)
        self._dtype = dtype
        # The update plan for the last Jacobian layout and p̂ as one flat vector in its order (the per-parameter
        # "cov" states are views of it); rebuilt when the layout changes or the states are replaced.
        self._plan: UpdatePlan | None = None
        self._plan_key: tuple | None = None
        self._violations: Tensor | None = None  # steps that failed the observation's check, since the last read
        self._unchecked = 0
        self._check_window = 1  # steps before the next read: 1, 2, 4, ... up to CHECK_EVERY
        self._cov_flat: Tensor | None = None
        self._cov_views: list[Tensor] = []
        self._low_rank_flat: Tensor | None = None  # LoFi's W, the same way: one (n, L) tensor, "W" states views of it
        self._low_rank_views: list[Tensor] = []
        super().__init__(params, defaults)
        shared = ("beta", "r_estimator", "rcond", "observation", "filter")
        for group in self.param_groups:
            if any(group[key] != defaults[key] for key in shared):
                raise ValueError(
                    "Invalid param group: beta, r_estimator, rcond, observation and filter describe the single shared "
                    "R, S, observation model and filter and must be set on the optimizer, not per group"
                )

    # ------------------------------------------------------------------ state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        r"""Add a param group and draw :math:`\hat p_0` for its parameters (see ``p0``, ``p0_init``)."""
        if "lr" in param_group:
            raise ValueError(_NO_LR)
        if getattr(self, "_shards", None) is not None:
            raise ValueError(
                "add_param_group after sharded steps: the parameters are split between the processes already; "
                "consolidate_state_dict() and state_dict() on every process, then build a LoKO with every group and "
                "load that state"
            )
        super().add_param_group(param_group)
        self.param_groups[-1] = _ParamGroup(self.param_groups[-1])
        self._resolve_statistics()
        self._plan = self._plan_key = None
        group = self.param_groups[-1]
        _check_group(group)
        shared_rows = self._check_shared_rows(group)
        for param in group["params"]:
            if param.is_complex() or not param.is_floating_point():
                raise ValueError(f"Invalid parameter: LoKO needs real floating-point parameters, got {param.dtype}")
            self.state[param]["cov"] = self._initial_cov(param, group)
            if shared_rows:  # Σ₀ = diag of the rows' mean p̂₀, and p̂₀ = diag(Σ₀) on every row
                cov = self.state[param]["cov"]
                mean = cov.reshape(param.shape[0], -1).mean(0)
                cov.view(param.shape[0], -1).copy_(mean[None].expand(param.shape[0], -1))
                self.state[param]["row_cov"] = torch.diag(mean)
            if self.average:
                self.state[param]["average"] = param.detach().clone()

    def _check_shared_rows(self, group: dict[str, Any]) -> bool:
        """The group's ``shared_rows`` (``False`` when absent); refused where it is not built, naming the field."""
        shared = group.get("shared_rows", False)
        if not isinstance(shared, bool):
            problem = f"{shared!r} (must be true or false)"
        elif not shared:
            return False
        elif not self.filter.shares_rows:
            problem = f"filter {self.filter.spec!r} keeps no full covariance; only filter 'covariance' does"
        elif self.shard:
            problem = "the sharded update does not split a shared covariance; use shard=False"
        elif TimeUpdate.of_group(group) != TimeUpdate():
            problem = (
                "the time updates (process_noise, p_floor, shrinkage, inflation, forgetting) are not built for a "
                "shared covariance; set them to 0 in this group"
            )
        elif any(param.dim() < 2 for param in group["params"]):
            problem = "every parameter of the group must be a matrix (rows share Σ); put biases in another group"
        else:
            return True
        raise ConfigError(
            f"Invalid shared_rows: {problem}. shared_rows gives a weight's rows one full covariance (not the paper)",
            field="shared_rows",
            owner=LoKO,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore (``load_state_dict``, unpickling), keeping the param groups' explanation of the missing ``lr``."""
        super().__setstate__(state)
        self.param_groups = [_ParamGroup(group) for group in self.param_groups]

    def _arith_dtype(self, param: Tensor) -> torch.dtype:
        if self._dtype is not None:
            return self._dtype
        return param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32

    def _initial_cov(self, param: Tensor, group: dict[str, Any]) -> Tensor:
        if group["p0_init"] == "uniform" and self._generator is None and self._generator_seed is not None:
            self._generator = torch.Generator().manual_seed(self._generator_seed)
        return _initial_cov(param, group, self._arith_dtype(param), self._generator)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _shared_state(self, m: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        state = self.state[self._params()[0]]
        if "R" not in state or state["R"].shape != (m, m):
            if "R" in state:
                raise ValueError(f"Invalid prediction: expected {state['R'].shape[0]} outputs, got {m}")
            state["R"] = torch.zeros(m, m, dtype=dtype, device=device)
            state["step"] = torch.zeros((), dtype=torch.int64, device=device)
            state["skipped"] = torch.zeros((), dtype=torch.int64, device=device)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state; ``p̂`` and ``R`` keep their saved dtype (torch would cast them to the parameter dtype)."""
        saved = {index: dict(state) for index, state in state_dict["state"].items()}
        _check_saved_state(saved, self._params())
        own_rows = [bool(group.get("shared_rows")) for group in self.param_groups]
        saved_rows = [bool(group.get("shared_rows")) for group in state_dict.get("param_groups", [])]
        if len(saved_rows) == len(own_rows) and saved_rows != own_rows:
            raise ValueError(
                f"Invalid state dict: its param groups' shared_rows are {saved_rows}, this optimizer's {own_rows}: "
                "the state comes from a run with the other covariance of the head; configure this run as that one "
                "(OnlineClassifier's head_covariance)"
            )
        drawing = getattr(self.observation, "generator", None)
        if drawing is not None and "observation_rng" in state_dict:  # after the check: a refused state changes nothing
            drawing.set_state(state_dict["observation_rng"])
        state_dict = {**state_dict, "state": saved}
        super().load_state_dict(state_dict)
        if self._shards is not None:  # every p̂ is back: the next sharded step splits it again (maybe differently)
            self._resolve_statistics()
            self._shards = self._consolidated = None
            self._plan = self._plan_key = None
        for index, param in enumerate(self._params()):
            for key, value in saved.get(index, {}).items():
                if isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside, the parameters hold the average ``θ̄`` of the filter's mean (with ``average`` > 0); after, ``θ``.

        The values are swapped in and copied back, so predicting inside never changes the filter's trajectory.
        """
        params = [p for p in self._params() if "average" in self.state[p]]
        if not self.average or not params:
            yield
            return
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, [self.state[p]["average"] for p in params])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, saved)

    def consolidate_state_dict(self) -> None:
        """Gather every process's shard of ``p̂`` so that :meth:`state_dict` holds the whole filter state.

        A collective: every process must call it (Lightning's checkpointing does, through its strategy's
        ``optimizer_state``, as for torch's ``ZeroRedundancyOptimizer``). Nothing to do unless a sharded step has run.
        """
        if self._shards is None:
            return
        params = self._params()
        covs = [self.state[p].get("cov") for p in params]
        shapes = [p.shape for p in params]
        gathered = gather_shards(covs, shapes, self._shard_dtypes, self._shards, timeout=self.collective_timeout)
        self._consolidated = dict(enumerate(gathered))

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (``p̂``, ``R``, the counters) and param groups, as torch's optimizers give it.

        Beside them: the sampled Fisher's generator state (``observation_rng``) and, with ``average`` > 0, its decay
        (``average``, which :class:`~loko_lightning.serve.ServingLearner` goes on averaging with).

        After sharded steps it needs :meth:`consolidate_state_dict` first (on every process), which gathers the
        others' ``p̂``; the result then holds every parameter's, as an unsharded optimizer's does.
        """
        state = super().state_dict()
        drawing = getattr(self.observation, "generator", None)
        if drawing is not None:  # the sampled Fisher's draws continue where they were on a resume
            state["observation_rng"] = drawing.get_state()
        if self.average:  # the decay of the averages saved beside p̂: what a served checkpoint goes on averaging with
            state["average"] = self.average
        if self._shards is None:
            return state
        if self._consolidated is None:
            raise RuntimeError(
                "LoKO(shard=True) keeps p-hat of its own shard of the parameters only: call consolidate_state_dict() "
                "on every process first (Lightning's checkpointing does), then state_dict()"
            )
        # Torch's state dict holds the live per-parameter dicts: new ones, so that the optimizer's own are untouched.
        state["state"] = {index: dict(values) for index, values in state["state"].items()}
        for index, cov in self._consolidated.items():
            state["state"].setdefault(index, {})["cov"] = cov
        self._consolidated = None
        return state

    def _check_on_device(self, prediction: Tensor, target: Tensor, samples: int) -> Tensor:
        """The observation's check without a host read, on a layout's later steps.

        A failing step is skipped (its prediction made non-finite) and counted on the device; every
        :data:`CHECK_EVERY` steps the count is read, and a failure raises then; right after a layout's first step the
        reads come sooner (after 1, 2, 4, ... steps).

        Probabilities on one step and logits on the next have the same layout, so the first-step check alone would
        miss them; this way the step stays free of host reads and nothing wrong is ever applied.
        """
        view = (prediction.detach().view(samples, -1), target.detach().view(samples, -1))
        bad = self.observation.violation(*view)
        if bad is None:
            return prediction
        self._violations = bad.long() if self._violations is None else self._violations + bad.long()
        self._unchecked += 1
        if self._unchecked >= self._check_window:
            window = self._unchecked
            count, self._unchecked, self._violations = int(self._violations), 0, None
            self._check_window = min(2 * window, CHECK_EVERY)
            if count:
                try:
                    self.observation.check(*view)  # the message of the check, if this step fails it too
                except ValueError as err:
                    message = f"{err} ({count} of the last {window} steps failed it and were skipped)"
                    raise ValueError(message) from None
                raise ValueError(
                    f"Invalid prediction on {count} of the last {window} steps (skipped): it did not fit the "
                    f"{self.observation.name!r} observation (for class probabilities: a probability vector where "
                    "the target is one; were logits passed where probabilities belong?)"
                )
        return torch.where(bad, torch.full_like(prediction, math.nan), prediction)

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
            What the closure returned. If any of it is non-finite the update is skipped (parameters and
            filter state untouched) and counted in ``state["skipped"]``; see :attr:`diagnostics`.
        """
        if closure is None:
            raise ValueError(
                "LoKO.step needs a closure returning (prediction, target, jacobians), e.g. def closure(): prediction, "
                "jacobians = loko_lightning.jacobian(model, x); return prediction, target, jacobians. In a "
                "LightningModule: set self.automatic_optimization = False and call self.optimizers().step(closure) in "
                "training_step"
            )
        with torch.enable_grad():
            result = closure()
        if result is None:
            raise ValueError(
                "Invalid closure result: None. LoKO.step needs a closure returning (prediction, target, jacobians) "
                "(see loko_lightning.jacobian); in a LightningModule, self.optimizers().step() without a closure "
                "passes an empty one: call self.optimizers().step(closure) in training_step"
            )
        if isinstance(result, Tensor):
            raise ValueError(
                "Invalid closure result: a tensor (a loss?), but LoKO's closure returns (prediction, target, "
                "jacobians) (see loko_lightning.jacobian), not a loss. In a LightningModule this is Lightning's "
                "automatic optimization calling step(): set self.automatic_optimization = False and call "
                "self.optimizers().step(closure) in training_step"
            )
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            got = f"{len(result)} items" if isinstance(result, (tuple, list)) else type(result)
            raise ValueError(f"Invalid closure result: expected a tuple (prediction, target, jacobians), got {got}")
        prediction, target, jacobians = result
        params = self._params()
        rows = (
            self.observation.rows(prediction.shape[-1]) if isinstance(prediction, Tensor) and prediction.dim() else None
        )
        exchange = self._exchange()
        observed = exchange.observe(prediction, target, jacobians, params, rows)
        if observed.shards is not None and self._shards is None:
            self._adopt_shards(observed.shards)
        own = [params[i] for i in observed.owned]
        time_updates = self._time_updates(observed.owned)
        shared_rows = self._shared_rows(observed.owned)
        prediction, target, blocks, samples = observed.prediction, observed.target, observed.blocks, observed.samples
        key = layout_key(prediction, target, blocks, (time_updates, shared_rows, samples, observed.layout))
        if key is None or key != self._plan_key:  # a new layout (or bad input, which the checks report)
            check_observation(prediction, target, blocks, own, batched=False, rows=rows and rows * samples)
            self.observation.check(prediction.detach().view(samples, -1), target.detach().view(samples, -1))
            self._plan = None
            self._check_window, self._unchecked, self._violations = 1, 0, None
        else:  # the same layout: the same check on the device, read every CHECK_EVERY steps
            prediction = self._check_on_device(prediction, target, samples)
        m = prediction.shape[0] // samples
        aggregation = None
        seen = self.observation.observed(prediction.detach().view(samples, m), target.detach().view(samples, m))
        if seen is not None:  # an aggregation of the outputs (top-k): the update runs in its coordinates
            aggregation, prediction, target = seen[:2], seen[2].reshape(-1), seen[3].reshape(-1)
        covs = [self.state[p]["cov"] for p in own]
        dtype = self._shard_dtypes[0] if self._shards is not None else covs[0].dtype
        shared = self._shared_state(m, prediction.device, dtype)
        if self._plan is None:
            self._plan = UpdatePlan(blocks, [p.shape for p in own], dtype, covs[0].device, samples=samples,
                                    time_updates=time_updates, shared_rows=shared_rows)  # fmt: skip
            self._plan_key, self._cov_flat, self._low_rank_flat = key, None, None
        plan = self._plan
        if self._cov_flat is None or any(c is not v for c, v in zip(covs, self._cov_views, strict=True)):
            self._flatten_covs(own, covs)
            covs = [self.state[p]["cov"] for p in own]
        flat = self._cov_flat if self._cov_flat is not None else plan.flatten(covs)
        low_rank = self._low_rank(own, covs) if self.filter.low_rank() else None
        low_rank_flat = None
        if low_rank is not None:
            low_rank_flat = self._low_rank_flat
            if low_rank_flat is None:
                low_rank_flat = plan.flatten_rows(low_rank)
        row_covs = [self._row_cov(own[i], dtype) for i in plan.rows.order]
        belief = Belief(flat, shared["R"], shared["step"], low_rank_flat, row_covs)
        with torch.inference_mode():  # cheaper per operation than no_grad; the states written stay ordinary tensors
            evidence = Evidence(prediction.detach(), target.detach(), blocks, aggregation)
            proposal = self.filter.propose(plan, evidence, belief, exchange.reduce)
            diagnostics = exchange.apply(plan, params, flat, proposal)
            applied = diagnostics["applied"]
            self.filter.commit(proposal, applied, belief)
            shared["step"].add_(applied.to(shared["step"].dtype))
            shared["skipped"].add_((~applied).to(torch.int64))
            diagnostics["innovation_norm"] = torch.linalg.vector_norm(proposal.innovation)
            diagnostics["cond"] = proposal.cond
            if proposal.cond is None:  # no system solved (the information forms): no condition number
                diagnostics["cond"] = torch.full((), math.nan, dtype=plan.dtype, device=plan.device)
            # p̂'s statistics cost three passes over it: with p̂ kept flat they are computed when diagnostics are read.
            self._statistics_pending = "p_mean" not in diagnostics and self._cov_flat is not None
            if "p_mean" not in diagnostics and self._cov_flat is None:
                diagnostics.update(plan.statistics(flat))
        if self._cov_flat is None:
            torch._foreach_copy_(covs, plan.views(flat))
        if low_rank is not None and self._low_rank_flat is None:
            plan.scatter_rows(low_rank_flat, low_rank)
        diagnostics["skipped"] = shared["skipped"]
        diagnostics["step"] = shared["step"]
        if self.average:  # θ̄ ← θ̄ + (1 − δ_k)(θ − θ̄), every parameter (a sharded step broadcast them all)
            with torch.no_grad():
                # δ_k = min(δ, (1 + k)/(10 + k)) after k applied steps, the warm-up of TensorFlow's
                # ExponentialMovingAverage: early in the stream θ̄ is not held back by θ₀ (δ = 0.99 from k = 890 on).
                k = shared["step"].to(torch.float64)
                weight = 1.0 - torch.clamp((1.0 + k) / (10.0 + k), max=self.average)
                averages = [self.state[p]["average"] for p in params]
                torch._foreach_lerp_(averages, list(params), [weight.to(a.dtype) for a in averages])
        self._diagnostics = diagnostics
        return result if observed.returned is None else observed.returned

    def _exchange(self) -> Replicated | Sharded:
        """The step's exchange: sharded with ``shard`` and several processes, else replicated."""
        if self.shard and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._consolidated = None
            return Sharded(self._shards, self.collective_timeout)
        return Replicated()

    def _adopt_shards(self, shards: ShardPlan) -> None:
        """The first sharded step: keep ``p̂`` of this process's parameters only, in one arithmetic dtype everywhere."""
        params, rank = self._params(), dist.get_rank()
        # One arithmetic dtype on every process, the replicated update's (that of the first parameter's p̂).
        self._shard_dtypes = [self.state[p]["cov"].dtype for p in params]
        for index, param in enumerate(params):
            if shards.owners[index] != rank:
                self.state[param].pop("cov", None)
                if not self.state[param]:
                    del self.state[param]
        self._shards, self._plan, self._plan_key = shards, None, None

    def _time_updates(self, owned: Sequence[int]) -> tuple[TimeUpdate, ...]:
        """The time update of each parameter in ``owned`` (indices in parameter order), from its param group."""
        settings = []
        for group in self.param_groups:
            update = TimeUpdate.of_group(group)
            for param in group["params"]:
                # The reference variance matters only where forgetting is on: nothing to derive per step otherwise.
                forgets = group["forgetting"]
                settings.append(replace(update, reference=_reference_cov(param, group)) if forgets else update)
        return tuple(settings[i] for i in owned)

    def _shared_rows(self, owned: Sequence[int]) -> tuple[bool, ...]:
        """Whether each parameter in ``owned`` (indices in parameter order) shares its rows' covariance."""
        flags = [bool(group.get("shared_rows")) for group in self.param_groups for _ in group["params"]]
        return tuple(flags[i] for i in owned)

    def _row_cov(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        """The ``Σ`` shared by ``param``'s rows; from ``p̂`` (the diagonal of its rows' mean) when a state holds none.

        ``add_param_group`` always makes one and a state with the other ``shared_rows`` is refused on load, so only a
        state dict written without ``row_cov`` for a shared group gets here; its ``Σ`` starts as a new one does.
        """
        state = self.state[param]
        if "row_cov" not in state:
            state["row_cov"] = torch.diag(state["cov"].reshape(param.shape[0], -1).mean(0).to(dtype))
        return state["row_cov"]

    def _low_rank(self, params: Sequence[Tensor], covs: Sequence[Tensor]) -> list[Tensor]:
        """The low-rank factor ``W`` of the precision, one ``(numel, rank)`` block per parameter (zeros at first).

        Like ``p̂``, kept as one flat ``(n, rank)`` tensor in the plan's order whose views the ``"W"`` states are
        (when ``p̂`` is: the same dtype and device), so a step gathers and copies nothing.
        """
        rank = self.filter.low_rank()
        blocks = []
        for param, cov in zip(params, covs, strict=True):
            state = self.state[param]
            if "W" not in state or tuple(state["W"].shape) != (param.numel(), rank):
                state["W"] = torch.zeros(param.numel(), rank, dtype=cov.dtype, device=cov.device)
            blocks.append(state["W"])
        plan = self._plan
        if self._cov_flat is None or any(w.dtype != plan.dtype or w.device != plan.device for w in blocks):
            self._low_rank_flat, self._low_rank_views = None, []
            return blocks
        if self._low_rank_flat is None or any(w is not v for w, v in zip(blocks, self._low_rank_views, strict=True)):
            self._low_rank_flat = plan.flatten_rows(blocks)
            self._low_rank_views = [
                self._low_rank_flat[plan.offsets[i] : plan.offsets[i] + param.numel()] for i, param in enumerate(params)
            ]
            for param, view in zip(params, self._low_rank_views, strict=True):
                self.state[param]["W"] = view
            blocks = list(self._low_rank_views)
        return blocks

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
            self._diagnostics.update(self._plan.statistics(self._cov_flat))
            self._statistics_pending = False

    def _flatten_covs(self, params: list[Tensor], covs: list[Tensor]) -> None:
        """Keep ``p̂`` as one flat vector in the plan's order, the per-parameter states being views of it.

        Only when every ``p̂`` has the plan's dtype and device (otherwise :func:`loko_update` gathers and
        scatters them each step).
        """
        plan = self._plan
        if any(c.dtype != plan.dtype or c.device != plan.device for c in covs):
            self._cov_flat, self._cov_views = None, []
            return
        self._cov_flat = plan.flatten(covs)
        self._cov_views = plan.views(self._cov_flat)
        for param, view in zip(params, self._cov_views, strict=True):
            self.state[param]["cov"] = view


def _initial_cov(param: Tensor, group: dict[str, Any], dtype: torch.dtype, generator: torch.Generator | None) -> Tensor:
    """``p̂_0`` of one parameter: the constant ``p0``, ``p0 / fan_in`` or a draw from ``U(0, p0]``."""
    p0 = group_p0(group)
    if group["p0_init"] == "constant":
        return torch.full(param.shape, p0, dtype=dtype, device=param.device)
    if group["p0_init"] == "fan_in":
        fan_in = param.shape[1:].numel() if param.dim() > 1 else 1
        return torch.full(param.shape, p0 / fan_in, dtype=dtype, device=param.device)
    draw = torch.rand(param.shape, generator=generator, dtype=torch.float64)
    # U(0, p0) includes 0; a zero entry would freeze its parameter forever, so draw from (0, p0].
    draw = (1.0 - draw) * p0
    return draw.to(dtype=dtype, device=param.device)


def _reference_cov(param: Tensor, group: dict[str, Any]) -> float:
    """The reference variance of ``forgetting``: the largest ``p̂₀`` the group's ``p0_init`` draws (``p0``)."""
    if group["p0_init"] == "fan_in":
        return group_p0(group) / (param.shape[1:].numel() if param.dim() > 1 else 1)
    return group_p0(group)


def group_p0(group: dict[str, Any]) -> float:
    """A param group's prior scale: its ``p0`` times its ``p0_scale`` (1 when the group sets none)."""
    return float(group["p0"]) * float(group.get("p0_scale", 1.0))


def _check_saved_state(saved: dict[Any, dict[str, Any]], params: Sequence[Tensor]) -> None:
    """Refuse a state dict that is not LoKO's for these parameters (another optimizer's, or other shapes)."""
    if not saved:
        return
    known = {"cov", "R", "step", "skipped", "W", "average", "row_cov"}
    foreign = sorted({key for state in saved.values() for key in state} - known)
    if foreign or any("cov" not in state for state in saved.values()):
        raise ValueError(
            f"Invalid state dict: it is not LoKO's (its per-parameter state holds {foreign or 'no cov'}; LoKO keeps "
            "cov, R, step, skipped, for lofi W, with average the average of the mean, with shared_rows row_cov): "
            "it comes from another optimizer, e.g. AdamW. Load it into that optimizer, or start LoKO from its initial "
            "state"
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
        row_cov = state.get("row_cov")
        cols = param.numel() // param.shape[0] if param.dim() else 1
        if row_cov is not None and (not isinstance(row_cov, Tensor) or tuple(row_cov.shape) != (cols, cols)):
            got = tuple(row_cov.shape) if isinstance(row_cov, Tensor) else type(row_cov).__name__
            raise ValueError(
                f"Invalid state dict: parameter {index}'s shared row covariance has shape {got}, expected "
                f"{(cols, cols)}: the state comes from another model; load it into that model's optimizer"
            )


def _check_group(group: dict[str, Any]) -> None:
    p0 = group["p0"]
    if not (real_number(p0) and p0 > 0 and p0 < float("inf")):
        auto = ""
        if p0 == "auto":
            auto = "; p0: auto is for OnlineClassifier (loko fit) or loko_lightning.learner.selection"
        message = (
            f"Invalid p0: {p0!r} ({type(p0).__name__}; must be a finite number > 0, an int or a float; the paper's "
            f"default is 0.2{auto})"
        )
        raise ConfigError(message, field="p0", owner=LoKO)
    scale = group.get("p0_scale", 1.0)
    if not (real_number(scale) and 0 < scale < float("inf")):
        raise ConfigError(
            f"Invalid p0_scale: {scale!r} (a group's factor on p0: must be a finite number > 0; 1 is the group's p0)",
            field="p0_scale",
            owner=LoKO,
        )
    if group["p0_init"] not in P0_INITS:
        raise ConfigError(
            f"Invalid p0_init: {group['p0_init']!r} (expected one of {P0_INITS})", field="p0_init", owner=LoKO
        )
    TimeUpdate.of_group(group).validate(owner=LoKO)
