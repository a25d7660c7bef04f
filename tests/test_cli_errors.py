"""How the ``loko`` command reads jsonargparse's parse errors: from the exceptions' chain, plus a few pinned patterns.

The messages users see are checked end to end by the bad-input catalogue of ``test_reliability.py``; here each
pattern of :data:`~loko_lightning.cli.JSONARGPARSE_WORDING` meets the real error of the installed jsonargparse, so
a change of its wording fails here, naming the pattern, instead of quietly turning an error line into a worse one.
"""

from argparse import ArgumentError
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from loko_lightning.cli import JSONARGPARSE_WORDING, ParseError, read_parse_error
from loko_lightning.data import StreamDataModule
from loko_lightning.learner.module import OnlineClassifier

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
# Lightning's CLI notes that pytest's own command line is there too; it is not parsed.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def _bad_key_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("model:\n  windoww: 3\n")
    return ["--config", str(tmp_path / "bad.yaml")]


# (extra arguments, what the error must read as, the patterns that reading relies on)
CASES = {
    "unknown option of a class": (
        ["--model.optimizer.p00", "0.1"],
        {"keys": ("model.optimizer",), "class_path": "loko_lightning.LoKO", "unknown": ("p00",)},
        {"key", "class_path", "option"},
    ),
    "unknown option of a class (class_path 'x')": (
        ["--model.network.rr", "3"],
        {"keys": ("model.network",), "class_path": "loko_lightning.models.TimmClassifier", "unknown": ("rr",)},
        {"key", "class_path", "option"},
    ),
    "ill-typed argument of a class (a union)": (
        ["--model.optimizer.p0", "big"],
        {"keys": ("model.optimizer", "p0"), "class_path": "loko_lightning.LoKO", "unknown": (), "value": "big"},
        {"key", "class_path", "value"},
    ),
    "ill-typed argument of an optional class": (
        ["--model.select.samples", "big"],
        {"keys": ("model.select", "samples"), "class_path": "loko_lightning.learner.Candidates", "value": "big"},
        {"key", "class_path", "value"},
    ),
    "ill-typed argument of the model": (
        ["--model.window", "big"],
        {"keys": ("model.window",), "class_path": None, "unknown": (), "value": "big"},
        {"key", "value"},
    ),
    "unrecognized command-line arguments": (
        ["--model.netwrk.r", "3", "--foo=2"],
        {"keys": (), "unknown": ("model.netwrk.r", "foo")},
        {"unrecognized"},
    ),
    "unknown key in a config file": (
        _bad_key_file,
        {"keys": (), "unknown": ("model.windoww",)},
        {"option"},
    ),
}


def raw_parse_error(args):
    """The error of Lightning's own CLI (not the ``loko`` command, which rewrites it) for ``args``."""
    with pytest.raises(ArgumentError) as info:
        LightningCLI(
            OnlineClassifier,
            StreamDataModule,
            args=args,
            parser_kwargs={"exit_on_error": False},
            auto_configure_optimizers=False,
        )
    return info.value


def test_every_pattern_is_pinned_by_a_case():
    assert set().union(*(patterns for _, _, patterns in CASES.values())) == set(JSONARGPARSE_WORDING)


@pytest.mark.parametrize("case", list(CASES))
def test_jsonargparse_errors_read_as_before(case, tmp_path):
    extra, expected, patterns = CASES[case]
    extra = extra(tmp_path) if callable(extra) else extra
    error = raw_parse_error(["fit", "--config", DEBUG, *extra])
    read = read_parse_error(error)
    assert isinstance(read, ParseError)
    got = {field: getattr(read, field) for field in expected}
    assert got == expected, f"jsonargparse's wording changed? patterns {sorted(patterns)}: {read.message}"
