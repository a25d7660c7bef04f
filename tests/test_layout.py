"""The package's shape: imports point one way, the optimizer never needs Lightning, files and classes stay small."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "loko_lightning"
# Plain PyTorch: usable in any training loop, so none of it may import Lightning or the layers above it.
CORE = {
    "errors",
    "blocks",
    "reference",
    "functional",
    "_update_blocks",
    "optim",
    "jacobian",
    "_jacobian_pass",
    "_backward",
}
# What each layer must not import (loko_lightning submodules by their first name, or third-party packages).
FORBIDDEN = {
    "core": {"lightning", "module", "callbacks", "cli", "data", "networks", "adapters", "weights", "metrics"},
    "data": {"module", "callbacks", "cli", "optim", "functional", "jacobian", "networks"},
    "networks": {"module", "callbacks", "cli", "data", "lightning"},
    "module": {"cli", "data"},
    "callbacks": {"cli", "data"},
}
MAX_FILE_LINES, MAX_CLASS_LINES = 450, 200
# A unit over the limit must say why in its docstring, after this phrase.
WHY_LONG = "Why this is long:"


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def layer(path):
    name = path.relative_to(PACKAGE).with_suffix("").parts[0]
    return "core" if name in CORE else name


def imported(path):
    """First names of the loko_lightning submodules and the third-party packages ``path`` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: within data/
            modules = []
        else:
            continue
        for module in modules:
            parts = module.split(".")
            names.add(parts[1] if parts[0] == "loko_lightning" and len(parts) > 1 else parts[0])
    return names


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path):
    forbidden = FORBIDDEN.get(layer(path), set()) & imported(path)
    assert not forbidden, f"{path.name} ({layer(path)}) imports {sorted(forbidden)}"


def test_the_torch_api_imports_no_lightning():
    code = (
        "import sys\n"
        "import loko_lightning, loko_lightning.reference, loko_lightning.functional, loko_lightning.jacobian\n"
        "from loko_lightning import LoKO, jacobian\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')], 'lightning'\n"
        "assert 'loko_lightning.module' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_and_classes_are_small_or_say_why(path):
    text = path.read_text()
    tree = ast.parse(text)
    if len(text.splitlines()) > MAX_FILE_LINES:
        assert WHY_LONG in (ast.get_docstring(tree) or ""), f"{path.name}: {len(text.splitlines())} lines"
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
            assert WHY_LONG in (ast.get_docstring(node) or ""), f"{path.name}: class {node.name} is too long"
