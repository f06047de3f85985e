"""Inference with ONNX Runtime only: metadata, decoding as the trainer does, top-k, no torch, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from edgerev.cli import main
from edgerev.engine import plain
from edgerev.errors import ExportError
from edgerev.export.images import decode
from edgerev.export.metadata import ModelMeta, get_props, set_props
from edgerev.export.onnx import export_onnx
from edgerev.export.predict import Predictor, softmax
from edgerev.models.directory import normalize as torch_normalize
from edgerev.train.data import decode_image
from tests.export.exporting import CLASSES, SIZE, make_run, run_without_torch, save_images, synthetic

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model, its export, and six image files of odd sizes (so every one is resized)."""
    root = tmp_path_factory.mktemp("predict")
    model, info = make_run(root / "run")
    export_onnx(root / "run", root / "model.onnx")
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for i in range(6):
        path = root / f"img{i}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(rng.integers(0, 256, (13 + i, 21, 3), dtype=np.uint8)).save(path)
        images.append(path)
    return model, info, root / "model.onnx", images


def torch_probs(model, info, paths) -> np.ndarray:
    """The trainer's path: decode_image, normalize, the PyTorch model, softmax."""
    x = torch_normalize(torch.stack([decode_image(Path(p), info.input_size) for p in paths]), info)
    with plain(model), torch.no_grad():
        return torch.softmax(model(x).double(), dim=1).numpy()


def test_predictions_match_pytorch(setup):
    model, info, path, images = setup
    predictor = Predictor(path)
    assert predictor.classes == CLASSES and predictor.meta.input_size == SIZE
    preds = predictor.predict(images, top=2)
    ref = torch_probs(model, info, images)
    for p, r, src in zip(preds, ref, images):
        assert p.source == str(src)
        assert p.label == CLASSES[int(r.argmax())]
        assert abs(p.probability - r.max()) < 1e-5
        assert len(p.top) == 2 and p.top[0] == (p.label, p.probability) and p.top[0][1] >= p.top[1][1]


def test_decoding_matches_the_trainer(setup):
    *_, images = setup
    for p in images:
        np.testing.assert_array_equal(decode(p, SIZE), decode_image(Path(p), SIZE).numpy())


def test_batching_and_top_k(setup):
    *_, path, images = setup
    predictor = Predictor(path)
    one_batch = predictor.predict(images, top=10)
    in_pairs = predictor.predict(images, top=10, batch=2)
    for a, b in zip(one_batch, in_pairs):
        assert a.label == b.label and abs(a.probability - b.probability) < 1e-6
    assert all(len(p.top) == len(CLASSES) for p in one_batch)  # top is clipped to the classes
    assert all(abs(sum(q for _, q in p.top) - 1) < 1e-6 for p in one_batch)
    assert predictor.predict([]) == []
    with pytest.raises(ExportError, match="top must be positive"):
        predictor.predict(images, top=0)


def test_softmax_is_stable():
    p = softmax(np.array([[1000.0, 0.0], [-1000.0, -1000.0]], dtype=np.float32))
    np.testing.assert_allclose(p, [[1.0, 0.0], [0.5, 0.5]])


def test_unreadable_images_are_reported_and_the_rest_classified(setup, tmp_path):
    *_, path, images = setup
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(Path(images[1]).read_bytes()[:60])
    predictor = Predictor(path)
    alone = predictor.predict(images[:3], top=2)
    got = predictor.predict([bad, images[0], truncated, images[1], tmp_path / "missing.png", images[2]], top=2,
                            batch=2)
    assert [p.source for p in got] == list(map(str, [bad, images[0], truncated, images[1],
                                                     tmp_path / "missing.png", images[2]]))
    assert [p.error for p in got[1::2]] == [None] * 3 and got[1::2] == alone  # the good ones, as if alone
    assert re.search(f"cannot decode image {bad}", got[0].error) and got[0].label is None
    assert str(truncated) in got[2].error
    assert got[4].error.endswith("missing.png does not exist")
    assert got[0].to_json() == {"image": str(bad), "error": got[0].error}


def test_bad_models(setup, tmp_path):
    *_, path, _ = setup
    with pytest.raises(ExportError, match="does not exist"):
        Predictor(tmp_path / "missing.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(ExportError, match="ONNX Runtime cannot load .*corrupt.onnx"):
        Predictor(corrupt)
    # a valid ONNX model without edgerev's metadata
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])])
    bare = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    bare.ir_version = 10
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    with pytest.raises(ExportError, match="lacks edgerev metadata .*edgerev export"):
        Predictor(tmp_path / "bare.onnx")
    # metadata that cannot be parsed
    broken = onnx.load(str(path))
    set_props(broken, {"classes": "[not json"})
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    with pytest.raises(ExportError, match="malformed edgerev metadata"):
        Predictor(tmp_path / "broken.onnx")
    # metadata that does not fit the graph
    wrong = onnx.load(str(path))
    set_props(wrong, {"input_size": "32"})
    onnx.save(wrong, str(tmp_path / "wrong.onnx"))
    with pytest.raises(ExportError, match="its metadata says"):
        Predictor(tmp_path / "wrong.onnx")


def test_metadata_round_trip():
    meta = ModelMeta(classes=("a", "b"), input_size=8, mean=(0.5,), std=(0.2,), arch="x", extra={"note": "kept"})
    model = onnx.ModelProto()
    set_props(model, meta.to_props())
    assert ModelMeta.from_props(get_props(model), "m") == meta
    with pytest.raises(ExportError, match="distinct"):
        ModelMeta(classes=("a", "a"), input_size=8, mean=(0.5,), std=(0.2,))


def test_without_torch(setup, tmp_path):
    """The predict module and the CLI's predict command run where torch cannot be imported."""
    *_, path, images = setup
    code = f"""
        from edgerev.export.predict import Predictor
        p = Predictor({str(path)!r}).predict([{str(images[0])!r}], top=2)[0]
        print(p.label, round(p.probability, 4))
        from edgerev.cli import main
        assert main(["predict", "--model", {str(path)!r}, {str(images[1])!r}]) == 0
        assert sys.modules["torch"] is None and not any(m.startswith("torch.") for m in sys.modules)
    """
    done = run_without_torch(code, Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    label = done.stdout.split()[0]
    assert label in CLASSES and f"{images[1]}: " in done.stdout


def test_missing_onnxruntime_is_one_clear_error(monkeypatch, setup):
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ExportError, match=r"ONNX Runtime is not installed: pip install 'edgerev\[runtime\]'"):
        Predictor(setup[2])


def test_cli_predict(setup, capsys, tmp_path):
    model, info, path, images = setup
    assert main(["predict", "--model", str(path), *map(str, images[:2]), "--top", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{images[0]}: ")
    assert main(["predict", "--model", str(path), *map(str, images), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    ref = torch_probs(model, info, images)
    assert [r["label"] for r in rows] == [CLASSES[int(i)] for i in ref.argmax(1)]
    assert all(len(r["top"]) == 1 for r in rows)
    # images written from the generated data set classify without error
    pixels, labels = synthetic(3)
    files = save_images(tmp_path / "imgs", pixels, labels)
    assert main(["predict", "--model", str(path), *map(str, files)]) == 0


@pytest.mark.parametrize("make, status, message", [
    (lambda d, m: ["--model", str(d / "nope.onnx"), str(m)], 2, "ONNX model .*nope.onnx does not exist"),
    (lambda d, m: ["--model", str(m), str(d / "nope.png")], 1, "image .*nope.png does not exist"),
])
def test_cli_predict_errors(setup, capsys, tmp_path, make, status, message):
    path = setup[2]
    assert main(["predict", *make(tmp_path, path)]) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgerev predict: error: ") and len(err.splitlines()) == 1 and re.search(message, err)


def test_cli_predict_reports_each_bad_file_and_classifies_the_rest(setup, capsys, tmp_path):
    *_, path, images = setup
    bad = tmp_path / "notes.jpg"
    bad.write_text("not an image")
    assert main(["predict", "--model", str(path), str(images[0]), str(bad), str(tmp_path / "gone.png"),
                 str(images[1])]) == 1
    out, err = capsys.readouterr()
    assert [line.split(":")[0] for line in out.splitlines()] == [str(images[0]), str(images[1])]
    assert len(err.splitlines()) == 2 and "notes.jpg" in err and "gone.png does not exist" in err
    assert main(["predict", "--model", str(path), str(bad), str(images[0]), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert "error" in rows[0] and rows[1]["label"] in CLASSES


@pytest.mark.slow
def test_cli_predict_into_a_closed_pipe_ends_quietly(setup, tmp_path):
    """`edgerev predict ... | head`: the reader is gone; exit 141 as a tool killed by SIGPIPE, no traceback."""
    import os
    import subprocess
    import sys

    *_, path, images = setup
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "edgerev", "predict", "--model", str(path), *map(str, images),
                               "--json"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == ""
