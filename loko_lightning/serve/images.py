"""Images sent to ``loko serve``: their size checked from the header before any pixel is decoded.

A PNG of a few kilobytes can hold 169 million pixels (a 13000x13000 1-bit image: 2 s and 0.6 GB to decode), under
PIL's own bomb limit (about 179 million). :func:`decode_image` reads the header first and refuses an image over
``max_pixels`` (:data:`MAX_PIXELS` by default, far below PIL's limit) before decoding it, so that time and memory per
input are bounded. 16-bit greyscale images are scaled to 8 bits (not clipped to 0/255) before the RGB conversion.
"""

from __future__ import annotations

import io

from PIL import Image

from loko_lightning.data.predict import decode_image as decode_checked
from loko_lightning.errors import ConfigError
from loko_lightning.serve.limits import MAX_PIXELS

# 4096 x 4096: 48 MB as 8-bit RGB, decoded in well under a second; PIL's own limit is 11 times larger.
# PIL's 16-bit and 32-bit integer greyscale modes, and the bits their values use.
WIDE_MODES = {"I;16": 16, "I;16L": 16, "I;16B": 16, "I;16N": 16, "I": 16}


class ImageTooLarge(ConfigError):
    """An image with more pixels than allowed (HTTP 413), refused from its header."""


def decode_image(data: bytes, field: str = "input", max_pixels: int | None = MAX_PIXELS) -> Image.Image:
    """The RGB image in ``data`` (PNG, JPEG, ...), its size checked before it is decoded.

    Args:
        data: the bytes of an image file.
        field: the request field it came in, for the messages.
        max_pixels: width x height, at most (``None``: PIL's own limit only).

    Raises:
        ImageTooLarge: (field ``field``) more than ``max_pixels`` pixels.
        ConfigError: (field ``field``) not an image, or a damaged one.
    """
    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header only
            (width, height), mode = header.size, header.mode
    except Exception:  # not an image: the checked decode below says which way
        return decode_checked(data, field=field)
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLarge(
            f"{field} is a {width}x{height} image ({width * height:,} pixels); at most {max_pixels:,} "
            "(--max_pixels): send it downscaled",
            field=field,
        )
    image = decode_checked(data, field=field)  # checked whole, then RGB
    if mode in WIDE_MODES:  # decoded again: PIL's RGB conversion clipped its values
        with Image.open(io.BytesIO(data)) as wide:
            return _wide_to_rgb(wide)
    return image


def _wide_to_rgb(image: Image.Image) -> Image.Image:
    """A 16-bit greyscale image as 8-bit RGB: values scaled by 255/65535 (PIL's ``convert`` clips them to 0/255)."""
    wide = image.convert("I")
    scaled = wide.point(lambda value: value * (255 / 65535))  # "I" to "I", still 32-bit
    return scaled.convert("L").convert("RGB")
