"""One dropped file's bytes to the normalized image the store keeps, or a reason to refuse it.

Checks, in the order they cost:

1. the format, from the first bytes: only PNG and JPEG decoders are ever run on inbox data;
2. the pixel count, from the header alone: a decompression bomb (a small file that claims a huge
   image) is refused before a single pixel is decoded;
3. a full decode: a truncated JPEG, a PNG with a broken chunk or checksum fails here.

Normalization: EXIF orientation applied, converted to RGB, resized (bilinear, with Pillow's
antialiasing) to ``size x size`` like :func:`edgerev.train.data.decode_image`, and encoded as PNG.
A JPEG is decoded at a reduced scale first when it is much larger than the target (Pillow's
``draft``), which is several times faster on camera photos and changes nothing a 32x32 model sees.
"""

from __future__ import annotations

import io
import warnings
import zlib
from dataclasses import dataclass

FORMATS = ("PNG", "JPEG")


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
            rgb = _upright(im).convert("RGB")
        except (OSError, SyntaxError, ValueError, EOFError, zlib.error, MemoryError, Image.DecompressionBombError) as e:
            raise ImageRejected(f"corrupt or truncated {fmt}: {e}") from None
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.BILINEAR)
    out = io.BytesIO()
    rgb.save(out, "PNG")
    return Normalized(out.getvalue(), width, height, fmt)


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
