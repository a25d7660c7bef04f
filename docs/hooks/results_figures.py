"""MkDocs hook: the figures under the repository's ``results/`` folder, published beside the results pages.

A figure ``results/<study>/<file>.png`` is at ``results/<study>/<file>.png`` in the site too, so a page in
``docs/results/`` shows it with the path relative to ``results/``: ``![...](<study>/<file>.png)``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every ``results/**/*.png`` of the repository to the site's files."""
    root = Path(config.config_file_path).resolve().parent
    for figure in sorted((root / "results").rglob("*.png")):
        files.append(
            File(
                figure.relative_to(root).as_posix(),
                src_dir=str(root),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
