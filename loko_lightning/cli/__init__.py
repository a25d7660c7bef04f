"""The ``loko`` command: LightningCLI over :class:`OnlineClassifier` and :class:`StreamDataModule`.

``loko fit --config cifar10_resnet18`` runs one online pass (a bare name is a config shipped in the package,
``loko_lightning/configs``; a path is a file); ``validate``/``test`` evaluate on the held-out split; ``predict`` writes
class probabilities (``--predictions FILE.csv|.json``) for the held-out split or for ``--data.predict_inputs``; ``loko
export --ckpt_path CKPT --out DIR [--merge]`` writes a peft adapter or a merged model
(:mod:`loko_lightning.learner.export`); ``--print_config`` shows the full resolved configuration. ``--ckpt_path last``
continues from the newest checkpoint (written atomically, :mod:`loko_lightning.learner.checkpoint_io`), or starts from
scratch when there is none yet, so one command serves for the first start and restarts. A checkpoint holds the
network's configuration, which ``predict``/``validate``/``test`` take from it.

Exit status: 0 on success; 2 for a configuration or input error (one line ``loko: error: --<key>: <what to change>``
on stderr); 3 when the run diverged (the message names the ``p0`` to try and where the last good state is saved); 4
when a distributed run lost a process.

Library code raises :class:`~loko_lightning.errors.ConfigError` naming the argument and the class that took it; this
package alone knows where that class sits in the configuration (``model.network``, ``model.optimizer``, ``data``) and
writes the flag.

- :mod:`~loko_lightning.cli.entry`: :func:`main`, the console script's entry point: exit statuses and one-line errors.
- :mod:`~loko_lightning.cli.command`: :class:`LoKOCLI`, the LightningCLI subclass.
- :mod:`~loko_lightning.cli.errors`: what is read from jsonargparse's parse errors and from a lost process.
- :mod:`~loko_lightning.cli.configs`: the packaged configs, by name.
- :mod:`~loko_lightning.cli.export`: ``loko export``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loko_lightning.cli.entry import main

if TYPE_CHECKING:  # imported on first use: `loko serve --help` needs no LightningCLI
    from loko_lightning.cli.command import LoKOCLI

__all__ = ["LoKOCLI", "main"]


def __getattr__(name: str) -> Any:
    """:class:`LoKOCLI`, imported when first used."""
    if name == "LoKOCLI":
        from loko_lightning.cli.command import LoKOCLI

        return LoKOCLI
    raise AttributeError(f"module 'loko_lightning.cli' has no attribute {name!r}")
