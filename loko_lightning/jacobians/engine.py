"""Prediction and Jacobian of a model's outputs w.r.t. its trainable parameters, for one sample or a batch.

:class:`JacobianEngine` is built once per model (scan, hooks, caches: :mod:`~loko_lightning.jacobians.hooks`) and
called once per sample: it checks the call, runs the forward pass with its hooks on, then the reverse pass
(:mod:`~loko_lightning.jacobians.reverse`), and takes that pass's fallback where it has one. :func:`jacobian` is the
same for a single call.

The ``m`` rows of the Jacobian come from one forward pass and one *batched* reverse pass (``torch.func.vmap``
over :func:`torch.autograd.grad` with the ``m`` cotangents), never from ``ñ`` forward passes or ``m`` separate
backward passes.

Fast path for weights of ``nn.Linear`` and ``nn.Conv2d`` layers (every LoRA ``A``/``B`` factor of peft, and a new
classification head, are such layers): a layer ``z_p = W x_p + b`` applied at ``k`` positions ``p`` (output pixels of a
convolution with ``x_p`` its unfolded input patch, or tokens) has the per-sample-gradient structure
``∂ŷ_a/∂W = Σ_p (∂ŷ_a/∂z_p) x_pᵀ``. So the batched reverse pass only has to deliver the ``m`` cotangents at the layer
*output*; the layer's input is captured in the forward pass (batch 1, shared by all rows) and the weight Jacobian is one
matrix product, or is returned in that exact factored form (:class:`~loko_lightning.FactoredJacobian`). While the
forward pass runs through such a layer its trainable weight is swapped for a detached alias, so the reverse pass never
forms a weight gradient there; any other use of the same weight elsewhere in the model still reaches the real parameter
and is added. Everything else (other parameter kinds, ``groups > 1`` convolutions, layers called with keyword arguments,
...) goes through the generic batched reverse pass. Both paths give the same Jacobian up to floating-point rounding.

With softmax outputs the rows sum to zero (``Σ_a ŷ_a = 1``), so only ``m - 1`` rows go through the reverse pass
and the last is minus their sum: exact, one reverse row fewer.

Frozen layers only pass cotangents through. Where their generic batched backward is mostly overhead (eval-mode
batch norms, pointwise convolutions, convolutions on small maps) it is replaced, during engine calls only, by the
matrix product it amounts to (:mod:`loko_lightning.jacobians.frozen`); the forward values are the layers' own. The
engine caches the dense matrices of small-map convolutions while their weights do not change
(:attr:`JacobianEngine.cache_nbytes` says how much they hold), and releases them with itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from loko_lightning.jacobians.blocks import JacobianBlock, kind
from loko_lightning.jacobians.hooks import ModelHooks
from loko_lightning.jacobians.reverse import Fallback, Jacobians, reverse_pass
from loko_lightning.observation import Observation, get_observation


class JacobianEngine:
    """Prediction ``ŷ`` and ``∂ŷ/∂θ`` of one model, one sample per call, with the per-model work done once.

    Building the engine scans the model once for the layers with a faster path (``nn.Linear``/``nn.Conv2d`` layers
    whose weight is differentiated, frozen batch norms and convolutions; see the module docstring) and registers
    forward hooks on them once. Outside the engine's own calls those hooks read one flag and return: the model computes
    exactly what it computes without them, for evaluation or for another optimizer's forward and backward pass.

    Checked on every call, cheaply:

    - the model's structure: the submodules and parameters of every module (and the buffers of normalisation
      layers), by identity. If one was added, removed or replaced, the engine scans the model again (its hooks move
      with it, its caches are emptied). Module attributes (a convolution's padding, ...) are taken as fixed.
    - normalisation layers with running statistics must be in eval mode (at batch size 1 their batch statistics are
      meaningless and every call would overwrite the running ones), whenever they were switched; so must random
      layers (dropout of any kind, timm's ``DropPath``/``DropBlock2d``, ``nn.RReLU``), whose prediction would differ
      from call to call. A batch norm without running statistics that sees one value per channel is refused by name.
    - every parameter differentiated must have ``requires_grad``.
    - autocast: under autocast the hooks stay inert and every parameter goes through the generic batched reverse pass.
    - the caches: a weight or running variance replaced, or changed in place, rebuilds its entry.

    The differentiated parameters are fixed when the engine is built, as an optimizer's are: build both after the
    model is complete and on its device. A layer added later is differentiated through, not differentiated.

    The caches (dense matrices of small-map frozen convolutions, batch-norm scales) belong to the engine and are
    released with it, or by :meth:`close`, which also removes the hooks; the engine is a context manager that closes
    on exit. One call at a time: the engine is not thread-safe.

    Args:
        model: maps ``inputs`` (batch dimension 1) to ``(1, m)`` logits or regression outputs.
        params: the parameters to differentiate (each with ``requires_grad``), default all with ``requires_grad``
            when the engine is built. Frozen weights get no gradient and cost nothing beyond the backward pass
            through them.
        observation: what is observed of the model's outputs (:mod:`loko_lightning.observation`): ``"softmax"``
            (classification, ``ŷ`` = class probabilities, the default), ``"regression"`` (``ŷ`` = the outputs), or an
            :class:`~loko_lightning.observation.Observation`. Give the optimizer the same one.
        chunk_size: at most this many Jacobian rows per batched backward pass, to bound memory for large ``m``; default
            all ``m`` at once.
        factorize: return the weight Jacobian of every fast-path ``nn.Linear``/``nn.Conv2d`` layer in its exact
            factored form: :class:`~loko_lightning.OuterJacobian` (``∂ŷ/∂z ⊗ x``) when the layer saw one position, as
            a classification head does, otherwise :class:`~loko_lightning.FactoredJacobian` wherever that makes the
            Kalman update cheaper (:func:`~loko_lightning.jacobians.blocks.factored_is_cheaper`: few positions against
            ``m``, i.e. deep layers and many classes). :class:`~loko_lightning.LoKO` consumes every form exactly.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> with JacobianEngine(model, factorize=True) as engine:
        ...     for x in torch.randn(5, 1, 4):  # a stream of samples, batch dimension 1
        ...         prediction, jacobians = engine(x)
        >>> prediction.shape, type(jacobians[2]).__name__, jacobians[2].shape
        (torch.Size([3]), 'OuterJacobian', torch.Size([3, 3, 8]))
    """

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[Tensor] | None = None,
        *,
        observation: str | Observation = "softmax",
        chunk_size: int | None = None,
        factorize: bool = False,
    ) -> None:
        self._observation = get_observation(observation, owner=JacobianEngine)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"Invalid chunk_size: {chunk_size} (must be >= 1 or None)")
        params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
        if not params:
            raise ValueError("Invalid params: no trainable parameters (none has requires_grad=True)")
        _check_requires_grad(model, params)
        self._model = model
        self._params = params
        self._chunk_size = chunk_size
        self._factorize = factorize
        self._hooks = ModelHooks(frozenset(map(id, params)))
        # Removes the hooks when the engine is closed or garbage collected; holds no reference to the engine.
        self._finalizer = weakref.finalize(self, self._hooks.remove)
        self._hooks.scan(model)

    @property
    def model(self) -> nn.Module:
        """The model the engine differentiates."""
        return self._model

    @property
    def observation(self) -> Observation:
        """What the engine observes of the model's outputs (the prediction it returns and differentiates)."""
        return self._observation

    @property
    def params(self) -> list[Tensor]:
        """The parameters differentiated, in the order of the returned Jacobians."""
        return list(self._params)

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the engine's caches (dense matrices of small-map frozen convolutions, batch-norm scales)."""
        return self._hooks.cache_nbytes

    def __call__(self, inputs: Tensor | Mapping[str, Tensor]) -> tuple[Tensor, list[JacobianBlock]]:
        """Prediction ``ŷ`` and ``∂ŷ/∂θ`` for one sample.

        Args:
            inputs: one sample with a leading batch dimension of 1: a tensor, or a dict of tensors (a text model's
                ``input_ids``, ``attention_mask``, ...), passed to the model as one argument.

        Returns:
            ``(prediction, jacobians)``: ``ŷ`` of shape ``(m,)`` (detached) and one Jacobian per parameter, each of
            shape ``(m, *param.shape)`` or a factored block of that shape (see ``factorize``). Dense Jacobians are
            column blocks of one shared ``(m, n)`` buffer (``H``), which :func:`~loko_lightning.loko_update` uses
            without a copy, so they need not be contiguous.
        """
        self._refuse_without_label()
        return self._one(inputs, None)

    def _refuse_without_label(self) -> None:
        if self._observation.needs_label:
            raise ValueError(
                f"Invalid call: observation {self._observation.name!r} chooses the rows of H from the label; use "
                "engine.observe(inputs, label), which returns (prediction, target, jacobians)"
            )

    def _one(self, inputs: Tensor | Mapping[str, Tensor], label: Tensor | None) -> tuple[Tensor, list[JacobianBlock]]:
        first = _check_inputs(inputs, batch=False)
        fast = self._check_call(first)
        result = self._run(inputs, fast, label=label)
        if isinstance(result, Fallback):  # a fast-path layer's input was modified in place: redo it generically
            result = self._run(inputs, False, label=label)
        if isinstance(result, Fallback):
            raise RuntimeError(f"Internal error: a single sample without the fast path gave {result}")
        return result.prediction, result.blocks

    def batch(self, inputs: Tensor) -> tuple[Tensor, list[JacobianBlock]]:
        """Predictions and each sample's own Jacobian for a batch of ``B`` samples, in one batched reverse pass.

        The network must not couple the samples of a batch (it is frozen and in eval mode; the engine checks its
        normalisation and random layers as for one sample), and its ``nn.Linear``/``nn.Conv2d`` layers must see the
        batch along their input's first dimension. One forward pass of the ``B`` samples; then a reverse pass of
        ``m - 1`` cotangents (with softmax outputs), each one row for every sample at once: the fast-path layers'
        per-sample factors come out of it directly. ``chunk_size`` bounds the per-sample rows of one reverse pass (a
        cotangent shared by ``B`` samples counts ``B``), and with it the memory.

        The samples go one at a time instead (each as :meth:`__call__`, exact, at ``B`` times one sample's cost) when
        a parameter is also reached another way (a generic parameter, a weight used outside its layer: its gradient
        would be summed over the samples), when a fast-path layer sees an input whose first dimension is not the
        batch (a model that folds the batch), and without the fast path (autocast). Separating the samples inside
        one reverse pass of the batch would cost ``B`` times more: every one-sample cotangent runs backward through
        all ``B`` samples.

        Args:
            inputs: ``B`` samples along the first dimension.

        Returns:
            ``(prediction, jacobians)``: ``ŷ`` of shape ``(B, m)`` (detached) and one batched block per parameter:
            dense ``(B, m, *param.shape)`` (slices of one ``(B, m, n)`` buffer), or
            :class:`~loko_lightning.OuterJacobian` / :class:`~loko_lightning.FactoredJacobian` with a leading batch
            dimension on both factors, as :meth:`loko_lightning.LoKO.step` takes them for a joint update.
        """
        self._refuse_without_label()
        return self._batch(inputs, None)

    def _batch(self, inputs: Tensor, label: Tensor | None) -> tuple[Tensor, list[JacobianBlock]]:
        first = _check_inputs(inputs, batch=True)
        fast = self._check_call(first)
        samples = first.shape[0]
        result = self._run(inputs, True, samples, label) if fast and not self._hooks.uncovered else Fallback.PER_SAMPLE
        if isinstance(result, Fallback):  # either fallback: each sample as a call of its own (see above)
            labels = [None if label is None else label[b : b + 1] for b in range(samples)]
            return _stack_samples([self._one(_sample(inputs, b), labels[b]) for b in range(samples)])
        return result.prediction, result.blocks

    def observe(
        self, inputs: Tensor | Mapping[str, Tensor], label: Tensor, *, batched: bool | None = None
    ) -> tuple[Tensor, Tensor, list[JacobianBlock]]:
        """Prediction, target and Jacobians of one sample or a batch: what :meth:`LoKO.step`'s closure returns.

        Args:
            inputs: one sample (batch dimension 1) or ``B`` samples.
            label: their labels, ``(1,)`` or ``(B,)`` (a regression: the target values, ``(1, m)`` or ``(B, m)``).
            batched: return the batch form (a leading batch dimension) even for one sample; default: for ``B > 1``.

        Returns:
            ``(prediction, target, jacobians)``: one sample as :meth:`__call__` gives it (``(m,)``), with its target
            (``(m,)``); a batch as :meth:`batch` (``(B, m)``) with ``(B, m)`` targets. The target is the
            observation's (:meth:`~loko_lightning.observation.Observation.target`): a one-hot vector for softmax.
        """
        if batched is None:
            batched = _check_inputs(inputs, batch=True).shape[0] > 1
        # An observation that chooses the rows of H from the label gets it in the reverse pass.
        given = label if self._observation.needs_label else None
        if not batched:
            prediction, jacobians = self._one(inputs, given)
            return prediction, self._observation.target(label, prediction[None])[0], jacobians
        prediction, jacobians = self._batch(inputs, given)
        return prediction, self._observation.target(label, prediction), jacobians

    def _check_call(self, first: Tensor) -> bool:
        """The per-call checks (see the class docstring); whether the fast path may run (``first``: an input)."""
        if not self._finalizer.alive:
            raise RuntimeError("Invalid call: this JacobianEngine is closed (build a new one)")
        if self._hooks.structure_changed():
            self._hooks.remove()
            self._hooks.scan(self._model)
        if not all(p.requires_grad for p in self._params):
            _check_requires_grad(self._model, self._params)
        self._hooks.check_modes(self._model)
        return not torch.is_autocast_enabled(first.device.type)

    def close(self) -> None:
        """Remove the hooks from the model and release the caches; the engine cannot be called afterwards."""
        self._finalizer()
        self._hooks.clear_caches()

    def __enter__(self) -> JacobianEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(
        self,
        inputs: Tensor | Mapping[str, Tensor],
        fast: bool,
        samples: int | None = None,
        label: Tensor | None = None,
    ) -> Jacobians | Fallback:
        """One forward pass with the hooks on (``fast``) or inert, then the batched reverse pass."""
        layers = self._hooks.layers if fast else {}
        self._hooks.calling, self._hooks.fast, self._hooks.batched = True, fast, samples is not None
        try:
            try:
                with torch.enable_grad():
                    raw = self._model(inputs)
            finally:
                self._hooks.calling = self._hooks.fast = self._hooks.batched = False
                for layer in layers.values():  # only left over if the forward pass raised inside the layer
                    layer.module._parameters.update(layer.saved)
                    layer.saved.clear()
            if isinstance(raw, Tensor):
                _check_outputs_once(self._model, raw, self._observation)
            return reverse_pass(
                raw, self._params, layers, self._observation, self._chunk_size, self._factorize, samples, label
            )
        finally:
            for layer in layers.values():  # the calls hold the layers' inputs and graph: not beyond the call
                layer.calls.clear()


def jacobian(
    model: nn.Module,
    inputs: Tensor,
    params: Sequence[Tensor] | None = None,
    *,
    observation: str | Observation = "softmax",
    chunk_size: int | None = None,
    factorize: bool = False,
) -> tuple[Tensor, list[JacobianBlock]]:
    """Prediction ``ŷ`` and ``∂ŷ/∂θ`` for a single sample, by a :class:`JacobianEngine` built for this call.

    A loop over samples should build the engine once instead: it then scans the model and registers its hooks once,
    and keeps its caches between calls.

    Args:
        model: maps ``inputs`` (batch dimension 1) to ``(1, m)`` logits or regression outputs.
            Normalisation layers with running statistics and random layers (dropout, ...) must be in eval mode,
            see :class:`JacobianEngine`.
        inputs: one sample with a leading batch dimension of 1.
        params: the parameters to differentiate (each with ``requires_grad``), default all with ``requires_grad``.
        observation: ``"softmax"`` (classification), ``"regression"`` or an observation, see :class:`JacobianEngine`.
        chunk_size: at most this many Jacobian rows per batched backward pass; default all ``m`` at once.
        factorize: return fast-path weight Jacobians in exact factored form, see :class:`JacobianEngine`.

    Returns:
        ``(prediction, jacobians)``: ``ŷ`` of shape ``(m,)`` (detached) and one Jacobian per parameter, each
        of shape ``(m, *param.shape)`` or a factored block of that shape (see ``factorize``). Dense Jacobians are
        column blocks of one shared ``(m, n)`` buffer (``H``), which :func:`~loko_lightning.loko_update` uses
        without a copy, so they need not be contiguous.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> prediction, jacobians = jacobian(model, torch.randn(1, 4))
        >>> prediction.shape, jacobians[0].shape
        (torch.Size([3]), torch.Size([3, 8, 4]))
    """
    with JacobianEngine(model, params, observation=observation, chunk_size=chunk_size, factorize=factorize) as engine:
        return engine(inputs)


# The (observation, output shape) pairs whose outputs were checked, per model: the check reads the host, so it runs
# once per model and shape, not on every step (a network that ends in Softmax does so on every call).
_CHECKED_OUTPUTS: weakref.WeakKeyDictionary[nn.Module, set[tuple[str, tuple[int, ...]]]] = weakref.WeakKeyDictionary()


def _check_outputs_once(model: nn.Module, outputs: Tensor, observation: Observation) -> None:
    """:meth:`~loko_lightning.observation.Observation.check_outputs` on a model's first outputs of each shape."""
    seen = _CHECKED_OUTPUTS.setdefault(model, set())
    key = (observation.name, tuple(outputs.shape[1:]))
    if key not in seen:
        observation.check_outputs(outputs)
        seen.add(key)


def _check_requires_grad(model: nn.Module, params: list[Tensor]) -> None:
    for i, param in enumerate(params):
        if not param.requires_grad:
            name = next((n for n, p in model.named_parameters() if p is param), None)
            what = f"parameter {name!r}" if name is not None else f"params[{i}] (not a parameter of the model)"
            raise ValueError(
                f"Invalid params: {what} has requires_grad=False, so the prediction has no derivative with respect "
                "to it; call requires_grad_(True) on it or leave it out of params"
            )


def _check_inputs(inputs: Any, batch: bool) -> Tensor:
    """The first tensor of ``inputs`` (a tensor or a dict of tensors), after checking their batch dimension.

    One sample: each tensor has batch dimension 1; ``batch``: the same number ``B >= 1`` of samples along the first
    dimension of every tensor.
    """
    tensors = list(inputs.values()) if isinstance(inputs, Mapping) else [inputs]
    if not tensors:
        raise ValueError("Invalid inputs: an empty dict")
    expected = "a batch of samples along the first dimension" if batch else "one sample with batch dimension 1"
    for tensor in tensors:
        size = tensors[0].shape[0] if batch and isinstance(tensors[0], Tensor) and tensors[0].dim() else 1
        if not isinstance(tensor, Tensor) or tensor.dim() == 0 or tensor.shape[0] != size or size < 1:
            got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"Invalid inputs: expected {expected}, got shape {got}")
    return tensors[0]


def _sample(inputs: Tensor | Mapping[str, Tensor], index: int) -> Tensor | dict[str, Tensor]:
    """Sample ``index`` of a batch (a tensor or a dict of tensors), keeping its batch dimension of 1."""
    if isinstance(inputs, Mapping):
        return {key: value[index : index + 1] for key, value in inputs.items()}
    return inputs[index : index + 1]


def _stack_samples(results: list[tuple[Tensor, list[JacobianBlock]]]) -> tuple[Tensor, list[JacobianBlock]]:
    """Single-sample results as one batch: predictions ``(B, m)``, blocks with a leading batch dimension."""
    per_parameter = zip(*(jacobians for _, jacobians in results), strict=True)
    blocks = [kind(jacs[0]).stack(jacs) for jacs in per_parameter]
    return torch.stack([prediction for prediction, _ in results]), blocks
