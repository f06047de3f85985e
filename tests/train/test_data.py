"""Data sources and augmentation: real files in tmp_path, corrupt ones included."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from edgerev.train import Augment, CIFAR10Binary, ImageFolder, SyntheticImages, cutout, pad_crop, random_flip
from edgerev.train.data import DataError, decode_image


def write_image(path, size=(12, 10), colour=(200, 30, 40), fmt=None):
    Image.new("RGB", size, colour).save(path, format=fmt)


@pytest.fixture
def folder(tmp_path):
    for name, colour in (("cat", (200, 0, 0)), ("dog", (0, 200, 0))):
        (tmp_path / name).mkdir()
        for i in range(3):
            write_image(tmp_path / name / f"{i}.png", colour=colour)
        write_image(tmp_path / name / "x.jpg", colour=colour, fmt="JPEG")
    return tmp_path


def test_image_folder_reads_classes_and_images(folder):
    ds = ImageFolder(folder)
    assert ds.classes == ["cat", "dog"] and len(ds) == 8
    img, label = ds[0]
    assert img.dtype == torch.uint8 and img.shape == (3, 10, 12) and label == 0
    assert img[0].float().mean() > 150 and img[1].float().mean() < 20  # red, decoded as RGB
    assert ds[len(ds) - 1][1] == 1


def test_image_folder_skips_corrupt_files_with_a_reason(folder, caplog):
    (folder / "cat" / "bad.png").write_bytes(b"this is text, not a png")
    (folder / "cat" / "empty.png").write_bytes(b"")
    good = (folder / "dog" / "0.png").read_bytes()
    (folder / "dog" / "truncated.png").write_bytes(good[: len(good) // 2])
    jpg = (folder / "dog" / "x.jpg").read_bytes()
    (folder / "dog" / "truncated.jpg").write_bytes(jpg[: len(jpg) // 2])
    with caplog.at_level(logging.WARNING):
        ds = ImageFolder(folder)
    assert len(ds) == 8
    skipped = {p.name for p, _ in ds.skipped}
    assert skipped == {"bad.png", "empty.png", "truncated.png", "truncated.jpg"}
    assert all(reason for _, reason in ds.skipped)
    assert "bad.png" in caplog.text


def test_image_folder_resizes_and_rejects_mixed_sizes(folder):
    write_image(folder / "cat" / "big.png", size=(20, 20))
    with pytest.raises(DataError, match="give a size"):
        ImageFolder(folder)
    ds = ImageFolder(folder, size=16)
    assert all(ds[i][0].shape == (3, 16, 16) for i in range(len(ds)))


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "not a directory"),
    (lambda p: p, "no class sub-folders"),
    (lambda p: ((p / "a").mkdir(), p)[1], "holds no PNG or JPEG"),
])
def test_image_folder_bad_paths(tmp_path, make, match):
    with pytest.raises(DataError, match=match):
        ImageFolder(make(tmp_path))


def test_decode_image_error_names_the_file(tmp_path):
    p = tmp_path / "notes.png"
    p.write_text("hello")
    with pytest.raises(DataError, match="notes.png"):
        decode_image(p)


def write_cifar(path, n, seed):
    rng = np.random.default_rng(seed)
    records = np.zeros((n, 3073), dtype=np.uint8)
    records[:, 0] = rng.integers(0, 10, n)
    records[:, 1:] = rng.integers(0, 256, (n, 3072))
    records.tofile(path)
    return records


def test_cifar10_binary_layout(tmp_path):
    batches = [write_cifar(tmp_path / f"data_batch_{i}.bin", 4, i) for i in range(1, 6)]
    test = write_cifar(tmp_path / "test_batch.bin", 3, 9)
    train = CIFAR10Binary(tmp_path)
    assert len(train) == 20 and len(CIFAR10Binary(tmp_path, train=False)) == 3
    img, label = train[5]
    rec = batches[1][1]
    assert label == rec[0]
    assert torch.equal(img[0], torch.from_numpy(rec[1:1025].reshape(32, 32)))  # red plane first, row-major
    assert torch.equal(img[2], torch.from_numpy(rec[2049:].reshape(32, 32)))
    assert CIFAR10Binary(tmp_path, train=False)[2][1] == test[2][0]


def test_cifar10_binary_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        CIFAR10Binary(tmp_path / "nope")
    with pytest.raises(DataError, match="lacks data_batch_1.bin"):
        CIFAR10Binary(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\0" * 100)
    with pytest.raises(DataError, match="whole number"):
        CIFAR10Binary(tmp_path, train=False)


def test_synthetic_is_deterministic_and_learnable():
    a, b = SyntheticImages(50, seed=3), SyntheticImages(50, seed=3)
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(0, 50, 7))
    assert not torch.equal(SyntheticImages(50, seed=4)[0][0], a[0][0])
    # a nearest-class-mean classifier on raw pixels already beats chance by far: the classes differ
    ds = SyntheticImages(400, size=16, seed=0)
    x = torch.stack([ds[i][0] for i in range(400)]).float().flatten(1)
    y = torch.tensor([ds[i][1] for i in range(400)])
    means = torch.stack([x[:300][y[:300] == c].mean(0) for c in range(10)])
    pred = torch.cdist(x[300:], means).argmin(1)
    assert (pred == y[300:]).float().mean() > 0.3


def test_synthetic_class_subset_and_bad_arguments():
    ds = SyntheticImages(20, classes=range(5, 10))
    assert {ds[i][1] for i in range(20)} == set(range(5, 10))
    with pytest.raises(ValueError):
        SyntheticImages(0)
    with pytest.raises(ValueError):
        SyntheticImages(10, classes=[12])
    with pytest.raises(IndexError):
        SyntheticImages(3)[3]


def test_augmentations():
    g = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    assert torch.equal(pad_crop(x, 0), x)
    y = pad_crop(x, 2, g)
    assert y.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    for i in range(2):  # every output is one 8x8 window of the padded image
        assert any(torch.equal(y[i], padded[i, :, dy:dy + 8, dx:dx + 8]) for dy in range(5) for dx in range(5))
    flipped = random_flip(x, p=1.0, generator=g)
    assert torch.equal(flipped, x.flip(-1))
    assert torch.equal(random_flip(x, p=0.0, generator=g), x)
    c = cutout(torch.ones(4, 3, 16, 16), 6, g)
    zeros = (c[:, 0] == 0).sum(dim=(1, 2))
    assert (zeros <= 36).all() and (zeros > 0).all()
    assert ((c == 0).all(dim=1) | (c == 1).all(dim=1)).all()  # the same square on every channel
    u8 = torch.randint(0, 255, (3, 3, 8, 8), dtype=torch.uint8)
    out = Augment(pad=2, flip=0.5, cutout=3)(u8, g)
    assert out.dtype == torch.uint8 and out.shape == u8.shape
