r"""Choosing one hyperparameter online: candidate learners side by side, scored prequentially.

The paper has "no general criterion" for LoKO's ``p0``, and a baseline's learning rate is just as much a choice.
:class:`Candidates` says which optimizer argument to choose (``"p0"`` for :class:`~loko_lightning.LoKO`, ``"lr"``
for a gradient optimizer), among which values, on how many samples. :class:`CandidateStates` runs them: during
the first ``samples`` samples every candidate learner (the same network and stream, its own parameters, optimizer
state and scheduler) predicts each sample and then updates on it; its score is the sum of the cross-entropies of
those predictions, each made *before* the candidate's own update on that sample (prequential, no look-ahead). The
learner's own prediction for a sample is the current leader's (the lowest score on the samples before it), so the
online metrics stay honest during the selection. After ``samples`` samples the lowest score wins: its parameters
and state go on, the others are dropped. The cost is ``len(values)`` steps per step during the selection, nothing
after it. ``p0: auto`` in a LoKO config is this with :data:`AUTO_P0` and :data:`AUTO_SAMPLES`.

Plain PyTorch (one candidate after the other on each sample, the leader's prediction kept)::

    states = CandidateStates(Candidates("p0", (0.01, 0.1)), params, lambda p, **kw: LoKO(p, seed=0, **kw))
    for x, label in stream:                                       # label: (1,)
        results = []
        for index in range(len(states)):
            states.load(index, optimizer)
            prediction, _, _ = optimizer.step(closure)            # each candidate predicts, then updates
            results.append((prediction[None], label, optimizer.diagnostics["applied"]))
            states.save(index, optimizer)
        prediction = results[states.leader][0]                    # the learner's prediction for x
        states.record(results)
        states.advance(1, optimizer)                              # the leader is live; the winner at the end
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loko_lightning.errors import ConfigError

#: The ``p0`` candidates of ``p0: auto``: a factor of about 3 apart, from well inside the range of ``p0`` that learns
#: (``benchmarks/p0_range.py`` measures it) to the paper's 0.2 and one step beyond it.
AUTO_P0: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3)
#: The samples ``p0: auto`` selects on.
AUTO_SAMPLES = 500


@dataclass(frozen=True)
class Candidates:
    """Which optimizer argument to choose online, among which values, on how many samples.

    The defaults are ``p0: auto``'s: LoKO's ``p0`` among :data:`AUTO_P0` on :data:`AUTO_SAMPLES` samples.

    Args:
        name: the optimizer's keyword argument: ``"p0"`` (LoKO) or ``"lr"`` (AdamW, AdaGrad, ...).
        values: the candidate values (at least two, distinct).
        samples: the samples the candidates run side by side on; then the best goes on alone.

    Example:
        >>> Candidates("lr", (1e-4, 3e-4, 1e-3, 3e-3), samples=500)
        Candidates(name='lr', values=(0.0001, 0.0003, 0.001, 0.003), samples=500)
    """

    name: str = "p0"
    values: tuple[float, ...] = AUTO_P0
    samples: int = AUTO_SAMPLES

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(
                f"name must be an optimizer argument such as 'p0' or 'lr', got {self.name!r}",
                field="select.name",
                owner=Candidates,
            )
        bad = [v for v in self.values if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)]
        if bad or len(self.values) < 2 or len(set(self.values)) != len(self.values):
            raise ConfigError(
                f"values must be at least two distinct finite numbers > 0, got {list(self.values)}",
                field="select.values",
                owner=Candidates,
            )
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ConfigError(
                f"samples must be a positive integer, got {self.samples}", field="select.samples", owner=Candidates
            )


class CandidateStates:
    """The candidates' parameters, optimizer and scheduler states and prequential scores; one live copy at a time.

    Every candidate's state is a snapshot; :meth:`load` copies candidate ``index``'s into the live parameters (in
    place), optimizer and scheduler, :meth:`save` copies them back. :meth:`record` adds the cross-entropy of a
    prediction made before the update to that candidate's score. :meth:`advance` counts the samples; once
    ``samples`` have been seen the winner (lowest score, the first on ties) is loaded and the snapshots dropped.
    Its :meth:`state_dict` holds all of it, so a run resumes exactly mid-selection.

    Args:
        candidates: what to choose.
        params: the live trainable parameters.
        build: ``build(params, **{candidates.name: value})`` returns a fresh optimizer for one candidate.
        schedule: ``schedule(optimizer)`` returns its scheduler, or ``None`` (no scheduler).
    """

    def __init__(
        self,
        candidates: Candidates,
        params: Sequence[Tensor],
        build: Callable[..., torch.optim.Optimizer],
        schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        self.candidates = candidates
        self.params = list(params)
        initial = [p.detach().clone() for p in self.params]
        self.snapshots: list[dict[str, Any]] = []
        for value in candidates.values:
            optimizer = build(self.params, **{candidates.name: value})
            scheduler = schedule(optimizer) if schedule is not None else None
            self.snapshots.append(
                {
                    "params": [p.clone() for p in initial],
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "scheduler": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
                }
            )
        self.scores = [0.0] * len(candidates.values)
        self.seen = 0
        self.classes = 0  # m, from the first recorded step (the divergence limit 3 log m)
        self.chosen: int | None = None

    def __len__(self) -> int:
        return len(self.candidates.values)

    @property
    def done(self) -> bool:
        """Whether the selection is over (the winner is live, the snapshots are gone)."""
        return self.chosen is not None

    @property
    def leader(self) -> int:
        """The candidate with the lowest score so far (the first of equals): the learner predicts with it."""
        return min(range(len(self)), key=lambda index: (self.scores[index], index))

    @torch.no_grad()
    def load(self, index: int, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Make candidate ``index`` live: its parameters (copied in place), optimizer and scheduler states."""
        snapshot = self.snapshots[index]
        for param, value in zip(self.params, snapshot["params"], strict=True):
            param.copy_(value)
        # torch's load_state_dict may keep the given tensors (same dtype and device): the live state must not
        # alias the snapshot it came from.
        optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        if scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(snapshot["scheduler"]))

    @torch.no_grad()
    def save(self, index: int, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Keep the live parameters, optimizer and scheduler states as candidate ``index``'s."""
        snapshot = self.snapshots[index]
        for value, param in zip(snapshot["params"], self.params, strict=True):
            value.copy_(param)
        snapshot["optimizer"] = copy.deepcopy(optimizer.state_dict())
        if scheduler is not None:
            snapshot["scheduler"] = copy.deepcopy(scheduler.state_dict())

    def record(self, results: Sequence[tuple[Tensor, Tensor, Tensor | bool]]) -> None:
        """Add each candidate's cross-entropy on this step's samples to its score.

        Args:
            results: per candidate, in order, ``(prediction, label, applied)``: ``(N, m)`` probabilities made before
                its update, ``(N,)`` labels, and whether its update was applied. A step every candidate skipped
                (non-finite input) scores nothing; a candidate that alone skipped it (its own prediction or update
                was not finite: it diverged, or its filter broke down) scores infinity, as does a non-finite
                cross-entropy.
        """
        applied = [bool(result[2]) for result in results]
        self.classes = results[0][0].shape[-1]
        if not any(applied):
            return
        for index, (prediction, label, _) in enumerate(results):
            loss = math.inf
            if applied[index]:
                probability = prediction.detach().double().gather(-1, label.view(-1, 1))
                loss = float(-probability.clamp_min(torch.finfo(torch.float64).tiny).log().sum())
            self.scores[index] += loss if math.isfinite(loss) else math.inf

    def advance(self, samples: int, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> bool:
        """Count ``samples`` seen by every candidate; load the leader (the winner once the selection ends).

        Returns:
            True when this call ended the selection.
        """
        self.seen += samples
        leader = self.leader
        self.load(leader, optimizer, scheduler)
        if self.seen < self.candidates.samples:
            return False
        self.chosen = leader
        self.snapshots = []
        return True

    def summary(self) -> str:
        """The scores in words, for the log; a candidate above the divergence guard's limit is said to diverge."""
        name = self.candidates.name
        limit = 3 * math.log(self.classes) if self.classes > 1 else math.inf
        means = [score / max(self.seen, 1) for score in self.scores]
        per = ", ".join(
            f"{name}={value:g}: {mean:.4f}" + (" (diverged)" if mean > limit else "")
            for value, mean in zip(self.candidates.values, means, strict=True)
        )
        head = f"chose {name}={self.candidates.values[self.chosen]:g}" if self.done else f"leader {self.leader}"
        text = f"{head} after {self.seen} samples (mean prequential cross-entropy: {per})"
        diverged = [f"{value:g}" for value, mean in zip(self.candidates.values, means, strict=True) if mean > limit]
        if diverged:
            text += (
                f"; {name}={', '.join(diverged)} diverged (mean cross-entropy above 3 log m = {limit:.2f}, uniform "
                "guessing), so the grid reaches past the stable range there"
            )
        return text

    def state_dict(self) -> dict[str, Any]:
        """Scores, counters and (until the selection ends) every candidate's snapshot."""
        return {"scores": list(self.scores), "seen": self.seen, "chosen": self.chosen, "snapshots": self.snapshots}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the parameters' tensors are copied to their devices)."""
        self.scores, self.seen, self.chosen = list(state["scores"]), int(state["seen"]), state["chosen"]
        self.snapshots = [
            {
                **snapshot,
                "params": [v.to(p.device, copy=True) for v, p in zip(snapshot["params"], self.params, strict=True)],
            }
            for snapshot in state["snapshots"]
        ]
