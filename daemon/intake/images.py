"""One dropped file's bytes to the normalized image the store keeps, or a reason to refuse it.

Checks, in the order they cost:

1. the format, from the first bytes: only PNG and JPEG decoders are ever run on inbox data;
2. the pixel count, from the header alone: a decompression bomb (a small file that claims a huge
   image) is refused before a single pixel is decoded;
3. a full decode: a truncated JPEG, a PNG with a broken chunk or checksum fails here.

Normalization: EXIF orientation applied, converted to RGB (:func:`to_rgb`), resized (bilinear, with Pillow's
antialiasing) to ``size x size`` like :func:`edgerev.train.data.decode_image`, and encoded as PNG.
A JPEG is decoded at a reduced scale first when it is much larger than the target (Pillow's
``draft``), which is several times faster on camera photos and changes nothing a 32x32 model sees.

Conversion to RGB keeps what the pixels mean, whatever mode Pillow decodes:

- 16-bit greyscale (``I;16``, and ``I``/``F``, which PNG and JPEG never yield but are read alike) is
  *scaled* to 8 bits, ``round(v * 255 / 65535)``, never clipped (clipping turns most of a 16-bit
  image white);
- an alpha channel (``LA``, ``RGBA``, ``PA``, a palette with a transparent entry) is composited on a
  fixed white background, :data:`BACKGROUND`: ``out = a * rgb + (1 - a) * 255``. Dropping the alpha
  instead would show whatever colour the encoder left under transparent pixels (often black, often
  noise), so two renderings of one picture would differ;
- palette, 1-bit (0 and 255), CMYK (Adobe's inverted JPEGs included) and the rest: Pillow's
  conversion.
"""

from __future__ import annotations

import io
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

FORMATS = ("PNG", "JPEG")
BACKGROUND = (255, 255, 255)  # what a transparent pixel becomes
_WIDE = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


class ImageRejected(Exception):
    """The file is not an image the daemon stores; ``reason`` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Normalized:
    """``png``: the normalized image; ``width``, ``height``, ``format``: the original's."""

    png: bytes
    width: int
    height: int
    format: str


def normalize(data: bytes, size: int, max_pixels: int) -> Normalized:
    """Validate and normalize one image file's bytes.

    Raises:
        ImageRejected: not a PNG or JPEG, a decompression bomb, or not decodable to the end.
    """
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        # Pillow warns above its own soft limit; the pixel check below is ours and is stricter
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError as e:
            raise ImageRejected(f"decompression bomb: {e}") from None
        except UnidentifiedImageError:
            raise ImageRejected("not a PNG or JPEG image") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageRejected(f"unreadable image header: {e}") from None
    with im:
        width, height = im.size
        fmt = im.format
        if width < 1 or height < 1:
            raise ImageRejected(f"image has no pixels ({width}x{height})")
        if width * height > max_pixels:
            raise ImageRejected(f"decompression bomb: the header claims {width}x{height} = {width * height} pixels, "
                                f"above limits.max_pixels ({max_pixels})")
        try:
            im.draft("RGB", (size, size))  # JPEG only: decode at 1/2, 1/4 or 1/8 scale when that is still >= size
            im.load()
            rgb = to_rgb(_upright(im))
        except (OSError, SyntaxError, ValueError, EOFError, zlib.error, MemoryError, Image.DecompressionBombError) as e:
            raise ImageRejected(f"corrupt or truncated {fmt}: {e}") from None
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.BILINEAR)
    out = io.BytesIO()
    rgb.save(out, "PNG")
    return Normalized(out.getvalue(), width, height, fmt)


def to_rgb(im: Image.Image) -> Image.Image:
    """``im`` as 8-bit RGB, faithfully (see the module docstring)."""
    from PIL import Image

    if im.mode in _WIDE:
        import numpy as np

        wide = np.asarray(im, dtype=np.float64)
        return Image.fromarray(np.rint(np.clip(wide, 0, 65535) * (255 / 65535)).astype(np.uint8), "L").convert("RGB")
    if im.mode == "P" and "transparency" in im.info or im.mode in ("LA", "La", "PA", "RGBa"):
        im = im.convert("RGBA")
    if im.mode == "RGBA":
        under = Image.new("RGBA", im.size, BACKGROUND + (255,))
        return Image.alpha_composite(under, im).convert("RGB")
    return im.convert("RGB")


def _upright(im):
    """The image turned as its EXIF orientation says (a photo taken with the phone on its side); a
    damaged EXIF block is ignored rather than costing the image."""
    from PIL import ImageOps

    try:
        if im.getexif().get(0x0112, 1) == 1:  # the orientation tag; 1 (or none) is upright
            return im
        return ImageOps.exif_transpose(im)
    except (OSError, SyntaxError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return im
