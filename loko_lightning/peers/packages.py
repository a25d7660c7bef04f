"""The peers' packages: imported on first use, their absence one error naming the extra to install."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

#: The extra that installs every peer's package (pyproject.toml pins the versions the peers are tested with).
EXTRA = "peers"


class MissingPeer(ImportError):
    """A peer's package is not installed: the message names it and the install line."""


def require(module: str, package: str, peer: str) -> ModuleType:
    """Import ``module`` of the PyPI ``package`` that ``peer`` comes from.

    Raises:
        MissingPeer: the package is not installed (one line: the peer, the package, the install command).
    """
    try:
        with warnings.catch_warnings():
            # posteriors' state classes warn, on import, of a change in a later tensordict: nothing a user can act on.
            warnings.filterwarnings("ignore", message=r"The Tensor default of the field", category=FutureWarning)
            return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.split(".")[0]:
            raise
        raise MissingPeer(
            f'{peer} needs the package {package}, which is not installed: pip install "loko-lightning[{EXTRA}]" '
            f"(or pip install {package})"
        ) from None
