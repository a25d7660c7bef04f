r"""The one results table: each visible stream x {the default, the paper's LoKO, the best frozen head, the best peer}.

Usage:
    python benchmarks/results_table.py [--results results] [--out table.md]

Runs nothing. Every cell is read from a run that ``benchmarks/compare.py`` recorded under ``results/`` and that git
keeps: a run folder's ``summary.json``, or, once a study's run folders are folded, the entry for that folder in the
study's ``results/<study>/runs.json`` (the same ``summary.json``, keyed by the folder's path). A cell no such file
holds prints ``not recorded``. The table reads:

- *after 500 / 1,000 / 2,000* and *end*: the average online top-1 accuracy (%) at the end of a run whose stream ended
  there (the end of a shorter run of the same setting and seeds is the same prefix of the stream; only learners
  without a horizon, whose first N predictions do not depend on the stream's length, are read that way), mean ±
  sample std over the seeds (``compare.py``'s ``_mean_std``); the 500 / 1,000 / 2,000-sample points of a longer run
  were logged in its ``metrics.csv``, which git does not keep, so they are not read (the study pages quote them);
- *recent at end*: the accuracy of the last predictions (the learner's recent window), and *after N* of a longer
  run: recorded in ``summary.json`` by today's ``compare.py`` (``final_recent_acc``, ``online_acc_at``), in
  ``metrics.csv`` only by earlier runs (not recorded here);
- *NLL*, *ECE*: the prequential negative log-likelihood and expected calibration error (15 bins) at the end of the
  longest run read, mean over seeds (``@500`` when that run ended at 500 samples);
- *step / AdamW*: ``step_time_ratio_vs_adamw`` of a run made in one process with an AdamW run (the range over runs
  when several); a run made alone records none.

"The best frozen head" and "the best fine-tuning peer" are the candidates of the stream with the highest mean
accuracy at the end (or, without an end, at the latest checkpoint read).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (benchmarks/ on sys.path, as the scripts import each other)

NOT_RECORDED = "not recorded"
CHECKPOINTS = (500, 1000, 2000)
Runs = tuple[tuple[str, str], ...]  # (run folder under results/, compare.py's optimizer key)


def seeds(folder: str, count: int, optimizer: str) -> Runs:
    """``folder`` with ``_s0``, ``_s1``, ... appended: one run folder per seed."""
    return tuple((f"{folder}_s{seed}", optimizer) for seed in range(count))


@dataclass
class Entry:
    """One learner on one stream: the runs each column is read from."""

    name: str
    end: Runs = ()
    at: dict[int, Runs] = field(default_factory=dict)
    cost: Runs = ()  # runs whose step_time_ratio_vs_adamw is read, when not the end runs
    note: str = ""


@dataclass
class Stream:
    """A visible stream: its length and, per row, the learners read."""

    name: str
    samples: int
    default: Entry | None  # None: the default falls back to the paper's filter on this stream
    default_note: str
    paper: Entry
    frozen: list[Entry]
    peers: list[Entry]
    also: list[Entry] = field(default_factory=list)  # printed after the default (e.g. its filter alone)


FM32, FM64, MN = "shared_rows/epyc/fm32", "shared_rows/epyc/fm64", "shared_rows/epyc/mnist5k"
IMAGE_DEFAULT_COST: Runs = (("shared_rows/epyc/step_time/lite0_shared", "loko_avg"),)
IMAGE_DEFAULT = (
    "the image default (`presets/loko_images` + `presets/loko_mixture_lda`, `pools: [0.5, 1]`, `nearest_mean: true`)"
)
IMAGE_FILTER = "the image default's filter alone (`presets/loko_images`; then `loko_average_head_shared`)"
# The default's and the paper's LoKO's steps against an AdamW's, in one process (Fashion-MNIST at 32 px, 300 samples,
# 3 seeds pooled), with the depthwise convolutions of the 1 x 1 maps as their centre tap (the Intel Xeon).
STEP_TIME_32PX = "default_study/step_time_centre_tap"
IMAGE_DEFAULT_STEP: Runs = ((STEP_TIME_32PX, "loko_default"),)


def image_default(runs: Runs, cost: Runs = IMAGE_DEFAULT_STEP) -> Entry:
    """The image default: its runs to the end of the stream, read at their end and at their recorded points.

    Its step cost from ``cost`` (by default the 32 px measurement).
    """
    return Entry(IMAGE_DEFAULT, runs, at=points(runs, *CHECKPOINTS), cost=cost)


def filter_alone(folder: str, at500: str) -> Entry:
    """The image default's filter alone: its long runs (``folder_s0..2``), at 500 the default study's, its step."""
    return Entry(IMAGE_FILTER, seeds(folder, 3, "loko"), at={500: ((at500, "loko_default"),)}, cost=IMAGE_DEFAULT_COST)


def points(runs: Runs, *checkpoints: int) -> dict[int, Runs]:
    """The same longer runs read at each checkpoint (their recorded points)."""
    return {n: runs for n in checkpoints}


def longer_frozen(folder: str, optimizer: str, at500: Runs) -> dict[int, Runs]:
    """A frozen head: at 500 its 500-sample runs, at 1,000 and 2,000 the points of its 2,000-sample runs."""
    return {500: at500, **points(((folder, optimizer),), 1000, 2000)}


def lr_free(folder: str) -> list[Entry]:
    """The learning-rate-free peers' 2,000-sample runs (package defaults), read at 500, 1,000 and 2,000."""
    names = {"prodigy": "Prodigy", "dadaptation": "D-Adaptation Adam", "dog": "DoG", "mechanic": "Mechanic AdamW"}
    return [Entry(name, at=points(((folder, key),), 500, 1000, 2000)) for key, name in names.items()]


GLYPHS = tuple(f"default_study/glyphs100_2000_s{seed}" for seed in range(3))
TEXT_DEFAULT = "the text default (`presets/loko_text` + `presets/loko_mixture_lda`)"
TEXT_FILTER = "the text default's filter alone (`presets/loko_text`)"
# The text default's step against an AdamW's, in one process (300 samples, 3 seeds pooled, the Intel Xeon).
TEXT_STEP_BBC: Runs = (("default_study/step_time_text_bbc", "loko_default"),)
TEXT_STEP_WORDNET: Runs = (("default_study/step_time_text_wordnet", "loko_default"),)


def fm64_500(optimizer: str) -> Runs:
    """The default study's 500-sample runs on Fashion-MNIST at 64 px (seeds 0 and 1 in one folder, 2 in another)."""
    return (("default_study/fm64_500_s01", optimizer), ("default_study/fm64_500_s2", optimizer))


DEFAULT_NOTE_IMAGE = "image backbone, 10 classes: `presets/loko_images`"

STREAMS = (
    Stream(
        "Fashion-MNIST 32 px",
        5000,
        image_default(seeds("default_study/fm32_cal", 3, "loko_default")),
        DEFAULT_NOTE_IMAGE,
        Entry(
            "the paper's LoKO",
            seeds(f"{FM32}/paper", 3, "loko"),
            at={500: (("mixture/fashion_500_3seeds", "loko"),), 2000: (("peers/fm32_2000/fm32/paper_s0", "loko"),)},
            cost=((STEP_TIME_32PX, "loko"),),
        ),
        [
            Entry(
                "streaming LDA, frozen",
                at=longer_frozen(
                    "default_study/fm32_2000_frozen",
                    "streaming_lda",
                    (("mixture/fashion_500_3seeds", "streaming_lda"),),
                ),
            ),
            Entry(
                "nearest class mean, frozen",
                at=points((("default_study/fm32_2000_frozen", "ncm"),), 500, 1000, 2000),
            ),
        ],
        [
            Entry(
                "AdamW, lr chosen online",
                (("late_stream/fmnist32/auto", "adamw_tuned"), ("late_stream/fmnist32/auto_seeds12", "adamw_tuned")),
            ),
            Entry(
                "schedule-free AdamW",
                seeds("peers/images/fm32/schedulefree", 3, "schedulefree"),
                at={
                    500: (("default_study/fm32_500", "schedulefree"),),
                    2000: seeds("peers/fm32_2000/fm32/schedulefree", 2, "schedulefree"),
                },
            ),
            Entry("AdamW, lr chosen online, constant", seeds("peers/images/fm32/adamw_const", 3, "adamw_const")),
            Entry("posteriors EKF", seeds("peers/images/fm32/posteriors", 3, "posteriors")),
            Entry("IVON", seeds("peers/images/fm32/ivon", 3, "ivon")),
            *lr_free("default_study/lrfree_fm32_2000"),
        ],
        also=[filter_alone(f"{FM32}/shared_avg_h0.1", "default_study/fm32_500")],
    ),
    Stream(
        "Fashion-MNIST 64 px",
        5000,
        # its step not measured at 64 px
        image_default(seeds("default_study/fm64_cal", 3, "loko_default"), cost=()),
        DEFAULT_NOTE_IMAGE,
        Entry(
            "the paper's LoKO",
            (
                ("late_stream/fmnist64/paper", "loko"),
                ("late_stream/fmnist64/paper_s1", "loko"),
                ("late_stream/fmnist64/paper_s2", "loko"),
            ),
        ),
        [Entry("streaming LDA, frozen", at={500: fm64_500("streaming_lda")})],
        [
            # Rerun with the NLL and ECE recorded (late_stream/fmnist64/auto_s*, before them: the same end, 81.4 ± 0.9).
            Entry(
                "AdamW, lr chosen online",
                seeds("default_study/fm64_adamw_tuned", 3, "adamw_tuned"),
                at=points(seeds("default_study/fm64_adamw_tuned", 3, "adamw_tuned"), *CHECKPOINTS),
            ),
            Entry(
                "AdamW, paper's lr",
                (
                    ("late_stream/fmnist64/paper", "adamw"),
                    ("late_stream/fmnist64/paper_s1", "adamw"),
                    ("late_stream/fmnist64/paper_s2", "adamw"),
                ),
            ),
        ],
        also=[Entry(IMAGE_FILTER, seeds(f"{FM64}/shared_avg_h0.1", 3, "loko"))],
    ),
    Stream(
        "MNIST-5k",
        4500,
        image_default(seeds("default_study/mnist5k_cal", 3, "loko_default")),
        DEFAULT_NOTE_IMAGE,
        Entry("the paper's LoKO", (("late_stream/mnist5k/paper", "loko"),)),
        [
            Entry(
                "streaming LDA, frozen",
                at=longer_frozen(
                    "default_study/mnist5k_2000_frozen",
                    "streaming_lda",
                    (("default_study/mnist5k_500_frozen", "streaming_lda"),),
                ),
            ),
            Entry(
                "nearest class mean, frozen",
                at=longer_frozen(
                    "default_study/mnist5k_2000_frozen", "ncm", (("default_study/mnist5k_500_frozen", "ncm"),)
                ),
            ),
        ],
        [
            Entry(
                "AdamW, lr chosen online",
                (("late_stream/mnist5k/auto", "adamw_tuned"), ("late_stream/mnist5k/auto_seeds12", "adamw_tuned")),
            ),
            Entry(
                "schedule-free AdamW",
                seeds("peers/images/mnist5k/schedulefree", 3, "schedulefree"),
                at={500: (("default_study/mnist5k_500", "schedulefree"),)},
            ),
            Entry("AdamW, lr chosen online, constant", seeds("peers/images/mnist5k/adamw_const", 3, "adamw_const")),
            Entry("posteriors EKF", seeds("peers/images/mnist5k/posteriors", 3, "posteriors")),
            Entry("IVON", seeds("peers/images/mnist5k/ivon", 3, "ivon")),
            *lr_free("default_study/lrfree_mnist5k_2000"),
        ],
        also=[filter_alone(f"{MN}/shared_avg_h0.1", "default_study/mnist5k_500")],
    ),
    Stream(
        "glyphs100",
        5000,
        Entry(
            "the many-class image default (`filter: natural`, `p0` 0.03, `average: 0.99` + `presets/loko_mixture_lda`, "
            "`pools: [0.5, 1]`, `nearest_mean: true`, `nearest_vote: true`)",
            seeds("default_study/glyphs100_cal", 3, "loko_default"),
            at=points(seeds("default_study/glyphs100_cal", 3, "loko_default"), *CHECKPOINTS),
            cost=(("default_study/step_time_glyphs100_factored", "loko_default"),),
        ),
        "image backbone, 100 classes: the natural filter with the averaged mean and the mixture",
        Entry("the paper's LoKO", seeds("filters/study5000/gl_paper", 3, "loko")),
        [
            Entry("streaming LDA, frozen", at=points(tuple((f, "streaming_lda") for f in GLYPHS), 500, 1000, 2000)),
            Entry("nearest class mean, frozen", at=points(tuple((f, "ncm") for f in GLYPHS), 500, 1000, 2000)),
        ],
        [
            Entry(
                "AdamW, lr chosen online",
                seeds("default_study/glyphs100_adamw_tuned", 3, "adamw_tuned"),
                at=points(seeds("default_study/glyphs100_adamw_tuned", 3, "adamw_tuned"), *CHECKPOINTS),
            ),
            Entry("AdamW, lr chosen online, constant", seeds("peers/images/glyphs100/adamw_const", 3, "adamw_const")),
            Entry("schedule-free AdamW", seeds("peers/images/glyphs100/schedulefree", 3, "schedulefree")),
            Entry("posteriors EKF", seeds("peers/images/glyphs100/posteriors", 3, "posteriors")),
            Entry("IVON", seeds("peers/images/glyphs100/ivon", 3, "ivon")),
        ],
        also=[
            Entry(
                "the many-class image default's filter alone (the three flags)",
                seeds("late_stream_avg/xeon/glyphs100/natural_avg", 3, "loko"),
                at=points(tuple((folder, "loko_default") for folder in GLYPHS), 500, 1000, 2000),
            )
        ],
    ),
    Stream(
        "BBC News",
        1000,
        Entry(TEXT_DEFAULT, seeds("default_study/bbc_scale", 3, "loko_default"), cost=TEXT_STEP_BBC),
        "text backbone, 5 classes: `presets/loko_text` + `presets/loko_mixture_lda`",
        Entry(
            "the paper's LoKO (head on the pooler then)",
            seeds("peers/bbc/paper", 3, "loko"),
            cost=(("text_quickstart", "loko"),),
        ),
        [
            Entry("nearest class mean, frozen", (("default_study/bbc", "ncm"),)),
            Entry("streaming LDA, frozen", (("default_study/bbc", "streaming_lda"),)),
        ],
        [
            Entry("AdamW, lr chosen online", (("default_study/bbc", "adamw_tuned"),)),
            # Earlier runs, with the head on BERT's pooler (the table picks the best by the end):
            Entry("schedule-free AdamW (head on the pooler then)", seeds("peers/bbc/schedulefree", 3, "schedulefree")),
            Entry("AdamW, constant (head on the pooler then)", seeds("peers/bbc/adamw_const", 3, "adamw_const")),
        ],
        also=[Entry(TEXT_FILTER, seeds("default_study/bbc_filter_scale", 3, "loko"))],
    ),
    Stream(
        "WordNet",
        2000,
        Entry(TEXT_DEFAULT, seeds("default_study/wordnet_scale", 3, "loko_default"), cost=TEXT_STEP_WORDNET),
        "text backbone, 25 classes: `presets/loko_text` + `presets/loko_mixture_lda`",
        Entry(
            "the paper's LoKO (head on the pooler then)",
            (("wordnet/paper_s0", "loko"),),
            cost=(("default_study/step_time_text_wordnet", "loko"),),
        ),
        [
            Entry("streaming LDA, frozen", (("default_study/wordnet_frozen", "streaming_lda"),)),
            Entry("nearest class mean, frozen", (("default_study/wordnet_frozen", "ncm"),)),
        ],
        [
            Entry("AdamW, lr chosen online", (("default_study/wordnet_adamw", "adamw_tuned"),)),
            Entry(
                "AdamW, lr chosen online (head on the pooler then)",
                (
                    ("wordnet/adamw_tuned_s0", "adamw_tuned"),
                    ("shared_rows/epyc/wordnet/adamw_tuned_s1", "adamw_tuned"),
                    ("shared_rows/epyc/wordnet/adamw_tuned_s2", "adamw_tuned"),
                ),
            ),
            Entry("schedule-free AdamW (head on the pooler then)", (("wordnet/schedulefree_s0", "schedulefree"),)),
            Entry("IVON (head on the pooler then)", (("shared_rows/epyc/wordnet/ivon_s0", "ivon"),)),
        ],
        also=[Entry(TEXT_FILTER, seeds("default_study/wordnet_filter_scale", 3, "loko"))],
    ),
    Stream(
        "drifting Fashion-MNIST",
        4000,
        Entry(IMAGE_DEFAULT, seeds("default_study/drift_cal", 3, "loko_default")),
        DEFAULT_NOTE_IMAGE,
        Entry("the paper's LoKO", (("shared_rows/epyc/drift/paper_s0", "loko"),)),
        [],
        [Entry("AdamW, lr chosen online", seeds("shared_rows/epyc/drift/adamw_tuned", 3, "adamw_tuned"))],
        also=[Entry(IMAGE_FILTER, seeds("shared_rows/epyc/drift/preset", 3, "loko"))],
    ),
)


def load_run(results: Path, folder: str) -> dict[str, Any]:
    """A run's ``summary.json``: its folder's, else its entry in the study's folded ``runs.json``."""
    path = results / folder / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    study = folder.split("/")[0]
    folded = results / study / "runs.json"
    if folded.is_file():
        runs = json.loads(folded.read_text())["runs"]
        if folder in runs:
            return runs[folder]["summary"]
    raise SystemExit(f"results_table.py: no summary for {folder} (neither {path} nor an entry in {folded})")


@dataclass
class Read:
    """The per-seed values read from a set of runs, and which files they came from."""

    acc: dict[int, float] = field(default_factory=dict)
    nll: dict[int, float] = field(default_factory=dict)
    ece: dict[int, float] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)
    samples: int = 0
    at: dict[int, dict[int, float]] = field(default_factory=dict)  # samples -> seed -> accuracy (summary.json)
    recent: dict[int, float] = field(default_factory=dict)


def read(results: Path, runs: Runs) -> Read:
    """Pool the runs' per-seed final accuracy, NLL, ECE and step-time ratio (a seed in two runs is an error)."""
    out = Read()
    for folder, optimizer in runs:
        entry = load_run(results, folder)["results"][optimizer]
        for seed, value in entry["final_online_acc"].items():
            if int(seed) in out.acc:
                raise SystemExit(f"results_table.py: seed {seed} of {optimizer} twice (in {folder})")
            if str(seed) not in entry["diverged"]:
                out.acc[int(seed)] = value
        for name, into in (("final_nll", out.nll), ("final_ece", out.ece), ("final_recent_acc", out.recent)):
            into.update({int(seed): value for seed, value in entry.get(name, {}).items()})
        # Recorded since compare.py keeps them in summary.json: the accuracy at the checkpoints reached.
        for seed, points in entry.get("online_acc_at", {}).items():
            if str(seed) not in entry["diverged"]:
                for samples, value in points.items():
                    out.at.setdefault(int(samples), {})[int(seed)] = value
        ratio = entry["step_time_ratio_vs_adamw"]
        if isinstance(ratio, float) and math.isfinite(ratio) and optimizer != "adamw":
            out.ratios.append(ratio)
        out.samples = max(out.samples, *entry["steps"].values())
    return out


def accuracy(values: dict[int, float]) -> str:
    """``mean ± std`` in percent over the seeds, with the number of seeds when not 3."""
    if not values:
        return NOT_RECORDED
    mean, std = compare._mean_std([100 * v for v in values.values()])
    text = f"{mean:.1f} ± {std:.1f}" if len(values) > 1 else f"{mean:.1f}"
    return text if len(values) == 3 else f"{text} ({len(values)} seed{'s' if len(values) > 1 else ''})"


def mean(values: dict[int, float], scale: float, digits: int) -> str:
    return f"{scale * sum(values.values()) / len(values):.{digits}f}" if values else NOT_RECORDED


def at_checkpoint(runs: Read, samples: int) -> dict[int, float]:
    """The accuracy after ``samples``: the runs' end where they ended there, else their recorded checkpoint."""
    return runs.acc if runs.samples == samples else runs.at.get(samples, {})


@dataclass
class Row:
    """One printed row: the cells and the key used to rank candidates."""

    cells: list[str]
    rank: float


def row(results: Path, stream: Stream, entry: Entry) -> Row:
    """The cells of one learner on one stream, read from its runs."""
    points = {n: read(results, runs) for n, runs in entry.at.items()}
    end = read(results, entry.end) if entry.end else None
    cells = [
        accuracy(at_checkpoint(points[n], n)) if n in points else accuracy(end.at.get(n, {})) if end else NOT_RECORDED
        for n in CHECKPOINTS
    ]
    cells.append(accuracy(end.acc) if end else NOT_RECORDED)
    cells.append(accuracy(end.recent) if end else NOT_RECORDED)  # recorded in summary.json by today's compare.py
    longest = end if end else (points[max(points)] if points else None)
    if longest is None or not longest.nll:
        cells += [NOT_RECORDED, NOT_RECORDED]
    else:
        where = "" if longest is end else f" @{longest.samples:,}"
        cells += [mean(longest.nll, 1, 3) + where, mean(longest.ece, 100, 1) + where]
    if entry.cost:  # each cost run read alone: two timings of the same seeds are two measurements, not a seed twice
        ratios = [r for run in entry.cost for r in read(results, (run,)).ratios]
    else:
        ratios = end.ratios if end else []
    if not ratios:
        cells.append(NOT_RECORDED)
    elif len(ratios) == 1:
        cells.append(f"{ratios[0]:.2f}")
    else:
        cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}")
    if end and end.acc:
        rank = sum(end.acc.values()) / len(end.acc)
    elif points and at_checkpoint(points[max(points)], max(points)):
        last = at_checkpoint(points[max(points)], max(points))
        rank = sum(last.values()) / len(last) - 1  # below any learner read at the end
    else:
        rank = -math.inf
    return Row(cells, rank)


def table(results: Path) -> str:
    """The markdown table and its notes."""
    header = ["stream", "learner", "after 500", "after 1,000", "after 2,000", "end", "recent at end", "NLL", "ECE (%)"]
    header.append("step / AdamW")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for stream in STREAMS:
        stream_name = f"{stream.name} ({stream.samples:,})"
        paper = row(results, stream, stream.paper)
        if stream.default is None:
            default_name, default = f"the default = the paper's LoKO ({stream.default_note})", paper
        else:
            default_name, default = f"{stream.default.name}", row(results, stream, stream.default)
        rows = [(default_name, default)]
        rows += [(entry.name, row(results, stream, entry)) for entry in stream.also]
        rows.append((stream.paper.name, paper))
        for kind, candidates in (("best frozen head", stream.frozen), ("best fine-tuning peer", stream.peers)):
            measured = [(entry, row(results, stream, entry)) for entry in candidates]
            if not measured:
                rows.append((f"{kind}: none measured", Row([NOT_RECORDED] * 8, -math.inf)))
                continue
            entry, best = max(measured, key=lambda pair: pair[1].rank)
            rows.append((f"{kind}: {entry.name}", best))
        for name, found in rows:
            lines.append(f"| {stream_name} | {name} | " + " | ".join(found.cells) + " |")
    lines += ["", NOTES.replace("HORIZON", horizon_note(results))]
    return "\n".join(lines)


# The tuned AdamW told a longer stream than WordNet's 2,000 samples, and the text default's runs to 2,000.
HORIZON_RUN: tuple[str, str] = ("default_study/wordnet4k_adamw", "adamw_tuned")
HORIZON_DEFAULT: Runs = seeds("default_study/wordnet_scale", 3, "loko_default")


def horizon_note(results: Path) -> str:
    """The tuned AdamW's NLL after 2,000 WordNet samples when its schedule runs to 4,000, against the text default's.

    The tuned AdamW's learning rate decays to 0 at the stream's last sample, a length it is told: its NLL at the end
    of a 2,000-sample run is that of a learner that knows the stream ends there. A longer run's ``nll_at`` (recorded by
    ``compare.py``) at 2,000 is the same learner not told.
    """
    folder, optimizer = HORIZON_RUN
    told = {
        int(seed): points["2000"] for seed, points in load_run(results, folder)["results"][optimizer]["nll_at"].items()
    }
    default = read(results, HORIZON_DEFAULT).nll
    above = sum(told[seed] > default[seed] for seed in default if seed in told)
    values = list(told.values())
    return (
        "The tuned AdamW's learning rate decays linearly to 0 at the stream's last sample (the paper's schedule: it is "
        "told the stream's length; LoKO is not): on WordNet the same AdamW with its schedule over 4,000 samples had "
        f"NLL {statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} after 2,000, above the text default on "
        f"{above} of {len(default)} seeds (`results/{folder}`, `nll_at`)."
    )


NOTES = (
    "Accuracy: average online top-1 (%), each prediction made before the update on its sample, mean ± sample std "
    "over 3 seeds unless a cell says otherwise. *after N*: read where a run of that setting ended at N samples or, "
    "for the runs made since `compare.py` records them in `summary.json`, at that checkpoint of a longer run "
    "(earlier runs logged them and the recent accuracy in `metrics.csv`, which git does not keep: `not recorded`; "
    "the study pages quote them). NLL, ECE: at the end of the longest run read (`@500`: that run ended at 500 "
    "samples). *step / AdamW*: the median step time over an AdamW run's in the same process (`compare.py`); the "
    "image default's and, on Fashion-MNIST at 32 px, the paper's LoKO's from 300-sample runs on Fashion-MNIST at 32 "
    "px (`results/default_study/step_time_centre_tap`, 3 seeds pooled, one process, on the Intel Xeon; on glyphs100 "
    "`step_time_glyphs100_factored`, on the AMD EPYC), its filter "
    "alone's from a 300-sample "
    "run of the same network (`results/shared_rows/epyc/step_time/lite0_shared`, `loko_avg`: the shared head "
    "covariance and the averaged "
    "mean), the paper's LoKO's on BBC News from the text quick start's run (`results/text_quickstart`); the text "
    "default's, and on WordNet the paper's LoKO's, from 300-sample runs of today's configs "
    "(`results/default_study/step_time_text_bbc`, `step_time_text_wordnet`, 3 seeds pooled, one process, on the Intel "
    "Xeon). HORIZON Drifting "
    "Fashion-MNIST: its labels permuted every 1,000 samples. The image default is the filter of "
    "`presets/loko_images` predicting with its mixture with streaming LDA on the frozen features, with its own "
    "prediction sharpened (`presets/loko_mixture_lda`), with their pools and with nearest class mean on LDA's "
    "statistics, measured to the end of Fashion-MNIST at "
    "32 and 64 px, "
    "MNIST-5k and the drifting stream (on the Intel Xeon; the filter alone and AdamW there on the AMD EPYC); its "
    "filter alone is what the studies ran as `presets/loko_average_head_shared` (`average: 0.99`, `head_covariance: "
    "shared`, `step_scales: {head: 0.1}`), today `presets/loko_images`. The text default (`presets/loko_text`, `p0` 10 "
    "with its prior's scale set online by its predictive likelihood, its "
    "head on the sentence embedding, one covariance shared by the head's rows, its noise estimate debiased, with the "
    "same mixture, its learner also softened, and the mixture's pools of the learner and LDA) and its filter alone "
    "(`--config presets/loko_text`) were run as `loko fit` runs them today (on the Intel Xeon); the rows marked "
    "*head on the pooler then* were run when the new head read BERT's pooler. On glyphs100 (100 classes) the default "
    "is `filter: natural` with `p0` 0.03 and `average: 0.99` predicting with the same mixture, its pools and nearest "
    "class mean on LDA's statistics with its vote. The "
    "learning-rate-free peers (Prodigy, D-Adaptation, DoG, Mechanic, package defaults) are candidates for the best "
    "fine-tuning peer on Fashion-MNIST at 32 px and MNIST-5k (2,000 samples). The runs, per cell: "
    "`benchmarks/results_table.py` (STREAMS)."
)


def main(argv: list[str] | None = None) -> str:
    """Print the table (and write it with ``--out``); returns it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    text = table(args.results)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
