"""``glyphs100``: characters rendered on the fly from the typefaces matplotlib ships, offline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from loko_lightning.data.sources.base import DataNotFoundError, ImageSource, Split, Splits, package_missing

#: The 100 classes of ``glyphs100``: digits, Latin letters, the Greek capitals unlike any Latin one, the Greek small
#: letters but omicron (it is an o) and five symbols.
GLYPHS = "0123456789" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwxyz" + "ΓΔΘΛΞΠΣΦΨΩ"
GLYPHS += "αβγδεζηθικλμνξπρστυφχψω" + "&@#$%"
#: The typefaces of ``glyphs100``: the TrueType fonts matplotlib ships (DejaVu Sans, Sans Mono, Serif, STIX General,
#: each upright, bold, italic and bold italic).
GLYPH_FONTS = tuple(
    f"{family}{style}.ttf"
    for family, styles in (
        ("DejaVuSans", ("", "-Bold", "-Oblique", "-BoldOblique")),
        ("DejaVuSansMono", ("", "-Bold", "-Oblique", "-BoldOblique")),
        ("DejaVuSerif", ("", "-Bold", "-Italic", "-BoldItalic")),
        ("STIXGeneral", ("", "Bol", "Italic", "BolIta")),
    )
    for style in styles
)


class GlyphDataset(Dataset):
    """Characters rendered from real typefaces with light augmentation, one ``(PIL image, label)`` per index.

    Item ``i`` is class ``i % len(classes)`` in a font and pose drawn from a generator seeded with ``(seed, i)``
    alone: the same image on every machine and in any order. Pose: rotation within ±10°, size 20-26 px, shift
    within ±2 px, on a 32 x 32 black canvas (grayscale, white ink).

    Args:
        size: number of items.
        classes: the characters, one class each.
        fonts: TrueType files; a class is drawn only in the fonts that have its glyph.
        seed: separates the splits (the training and the held-out split use different seeds).
    """

    def __init__(self, size: int, classes: str, fonts: Sequence[Path], seed: int) -> None:
        from matplotlib import ft2font

        self.classes = list(classes)
        self.targets = [i % len(classes) for i in range(size)]
        self.seed = seed
        self.fonts = [str(f) for f in fonts]
        charmaps = [set(ft2font.FT2Font(f).get_charmap()) for f in self.fonts]
        self.covering = [[j for j, charmap in enumerate(charmaps) if ord(c) in charmap] for c in classes]
        missing = [c for c, fonts_of in zip(classes, self.covering, strict=True) if not fonts_of]
        if missing:
            raise ValueError(f"no font has the glyphs {missing}")
        self._faces: dict[tuple[int, int], Any] = {}

    def __len__(self) -> int:
        return len(self.targets)

    def _face(self, font: int, size: int) -> Any:
        from PIL import ImageFont

        key = (font, size)
        if key not in self._faces:
            self._faces[key] = ImageFont.truetype(self.fonts[font], size)
        return self._faces[key]

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        from PIL import ImageDraw

        label = self.targets[index]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        draw = torch.rand(5, generator=generator, dtype=torch.float64).tolist()
        fonts_of = self.covering[label]
        font = fonts_of[min(int(draw[0] * len(fonts_of)), len(fonts_of) - 1)]
        size = 20 + int(draw[1] * 7)
        canvas = Image.new("L", (48, 48), 0)
        ImageDraw.Draw(canvas).text((24, 24), self.classes[label], fill=255, font=self._face(font, size), anchor="mm")
        canvas = canvas.rotate(20 * draw[2] - 10, resample=Image.BILINEAR, center=(24, 24))
        dx, dy = round(4 * draw[3] - 2), round(4 * draw[4] - 2)
        return canvas.crop((8 - dx, 8 - dy, 40 - dx, 40 - dy)), label


class Glyphs100(ImageSource):
    """``glyphs100``: 100 classes of characters (:data:`GLYPHS`) rendered from 16 real typefaces (:data:`GLYPH_FONTS`).

    A many-class image stream that installs from the package registries (the fonts ship in matplotlib, a dependency of
    the offline extra): 20,000 training items (200 per class) and 2,000 held-out ones, rendered on the fly from
    their index (:class:`GlyphDataset`). Some classes are hard to tell apart in some fonts (``l``, ``I`` and ``1``;
    ``O`` and ``0``; ``x`` and ``X`` after scaling), as in handwriting datasets.

    Its options are :class:`~loko_lightning.data.sources.base.ImageSource`'s (``image_size``, ``mean``, ``std``).
    """

    name = "glyphs100"
    num_classes = len(GLYPHS)
    train_size, held_out_size = 20_000, 2_000

    def location(self) -> str:
        """Where the typefaces are: the matplotlib package."""
        return "the fonts of the matplotlib package"

    def load(self) -> Splits:
        """The two rendered splits (nothing is read but the fonts)."""
        try:
            import matplotlib
        except ImportError as err:
            raise package_missing("glyphs100", "the typefaces", "matplotlib") from err
        directory = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
        fonts = [directory / name for name in GLYPH_FONTS if (directory / name).exists()]
        if not fonts:
            raise DataNotFoundError(
                f"dataset='glyphs100': none of the fonts {GLYPH_FONTS} is in {directory}. To fix it: reinstall "
                "matplotlib (`pip install --force-reinstall matplotlib`), or choose another dataset.",
                field="source",
            )
        train = GlyphDataset(self.train_size, GLYPHS, fonts, seed=1)
        held_out = GlyphDataset(self.held_out_size, GLYPHS, fonts, seed=2)
        return Splits(Split(train, np.arange(len(train))), Split(held_out, np.arange(len(held_out))), train.classes)
