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
- ``rest``: the step less those parts (the mixture's experts and weights, the loop's bookkeeping in the step).

It prints the median of each over the steps after ``--warmup`` (a part's median and the medians of the step do not
add up exactly: each is a median of its own), with the mean too (the refreshes of LDA's eigenbasis show there). Ratios
between parts measured in one process are what to read; absolute times depend on the CPU and on what else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl

from loko_lightning.jacobians.engine import JacobianEngine
from loko_lightning.kalman.optimizer import LoKO
from loko_lightning.learner.frozen_features import FrozenFeatures

LEARNERS = {"default": ["--loko=default"], "paper": ["--loko=as_configured"]}
PARTS = ("step", "averaged forward", "Jacobian", "filter", "frozen forward", "joint forward", "LDA", "rest")


class PartTimes(pl.Callback):
    """Each step's time in each part (seconds), filled by the timed methods of :func:`timed`."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None

    def add(self, part: str, seconds: float) -> None:
        """Add ``seconds`` to ``part`` of the step running now (nothing outside a training step)."""
        if self.current is not None:
            self.current[part] = self.current.get(part, 0.0) + seconds

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        """A new step: its parts from zero; the learner's whole step timed around its online step."""
        self.current = {}
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

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - start)

        return timed


@contextlib.contextmanager
def timed(times: PartTimes) -> Iterator[None]:
    """Time the parts' methods (class attributes, patched for the block and restored after it)."""
    patched = {
        (JacobianEngine, "observe"): times.wrap(JacobianEngine.observe, "Jacobian"),
        (LoKO, "step"): times.wrap(LoKO.step, "LoKO.step"),
        (FrozenFeatures, "__call__"): times.wrap(FrozenFeatures.__call__, "frozen forward"),
        (FrozenFeatures, "with_adapted"): times.wrap(FrozenFeatures.with_adapted, "joint forward"),
    }
    averaged = LoKO.averaged

    @contextlib.contextmanager
    def averaged_timed(self: LoKO) -> Iterator[None]:
        current = times.current if times.current is not None else {}
        start, joint = time.perf_counter(), current.get("joint forward", 0.0)
        with averaged(self):
            yield
        times.add("averaged forward", time.perf_counter() - start - (current.get("joint forward", 0.0) - joint))

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
        The printed rows, and each learner's steps' parts (seconds) after the warm-up.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, nargs="+", required=True)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learners", nargs="+", choices=sorted(LEARNERS), default=["default", "paper"])
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.samples <= args.warmup:
        parser.error(f"--samples ({args.samples}) must exceed --warmup ({args.warmup})")
    common.set_threads(args.threads)
    rows, timed_steps = [], {}
    for learner in args.learners:
        times = PartTimes()
        run = [*common.config_args(args.config), f"--seed_everything={args.seed}", f"--data.seed={args.seed}"]
        run += [f"--data.max_samples={args.samples}", *overrides, *LEARNERS[learner]]
        with timed(times), common.quiet(True):
            common.fit(run, callbacks=[times])
        steps = timed_steps[learner] = [parts(step) for step in times.steps[args.warmup :]]
        whole = statistics.median(step["step"] for step in steps)
        for part in PARTS:
            values = [step[part] for step in steps if part in step]
            if values:
                median, mean = statistics.median(values), statistics.fmean(values)
                rows.append((learner, part, median * 1e3, mean * 1e3, median / whole))
    print(f"{len(steps)} steps after {args.warmup} warm-up steps, {args.threads} thread(s)")
    print("| learner | part | median (ms) | mean (ms) | median / the step's |")
    print("|---|---|---|---|---|")
    for learner, part, median, mean, share in rows:
        print(f"| {learner} | {part} | {median:.1f} | {mean:.1f} | {share:.2f} |")
    return rows, timed_steps


if __name__ == "__main__":
    main()
