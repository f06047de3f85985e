"""Every image mode Pillow decodes from PNG and JPEG is normalized faithfully, pixel by pixel.

16-bit greyscale is scaled to 8 bits (not clipped), alpha is composited on the documented white
background, palette, 1-bit and CMYK keep their colours. Images are already at the model's size, so
the expected values are exact (JPEG: within its loss).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from edgerev_daemon.intake.images import BACKGROUND, normalize, to_rgb

SIZE = 8


def encode(im, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kwargs)
    return out.getvalue()


def pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(normalize(data, SIZE, 10**6).png)) as im:
        assert im.mode == "RGB"
        return np.asarray(im).astype(int)


def grey(values: np.ndarray) -> np.ndarray:
    return np.repeat(values[..., None], 3, axis=2)


def test_16_bit_greyscale_is_scaled_not_clipped():
    from PIL import Image

    wide = np.linspace(0, 65535, SIZE * SIZE).round().astype(np.uint16).reshape(SIZE, SIZE)
    im = Image.fromarray(wide)
    assert im.mode == "I;16"
    got = pixels(encode(im))
    assert np.array_equal(got, grey(np.rint(wide / 257).astype(int)))
    assert got.min() == 0 and got.max() == 255 and len(np.unique(got)) > 32  # a ramp, not a white sheet


def test_32_bit_integer_and_float_modes_read_as_16_bit():
    from PIL import Image

    values = np.array([[0, 257, 65535, 70000, -5] * 2] * 2, dtype=np.int32)
    assert np.array_equal(np.asarray(to_rgb(Image.fromarray(values, "I")))[..., 0],
                          np.array([[0, 1, 255, 255, 0] * 2] * 2))
    f = Image.fromarray(values.astype(np.float32), "F")
    assert np.array_equal(np.asarray(to_rgb(f))[..., 0], np.array([[0, 1, 255, 255, 0] * 2] * 2))


def expected_over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha[..., None] / 255.0
    return rgb * a + np.array(BACKGROUND) * (1 - a)


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_alpha_is_composited_on_white(mode):
    from PIL import Image

    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    if mode == "LA":
        rgb = np.repeat(rgb[..., :1], 3, axis=2)
    alpha = rng.integers(0, 256, (SIZE, SIZE), dtype=np.uint8)
    alpha[0, 0], alpha[0, 1] = 0, 255  # fully transparent shows the background; opaque, the pixel
    rgba = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    im = rgba if mode == "RGBA" else Image.merge("LA", (rgba.getchannel("R"), rgba.getchannel("A")))
    got = pixels(encode(im))
    assert np.abs(got - expected_over_white(rgb.astype(float), alpha.astype(float))).max() <= 1
    assert list(got[0, 0]) == list(BACKGROUND) and list(got[0, 1]) == list(rgb[0, 1])


def test_a_palette_with_a_transparent_entry_and_one_without():
    from PIL import Image

    im = Image.new("P", (SIZE, SIZE), 0)
    im.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    im.putpixel((1, 1), 1)
    plain = pixels(encode(im))
    assert list(plain[0, 0]) == [10, 20, 30] and list(plain[1, 1]) == [200, 100, 50]
    see_through = pixels(encode(im, transparency=0))
    assert list(see_through[0, 0]) == list(BACKGROUND) and list(see_through[1, 1]) == [200, 100, 50]


def test_palette_with_alpha_in_memory():
    from PIL import Image

    im = Image.new("PA", (SIZE, SIZE))
    im.putpalette([0, 0, 255] * 256)
    im.putdata([(0, 0)] * (SIZE * SIZE - 1) + [(0, 255)])
    got = np.asarray(to_rgb(im)).astype(int)
    assert list(got[0, 0]) == list(BACKGROUND) and list(got[-1, -1]) == [0, 0, 255]


def test_one_bit_images_are_black_and_white():
    from PIL import Image

    bits = (np.indices((SIZE, SIZE)).sum(axis=0) % 2).astype(bool)
    got = pixels(encode(Image.fromarray(bits)))
    assert np.array_equal(got, grey(np.where(bits, 255, 0)))


def test_cmyk_jpeg_keeps_its_colours():
    from PIL import Image

    im = Image.new("CMYK", (SIZE, SIZE), (0, 255, 255, 0))  # red
    got = pixels(encode(im, "JPEG", quality=100))
    assert np.abs(got - np.array([255, 0, 0])).max() <= 3
    im = Image.new("CMYK", (SIZE, SIZE), (255, 0, 0, 0))  # cyan
    got = pixels(encode(im, "JPEG", quality=100))
    assert np.abs(got - np.array([0, 255, 255])).max() <= 3
