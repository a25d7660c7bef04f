"""Where a LoKO step's time goes: the median time of each part of the online step, one thread, one process.

Usage::

    python benchmarks/step_parts.py --config configs/fashion_mnist_lite0.yaml --samples 300 --threads 1
    python benchmarks/step_parts.py --config configs/glyphs100_lite0.yaml --samples 300 --threads 1 \
        --learners default -- --data.source.image_size 64

Each learner (``default``: what ``loko fit`` decides, ``--loko=default``; ``paper``: the config's own LoKO,
``--loko=as_configured``) trains on the config's stream for ``--samples`` samples, one after the other in this
process, and every part is timed around its call (``time.perf_counter``) at every step:

- ``step``: the learner's whole online step (the mixture's, or LoKO's alone);
- ``averaged forward``: the prediction of LoKO's averaged mean (the block under ``LoKO.averaged``, ``average > 0``,
  less a joint forward pass in it);
- ``Jacobian``: ``JacobianEngine.observe``, the forward pass and the Jacobian's rows at the mean;
- ``filter``: ``LoKO.step`` less the Jacobian (the Kalman arithmetic and the exchange);
- ``frozen forward``: the mixture's forward pass with the adapters off (``FrozenFeatures``);
- ``joint forward``: the averaged mean's prediction and the frozen features in one pass of the sample twice over
  (``FrozenFeatures.with_adapted``: the mixture's with LoKO's average);
- ``LDA``: the frozen head's update (its optimizer's ``step``: the eigenbasis refreshed every 64 samples; timed from
  the second step, the head being built at the first);
- ``calibration``: the mixture's recalibration of its prediction and the update of its bins (``calibration > 0``);
- ``rest``: the step less those parts (the mixture's experts and weights, the loop's bookkeeping in the step).

It prints the median of each over the steps after ``--warmup`` (a part's median and the medians of the step do not
add up exactly: each is a median of its own), with the mean too (the refreshes of LDA's eigenbasis show there). Ratios
between parts measured in one process are what to read; absolute times depend on the CPU and on what else runs.

``--lockstep N``: the learners train at the same time in one process, one thread each, taking turns of ``N`` steps
(each waits, idle, while another fetches its samples and steps), so that a change in the machine's speed over the run
(this project's VM moved a learner's median by 10-40% between runs) falls on each learner's steps alike. It prints,
beside the table, the median over the steps of the ratio of each learner's step to the first's *at the same step*,
with the quartiles of that ratio: a paired measurement, where two runs one after the other compare two different
stretches of the machine's time. A turn of one step makes every step start with the CPU's caches holding another
learner's tensors (on this VM both learners' steps were 30-50% slower so than one after the other); a turn of 10 keeps
them warm but for a turn's first step. ::

    python benchmarks/step_parts.py --config configs/fashion_mnist_lite0.yaml --samples 300 --threads 1 \
        --learners paper default --lockstep 10
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl

from loko_lightning.jacobians.engine import JacobianEngine
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.learner import mixture_step
from loko_lightning.learner.frozen_features import FrozenFeatures

LEARNERS = {"default": ["--loko=default"], "paper": ["--loko=as_configured"]}
PARTS = (
    "step",
    "averaged forward",
    "Jacobian",
    "filter",
    "frozen forward",
    "joint forward",
    "LDA",
    "calibration",
    "rest",
)


class Active:
    """The learner whose step runs now (one at a time, in lockstep too): the patched methods time into its parts."""

    def __init__(self) -> None:
        self.times: PartTimes | None = None

    def add(self, part: str, seconds: float) -> None:
        """Add ``seconds`` to ``part`` of the running learner's step (nothing outside a step)."""
        if self.times is not None:
            self.times.add(part, seconds)

    def so_far(self, part: str) -> float:
        """The seconds ``part`` holds so far in the running learner's step."""
        current = self.times.current if self.times is not None else None
        return current.get(part, 0.0) if current is not None else 0.0

    def wrap(self, function: Callable[..., Any], part: str) -> Callable[..., Any]:
        """``function``, its time added to ``part`` of the running learner's step."""
        return _timer(function, part, self.add)


def _timer(function: Callable[..., Any], part: str, add: Callable[[str, float], None]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            add(part, time.perf_counter() - start)

    return timed


class PartTimes(pl.Callback):
    """Each step's time in each part (seconds), filled by its own timers and the patched methods of :func:`timed`."""

    def __init__(self, active: Active | None = None) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.active = active

    def add(self, part: str, seconds: float) -> None:
        """Add ``seconds`` to ``part`` of the step running now (nothing outside a training step)."""
        if self.current is not None:
            self.current[part] = self.current.get(part, 0.0) + seconds

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        """A new step: its parts from zero; the learner's whole step timed around its online step."""
        self.current = {}
        if self.active is not None:
            self.active.times = self
        step = pl_module.online_step
        if not getattr(step, "_timed", False):
            step.step = self.wrap(step.step, "step")
            step._timed = True
        # The frozen head's optimizer, built at the mixture's first step: its own step (an instance attribute, as
        # torch's optimizer hook may have put a wrapper of the base class's step on the head's class).
        head = getattr(step, "lda", None)
        if head is not None and not getattr(head, "_timed", False):
            head.step = self.wrap(head.step, "LDA")
            head._timed = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        """The step's parts kept."""
        if self.current is not None:
            self.steps.append(self.current)
        self.current = None

    def wrap(self, function: Callable[..., Any], part: str) -> Callable[..., Any]:
        """``function``, its time added to ``part``."""
        return _timer(function, part, self.add)


class Lockstep(pl.Callback):
    """One of ``players`` learners fitting in threads of one process, taking turns of ``steps`` steps (see the module).

    A learner waits for its turn before its first step and, after each turn, hands the turn to the next learner that
    has not finished and waits for it to come back (so its next sample is fetched in its own turn); :meth:`finish`
    (called when its fit ends, even on an error) hands it on for good. Put it before the :class:`PartTimes`.
    """

    def __init__(self, me: int, turns: dict[str, Any], steps: int = 1) -> None:
        self.me, self.turns, self.steps, self.taken = me, turns, steps, 0

    def _next(self) -> int:
        players, done = self.turns["players"], self.turns["done"]
        for offset in range(1, players + 1):
            other = (self.me + offset) % players
            if other not in done:
                return other
        return self.me

    def wait(self) -> None:
        """Until it is this learner's turn (or every other learner has finished)."""
        with self.turns["lock"]:
            self.turns["lock"].wait_for(lambda: self.turns["turn"] == self.me or self._next() == self.me)

    def hand_on(self) -> None:
        """The turn to the next learner that has not finished."""
        with self.turns["lock"]:
            self.turns["turn"] = self._next()
            self.turns["lock"].notify_all()

    def finish(self) -> None:
        """This learner is done: the others no longer wait for it."""
        with self.turns["lock"]:
            self.turns["done"].add(self.me)
            if self.turns["turn"] == self.me:
                self.turns["turn"] = self._next()
            self.turns["lock"].notify_all()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        """Wait for the turn (the first step; later ones start in the turn the last step waited for)."""
        self.wait()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        """At the end of a turn, hand it on and wait for it to come back."""
        self.taken += 1
        if self.taken % self.steps == 0:
            self.hand_on()
            self.wait()


def lockstep_fit(runs: list[list[str]], times: list[PartTimes], steps: int = 1) -> None:
    """Fit the runs (``loko fit`` arguments) at once, one thread each, taking turns of ``steps`` (:class:`Lockstep`).

    The runs are built one after the other first (seeding is process-wide), then fitted. An error in one is raised
    here after every thread has ended.
    """
    turns: dict[str, Any] = {"lock": threading.Condition(), "turn": 0, "done": set(), "players": len(runs)}
    scratch = [tempfile.mkdtemp(prefix="loko-benchmark-") for _ in runs]
    errors: list[BaseException] = []
    try:
        clis = [
            common.build([*run, f"--trainer.default_root_dir={root}"], callbacks=[Lockstep(me, turns, steps), timer])
            for me, (run, root, timer) in enumerate(zip(runs, scratch, times, strict=True))
        ]

        def fit(me: int) -> None:
            try:
                clis[me].trainer.fit(clis[me].model, datamodule=clis[me].datamodule)
            except BaseException as err:  # noqa: BLE001 - raised again in the main thread
                errors.append(err)
            finally:
                Lockstep(me, turns).finish()

        threads = [threading.Thread(target=fit, args=(me,), name=f"learner-{me}") for me in range(len(runs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for root in scratch:
            shutil.rmtree(root, ignore_errors=True)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def timed(times: Active) -> Iterator[None]:
    """Time the parts' methods into the running learner's step (class attributes, patched and restored after)."""
    patched = {
        (JacobianEngine, "observe"): times.wrap(JacobianEngine.observe, "Jacobian"),
        (LoKO, "step"): times.wrap(LoKO.step, "LoKO.step"),
        (FrozenFeatures, "__call__"): times.wrap(FrozenFeatures.__call__, "frozen forward"),
        (FrozenFeatures, "with_adapted"): times.wrap(FrozenFeatures.with_adapted, "joint forward"),
        (mixture_step.MixtureStep, "recalibrated"): times.wrap(mixture_step.MixtureStep.recalibrated, "calibration"),
        (mixture_step, "update_bins"): times.wrap(mixture_step.update_bins, "calibration"),
    }
    averaged = LoKO.averaged

    @contextlib.contextmanager
    def averaged_timed(self: LoKO) -> Iterator[None]:
        start, joint = time.perf_counter(), times.so_far("joint forward")
        with averaged(self):
            yield
        times.add("averaged forward", time.perf_counter() - start - (times.so_far("joint forward") - joint))

    patched[(LoKO, "averaged")] = averaged_timed
    originals = {key: key[0].__dict__[key[1]] for key in patched}
    try:
        for (owner, name), function in patched.items():
            setattr(owner, name, function)
        yield
    finally:
        for (owner, name), function in originals.items():
            setattr(owner, name, function)


def parts(step: dict[str, float]) -> dict[str, float]:
    """The printed parts of one step: the filter without the Jacobian, the rest without every part."""
    out = {key: value for key, value in step.items() if key != "LoKO.step"}
    if "LoKO.step" in step:
        out["filter"] = step["LoKO.step"] - step.get("Jacobian", 0.0)
    out["rest"] = step.get("step", 0.0) - sum(value for key, value in out.items() if key not in ("step", "rest"))
    return out


def main(argv: list[str] | None = None) -> tuple[list[tuple[str, str, float, float, float]], dict[str, list]]:
    """Run each learner and print its parts' medians and means (milliseconds) and shares of its step.

    Returns:
        The printed rows, and each learner's steps' parts (seconds) after the warm-up (a learner named twice in
        ``--learners`` is ``"<name> 1"``, ``"<name> 2"``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, nargs="+", required=True)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learners", nargs="+", choices=sorted(LEARNERS), default=["default", "paper"])
    parser.add_argument("--lockstep", type=int, default=0, metavar="N", help="the learners at once, N steps a turn")
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.samples <= args.warmup:
        parser.error(f"--samples ({args.samples}) must exceed --warmup ({args.warmup})")
    if args.lockstep < 0 or (args.lockstep and len(args.learners) < 2):
        parser.error("--lockstep N needs N > 0 and two learners or more (e.g. --learners paper default)")
    common.set_threads(args.threads)
    names = [
        learner if args.learners.count(learner) == 1 else f"{learner} {args.learners[: i + 1].count(learner)}"
        for i, learner in enumerate(args.learners)
    ]
    active = Active()
    times = {name: PartTimes(active) for name in names}
    runs = {
        name: [*common.config_args(args.config), f"--seed_everything={args.seed}", f"--data.seed={args.seed}",
               f"--data.max_samples={args.samples}", *overrides, *LEARNERS[learner]]
        for name, learner in zip(names, args.learners, strict=True)
    }  # fmt: skip
    with timed(active), common.quiet(True):
        if args.lockstep:
            lockstep_fit(list(runs.values()), list(times.values()), args.lockstep)
        else:
            for name in names:
                common.fit(runs[name], callbacks=[times[name]])
    rows, timed_steps = [], {}
    for name in names:
        steps = timed_steps[name] = [parts(step) for step in times[name].steps[args.warmup :]]
        whole = statistics.median(step["step"] for step in steps)
        for part in PARTS:
            values = [step[part] for step in steps if part in step]
            if values:
                median, mean = statistics.median(values), statistics.fmean(values)
                rows.append((name, part, median * 1e3, mean * 1e3, median / whole))
    mode = f"in lockstep, {args.lockstep} step(s) a turn" if args.lockstep else "one after the other"
    print(f"{len(steps)} steps after {args.warmup} warm-up steps, {args.threads} thread(s), the learners {mode}")
    print("| learner | part | median (ms) | mean (ms) | median / the step's |")
    print("|---|---|---|---|---|")
    for learner, part, median, mean, share in rows:
        print(f"| {learner} | {part} | {median:.1f} | {mean:.1f} | {share:.2f} |")
    if args.lockstep:
        print(f"\nEach learner's step over {names[0]}'s at the same step (paired): median [quartiles]; their medians'")
        first = [step["step"] for step in timed_steps[names[0]]]
        for name in names[1:]:
            ratios = [step["step"] / base for step, base in zip(timed_steps[name], first, strict=True)]
            low, mid, high = statistics.quantiles(ratios, n=4)
            medians = statistics.median(step["step"] for step in timed_steps[name]) / statistics.median(first)
            print(f"- {name}: {mid:.3f} [{low:.3f}, {high:.3f}]; {medians:.3f}")
    return rows, timed_steps


if __name__ == "__main__":
    main()
