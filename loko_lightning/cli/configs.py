"""The configs shipped in the package, by name: ``--config quickstart`` reads the packaged ``quickstart.yaml``.

A ``--config`` value that is an existing file, or a config given inline, is left as it is.
"""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path

# The configs that ship in the package: `--config NAME` (or NAME.yaml, presets/NAME) resolves to these.
PACKAGED_CONFIGS = files("loko_lightning") / "configs"


def packaged_configs() -> list[str]:
    """The names ``--config`` takes for the configs shipped in the package (``quickstart``, ``presets/loko_topk``)."""
    root = Path(str(PACKAGED_CONFIGS))
    return sorted(str(path.relative_to(root).with_suffix("")) for path in root.rglob("*.yaml"))


def resolve_config_names(args: list[str]) -> list[str]:
    """``--config NAME`` as the path of the packaged config of that name, where ``NAME`` is not an existing file.

    Raises:
        ValueError: ``--config`` names neither a file nor a packaged config (the message lists the packaged ones).
    """
    resolved = list(args)
    for index, arg in enumerate(resolved):
        if arg == "--config" and index + 1 < len(resolved):
            position, value = index + 1, resolved[index + 1]
        elif arg.startswith("--config="):
            position, value = index, arg.partition("=")[2]
        else:
            continue
        if Path(value).expanduser().exists() or value.lstrip().startswith(("{", "[")) or "\n" in value:
            continue  # a file, or a config given inline
        name = value.removesuffix(".yaml")
        candidate = Path(str(PACKAGED_CONFIGS)) / f"{name}.yaml"
        if not candidate.is_file():
            close = difflib.get_close_matches(name, packaged_configs(), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(
                f"--config: no file {value!r} and no config of that name in the package; {hint}packaged configs: "
                f"{', '.join(packaged_configs())}"
            )
        resolved[position] = str(candidate) if arg == "--config" else f"--config={candidate}"
    return resolved
