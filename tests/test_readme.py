"""The Python blocks of the README and of the docs run as shown, offline (each in a fresh interpreter, in an empty
folder)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    """The ```` ```python ```` blocks of a Markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


BLOCKS = [
    (page.relative_to(ROOT).as_posix(), index, block)
    for page in PAGES
    for index, block in enumerate(python_blocks(page))
]


def test_the_readme_has_python_blocks():
    assert len(python_blocks(README)) >= 2  # the plain PyTorch loop and the Lightning project


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index", "block"), BLOCKS, ids=[f"{page}:{index}" for page, index, _ in BLOCKS])
def test_python_block_runs_offline(page, index, block, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{page} block {index} failed:\n{block}\n{result.stderr[-3000:]}"
