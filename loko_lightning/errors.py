"""Errors that name the setting they are about.

Library code raises :class:`ConfigError` with the *argument* it is about (``p0``, ``max_samples``) and, where it
knows it, the class that took the argument. It never formats a command-line flag: the ``loko`` command finds
where that class sits in the configuration (``model.optimizer``, ``data``) and prints ``--model.optimizer.p0``.
Plain PyTorch code can catch it as the ``ValueError`` it is.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad value of one argument: the message says what to change, ``field`` names the argument.

    Args:
        message: what is wrong and how to fix it (shown as is to Python users).
        field: the argument of ``owner`` that is wrong, e.g. ``"p0"``; dotted for a nested argument; ``None`` when
            the message is about ``owner`` as a whole.
        owner: the class (or an instance of it) whose argument ``field`` is; ``None`` if not known.

    Example:
        >>> err = ConfigError("Invalid p0: -1 (must be > 0)", field="p0")
        >>> isinstance(err, ValueError), err.field, str(err)
        (True, 'p0', 'Invalid p0: -1 (must be > 0)')
    """

    def __init__(self, message: str, *, field: str | None, owner: type | Any | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.owner = owner if owner is None or isinstance(owner, type) else type(owner)


class DivergenceError(RuntimeError):
    """An online run diverged: the message says why, which hyperparameter to change and where the last good state is.

    Args:
        message: the cause, the value to try and the saved state.
        field: the hyperparameter to change (``"p0"`` for LoKO, ``"lr"`` for a gradient optimizer).
        owner: the class whose argument ``field`` is (the optimizer's class).
    """

    def __init__(self, message: str, *, field: str | None, owner: type | Any | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.owner = owner if owner is None or isinstance(owner, type) else type(owner)


class LostProcessError(RuntimeError):
    """A process of a distributed run was lost (killed, or hung past the timeout): which one, and how to resume."""


class NoLearningRateError(KeyError):
    """Raised when a tool (a torch LR scheduler, Lightning's ``LearningRateMonitor``) reads ``lr`` from LoKO.

    Still the ``KeyError`` those tools would have met on a LoKO param group, with a message that says why there is
    no learning rate and what plays its role.
    """

    MESSAGE = (
        "LoKO has no learning rate ('lr') to read or schedule: each parameter's step size is its covariance p-hat, "
        "which starts at p0 and shrinks as the filter learns (OnlineClassifier logs its mean as loko/p_mean). "
        "Learning-rate schedulers and LearningRateMonitor do not apply to LoKO: remove them, or use a gradient "
        "optimizer such as torch.optim.AdamW if you want a schedule"
    )

    def __init__(self, message: str = MESSAGE) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])
