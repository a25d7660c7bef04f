"""How the ``loko`` command reads jsonargparse's parse errors: from the exceptions' chain, plus a few pinned patterns.

The messages users see are checked end to end by the bad-input catalogue of ``test_reliability.py``; here each pattern
of :data:`~loko_lightning.cli.errors.JSONARGPARSE_WORDING` meets the real error of the installed jsonargparse, so a
change of its wording fails here, naming the pattern, instead of quietly turning an error line into a worse one.
"""

from argparse import ArgumentError
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from loko_lightning.cli.errors import JSONARGPARSE_WORDING, ParseError, lost_process_error, read_parse_error
from loko_lightning.data import StreamDataModule
from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.models import TimmClassifier

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
    "unknown class at a key that takes one": (
        ["--data.source", "Nope"],
        {"keys": ("data.source",), "class_path": None, "unknown": (), "unknown_class": "Nope"},
        {"key", "import_path"},
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


class _FakeTrainer:
    """What lost_process_error reads of a trainer."""

    def __init__(self, world_size, rank, dirpath=None):
        self.world_size, self.global_rank, self.global_step = world_size, rank, 41
        self.checkpoint_callbacks = [type("Checkpoint", (), {"dirpath": dirpath})()]


def test_a_collective_error_becomes_the_lost_process_line_and_anything_else_stays_itself(tmp_path):
    gloo = RuntimeError("[/x/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer. Check")
    (tmp_path / "epoch=0-step=40.ckpt").write_bytes(b"")
    two = lost_process_error(gloo, _FakeTrainer(2, 1, str(tmp_path)))
    assert str(two).startswith("lost rank 0 of the 2 processes at training step 42 (Read error [127.0.0.1]:1: ")
    assert str(tmp_path / "epoch=0-step=40.ckpt") in str(two) and "--ckpt_path last" in str(two)
    timed_out = RuntimeError("wrapper")
    timed_out.__cause__ = RuntimeError("Operation timed out!")
    three = lost_process_error(timed_out, _FakeTrainer(3, 0))
    assert "lost another process of the 3 processes" in str(three) and "No checkpoint was written yet" in str(three)
    assert lost_process_error(gloo, _FakeTrainer(1, 0)) is None  # one process: not a lost peer
    assert lost_process_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), _FakeTrainer(2, 0)) is None


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "60", True])
def test_a_bad_collective_timeout_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match="collective_timeout") as err:
        OnlineClassifier(TimmClassifier("test_resnet", 4, pretrained=False), collective_timeout=value)
    assert err.value.field == "collective_timeout"
