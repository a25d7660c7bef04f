"""The package's shape by concept: each folder is one layer, imports point one way, the filter needs only torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "loko_lightning"
# The loko_lightning layers each layer may import (itself included). Direction:
# errors <- observation <- jacobians <- kalman <- learner <- serve <- cli; models <- learner; data <- serve, cli; models
# and data share only the preprocessing they agree on (a network's factory says it, the data module follows it). The
# peers (other learners' packages as torch optimizers) import only the errors; the learner steps them by class name.
ALLOWED = {
    "peers": {"errors", "peers"},
    "__init__": {"errors", "observation", "jacobians", "kalman"},
    "errors": set(),
    "preprocessing": set(),
    "observation": {"errors"},
    "jacobians": {"errors", "observation", "jacobians"},
    "kalman": {"errors", "observation", "jacobians", "kalman"},
    "models": {"errors", "preprocessing", "models"},
    "data": {"errors", "preprocessing", "data"},
    "learner": {"errors", "observation", "jacobians", "kalman", "models", "learner"},
    "serve": {"errors", "preprocessing", "observation", "jacobians", "kalman", "models", "learner", "data", "serve"},
    "cli": {"errors", "observation", "jacobians", "kalman", "models", "learner", "data", "serve", "cli"},
}
# Plain PyTorch: usable in any training loop, so these import nothing beyond torch and the standard library.
TORCH_ONLY = {"errors", "preprocessing", "observation", "jacobians", "kalman"}


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def layer(path):
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def imports(path):
    """``(module, names)`` for every absolute import in ``path`` (``names`` empty for ``import x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def own_layers(module, names):
    """The loko_lightning layers an import reaches (``from loko_lightning import x`` reaches layer ``x``)."""
    parts = module.split(".")
    if parts[0] != "loko_lightning":
        return set()
    if len(parts) > 1:
        return {parts[1]}
    return {name for name in names if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()} or {"__init__"}


def test_every_file_belongs_to_a_known_layer():
    assert {layer(path) for path in sources()} <= set(ALLOWED)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path):
    reached = set().union(*(own_layers(module, names) for module, names in imports(path)))
    assert reached <= ALLOWED[layer(path)], f"{layer(path)} imports {sorted(reached - ALLOWED[layer(path)])}"


@pytest.mark.parametrize(
    "path", [p for p in sources() if layer(p) in TORCH_ONLY], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_the_filter_and_the_jacobians_import_only_torch(path):
    third_party = {module.split(".")[0] for module, _ in imports(path)} - set(sys.stdlib_module_names)
    assert third_party <= {"torch", "loko_lightning"}, f"{path.name} imports {sorted(third_party)}"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_crosses_a_layer(path):
    own = layer(path)
    for module, names in imports(path):
        parts = module.split(".")
        if parts[0] != "loko_lightning" or own_layers(module, names) == {own}:
            continue
        private = [p for p in parts[1:] if p.startswith("_")] + [n for n in names if n.startswith("_")]
        assert not private, f"{path.name} imports private {private} from {module}"


# The folders in which no module imports a private name from another module (each module's public names are what the
# others use); the rest of the package is held to the layer rule above.
MODULE_PRIVATE = set(ALLOWED)


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize(
    "path", [p for p in sources() if layer(p) in MODULE_PRIVATE], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_no_private_name_crosses_a_module(path):
    for module, names in imports(path):
        parts = module.split(".")
        if parts[0] != "loko_lightning" or module == module_name(path):
            continue
        private = [p for p in parts[1:] if p.startswith("_")] + [n for n in names if n.startswith("_")]
        assert not private, f"{path.name} imports private {private} from {module}"


def import_graph():
    """Each package module and the package modules it imports (a package's ``__init__`` as the package's name)."""
    modules = {module_name(path): path for path in sources()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names in imports(path):
            if module.split(".")[0] != "loko_lightning":
                continue
            # ``from package import module`` reaches the module; ``from module import name`` the module itself.
            targets |= {f"{module}.{n}" for n in names if f"{module}.{n}" in modules} or {module}
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def test_no_import_circle_in_the_package():
    """No module reaches itself through the imports of others (function-level imports included)."""
    graph = import_graph()
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for target in graph[node]:
                assert target != start, f"import circle: {' -> '.join(path)} -> {start}"
                if target not in seen:
                    seen.add(target)
                    stack.append((target, (*path, target)))


def test_the_torch_api_imports_no_lightning():
    code = (
        "import sys\n"
        "import loko_lightning, loko_lightning.kalman, loko_lightning.jacobians, loko_lightning.observation\n"
        "from loko_lightning import LoKO, jacobian\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')], 'lightning'\n"
        "assert not [m for m in sys.modules if m.startswith(('loko_lightning.learner', 'loko_lightning.models'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
