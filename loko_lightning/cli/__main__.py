"""``python -m loko_lightning.cli``: the ``loko`` command."""

from loko_lightning.cli.entry import main

if __name__ == "__main__":
    main()
