"""The configs shipped in the package, by name: ``--config quickstart`` reads the packaged ``quickstart.yaml``.

A ``--config`` value that is an existing file, or a config given inline, is left as it is.
"""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path

# The configs that ship in the package: `--config NAME` (or NAME.yaml, presets/NAME) resolves to these.
PACKAGED_CONFIGS = files("loko_lightning") / "configs"
# The presets that became keys (four presets remain: loko_paper, loko_images, loko_text, loko_mixture_lda): what each
# set, as flags; docs/filters.md says what each was measured to do.
RETIRED_PRESETS = {
    "presets/loko_average_head_shared": "it is presets/loko_images now (the image default)",
    "presets/loko_auto_text": "it is presets/loko_text now (the text default)",
    "presets/loko_topk": "--model.optimizer.init_args.observation topk5",
    "presets/loko_natural": "--model.optimizer.init_args.filter natural --model.optimizer.init_args.p0 0.03",
    "presets/loko_lofi": "--model.optimizer.init_args.filter lofi10 --model.optimizer.init_args.p0 0.03",
    "presets/loko_average": "--model.optimizer.init_args.average 0.99",
    "presets/loko_average_head": "--model.optimizer.init_args.average 0.99 --model.step_scales '{head: 0.1}'",
    "presets/loko_average_shared": "--model.optimizer.init_args.average 0.99 --model.head_covariance shared",
    "presets/loko_natural_average": (
        "--model.optimizer.init_args.filter natural --model.optimizer.init_args.p0 0.03 "
        "--model.optimizer.init_args.average 0.99"
    ),
    "presets/loko_auto_text_many": (
        "--model.head_covariance shared --model.step_scales '{lora_A: 0.1, lora_B: 0.1}' --model.optimizer.p0 auto "
        "--model.select '{name: p0, values: [1, 3, 10, 30, 100], samples: 500}' (measured to lose on a held-out "
        "36-topic stream: docs/filters.md)"
    ),
}


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
        retired = RETIRED_PRESETS.get("presets/" + name.rpartition("presets/")[2] if "presets/" in name else name)
        if not candidate.is_file() and retired is not None:
            instead = retired if retired.startswith("it is") else f"its settings as flags: {retired}"
            raise ValueError(
                f"--config {value}: that preset was retired (four remain: presets/loko_paper, presets/loko_images, "
                f"presets/loko_text, presets/loko_mixture_lda); {instead}"
            )
        if not candidate.is_file():
            close = difflib.get_close_matches(name, packaged_configs(), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(
                f"--config: no file {value!r} and no config of that name in the package; {hint}packaged configs: "
                f"{', '.join(packaged_configs())}"
            )
        resolved[position] = str(candidate) if arg == "--config" else f"--config={candidate}"
    return resolved
