"""Head fine-tuning on a frozen backbone: both backends (numpy, ONNX Runtime training), accuracy, the written graph,
the three pitfalls, no torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgerev.cli import main
from edgerev.errors import ExportError
from edgerev.export import graph
from edgerev.export.finetune import finetune_head
from edgerev.export.head_numpy import loss_and_grad
from edgerev.export.head_numpy import train_head as numpy_train_head
from edgerev.export.images import ImageError, normalize
from edgerev.export.metadata import ModelMeta, get_props, set_props
from edgerev.export.onnx import export_onnx
from edgerev.export.ort_training import build_artifacts
from edgerev.export.ort_training import train_head as ort_train_head
from edgerev.export.runtime import inference_session, training_modules
from tests.export.exporting import CLASSES, make_run, needs_ort_training, run_without_torch, save_images, synthetic


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    root = tmp_path_factory.mktemp("ort")
    make_run(root / "run")
    export_onnx(root / "run", root / "model.onnx")
    return root / "model.onnx"


@pytest.fixture(scope="module")
def data():
    """Training and held-out samples of the same generated classes."""
    return synthetic(120), synthetic(60, start=120)


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_training_the_head_improves_held_out_accuracy(exported, data, tmp_path, backend):
    if backend == "onnxruntime":
        needs_ort_training()
    train, val = data
    source_bytes = exported.read_bytes()
    r = finetune_head(exported, train, tmp_path / "tuned.onnx", val=val, epochs=10, backend=backend)
    assert exported.read_bytes() == source_bytes  # the source model is left alone
    assert r.samples == 120 and r.val_samples == 60 and len(r.losses) == 10
    assert r.losses[-1] < 0.5 * r.losses[0]
    assert r.val_accuracy_after >= 0.9 and r.val_accuracy_after > r.val_accuracy_before + 0.3
    assert r.train_accuracy_after >= 0.9 and r.max_abs_diff <= 1e-4
    # the model's own logits agree: run the written file on the held-out images
    session = inference_session(r.path)
    meta = ModelMeta.from_props(session.get_modelmeta().custom_metadata_map, str(r.path))
    logits = session.run(None, {"pixels": normalize(val[0], meta.mean, meta.std)})[0]
    assert np.mean(logits.argmax(1) == val[1]) == pytest.approx(r.val_accuracy_after)


def test_written_model_is_the_backbone_with_the_trained_head(exported, data, tmp_path):
    train, val = data
    r = finetune_head(exported, train, tmp_path / "tuned.onnx", epochs=3, optimizer="sgd", lr=0.1)
    before, after = initializers(exported), initializers(r.path)
    assert before.keys() == after.keys()
    head = graph.find_head(onnx.load(str(r.path)))
    assert not np.array_equal(before[head.weight], after[head.weight])
    assert all(np.array_equal(before[k], after[k]) for k in before if k not in (head.weight, head.bias))
    # logits of the written model == backbone features times the trained head, computed in numpy
    source = onnx.load(str(exported))
    feats_session = inference_session(graph.backbone(source, graph.find_head(source)).SerializeToString())
    meta = ModelMeta.from_props(get_props(source), "source")
    x = normalize(val[0][:16], meta.mean, meta.std)
    feats = feats_session.run(None, {"pixels": x})[0]
    expected = feats @ after[head.weight].T + after[head.bias]
    got = inference_session(r.path).run(None, {"pixels": x})[0]
    # each side rounds a sum of k products in float32: within k eps of the sum of their magnitudes (the logits
    # reach hundreds here, where one float32 step is 3e-5: an absolute 1e-4 failed on another CPU's kernels)
    k = feats.shape[1] + 1
    terms = np.abs(feats) @ np.abs(after[head.weight]).T + np.abs(after[head.bias])
    assert np.all(np.abs(got - expected) <= 2 * k * np.finfo(np.float32).eps * terms)


def test_metadata_is_kept_and_the_fine_tuning_recorded(exported, data, tmp_path):
    train, _ = data
    first = finetune_head(exported, train, tmp_path / "once.onnx", epochs=1)
    second = finetune_head(first.path, train, tmp_path / "twice.onnx", epochs=1)
    src = ModelMeta.from_props(get_props(onnx.load(str(exported))), "src")
    meta = ModelMeta.from_props(get_props(onnx.load(str(second.path))), "out")
    assert (meta.classes, meta.input_size, meta.mean, meta.std) == (src.classes, src.input_size, src.mean, src.std)
    assert meta.weights_sha256 == src.weights_sha256  # the checkpoint the backbone came from
    record = meta.fine_tuned
    assert record["what"] == "head" and record["backend"].startswith("numpy ")
    assert record["samples"] == 120 and record["previous"]["epochs"] == 1
    assert onnx.load(str(second.path)).ir_version <= graph.MAX_IR
    needs_ort_training()
    third = finetune_head(second.path, train, tmp_path / "thrice.onnx", epochs=1, backend="onnxruntime")
    record = ModelMeta.from_props(get_props(onnx.load(str(third.path))), "out").fine_tuned
    assert record["backend"].startswith("onnxruntime-training") and third.backend == record["backend"]
    assert record["previous"]["backend"].startswith("numpy ")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_both_backends_train_the_same_head(optimizer):
    """numpy applies ONNX Runtime training's updates: same seed, same data, the same weights."""
    needs_ort_training()
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(70, 12)).astype(np.float32)
    labels = rng.integers(0, 4, 70)
    w0, b0 = (0.1 * rng.normal(size=(4, 12))).astype(np.float32), np.zeros(4, np.float32)
    head = graph.Head(node=0, features="features", weight="head.weight", bias="head.bias", trans_b=True, output="y")
    kw = {"epochs": 3, "lr": 0.05, "batch": 16, "optimizer": optimizer, "seed": 3}
    w_np, b_np, loss_np = numpy_train_head(feats, labels, w0, b0, **kw)
    w_ort, b_ort, loss_ort = ort_train_head(feats, labels, w0, b0, head, **kw)
    assert np.abs(w_np - w0).max() > 1e-2  # it moved
    np.testing.assert_allclose(w_np, w_ort, atol=2e-5)
    np.testing.assert_allclose(b_np, b_ort, atol=2e-5)
    np.testing.assert_allclose(loss_np, loss_ort, rtol=1e-4)


def test_numpy_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    feats, labels = rng.normal(size=(9, 5)), rng.integers(0, 3, 9)
    w, b = rng.normal(size=(3, 5)), rng.normal(size=3)
    _, dw, db = loss_and_grad(feats, labels, w, b)
    h = 1e-6
    for params, grad in ((w, dw), (b, db)):
        for idx in np.ndindex(params.shape):
            old = params[idx]
            params[idx] = old + h
            up = loss_and_grad(feats, labels, w, b)[0]
            params[idx] = old - h
            down = loss_and_grad(feats, labels, w, b)[0]
            params[idx] = old
            assert (up - down) / (2 * h) == pytest.approx(float(grad[idx]), abs=1e-5)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_artifacts_are_lowered_to_ir_10(tmp_path, optimizer):
    """onnx >= 1.18 stamps newer IR versions; ONNX Runtime 1.19 refuses the optimizer graph at IR 14."""
    needs_ort_training()
    head = graph.Head(node=0, features="features", weight="head.weight", bias="head.bias", trans_b=True, output="y")
    proto = graph.head_model(np.zeros((3, 8), np.float32), np.zeros(3, np.float32), head)
    assert proto.ir_version <= graph.MAX_IR
    build_artifacts(proto, head, tmp_path, optimizer)
    files = sorted(p.name for p in tmp_path.glob("*.onnx"))
    assert files == ["eval_model.onnx", "optimizer_model.onnx", "training_model.onnx"]
    assert all(onnx.load(str(tmp_path / f)).ir_version <= graph.MAX_IR for f in files)
    api, _ = training_modules()
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = api.Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    api.Optimizer(str(tmp_path / "optimizer_model.onnx"), module)  # refused at IR 14


def test_inference_batch_norm_with_three_outputs_is_repaired(exported, data, tmp_path):
    """A batch norm in inference mode that kept its running-statistics outputs: ORT refuses it as it is."""
    model = onnx.load(str(exported))
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert bns
    for i, node in enumerate(bns):
        node.output.extend([f"unused_mean_{i}", f"unused_var_{i}"])
    onnx.save(model, str(tmp_path / "three.onnx"))
    with pytest.raises(ExportError, match="should be 1"):
        inference_session(tmp_path / "three.onnx")
    r = finetune_head(tmp_path / "three.onnx", data[0], tmp_path / "tuned.onnx", epochs=1)
    out = onnx.load(str(r.path))
    assert all(len(n.output) == 1 for n in out.graph.node if n.op_type == "BatchNormalization")
    inference_session(r.path)  # loads
    # a batch norm that hands its statistics on cannot be cut
    model.graph.output.append(helper.make_tensor_value_info("unused_mean_0", TensorProto.FLOAT, None))
    with pytest.raises(ExportError, match="export the model in eval mode"):
        graph.drop_extra_bn_outputs(model)


def test_a_head_exported_without_a_bias_is_fine_tuned_with_one(exported, data, tmp_path):
    """Exports of a bias-free head written before export put the zero bias back: the head trains a bias from 0."""
    model = onnx.load(str(exported))
    head = graph.find_head(model)
    gemm = model.graph.node[head.node]
    del gemm.input[2]
    kept = [t for t in model.graph.initializer if t.name != head.bias]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    onnx.save(model, str(tmp_path / "old.onnx"))
    with pytest.raises(ExportError, match="Gemm with weight and bias"):
        graph.find_head(onnx.load(str(tmp_path / "old.onnx")))
    train, val = data
    r = finetune_head(tmp_path / "old.onnx", train, tmp_path / "tuned.onnx", val=val, epochs=3)
    tuned = onnx.load(str(r.path))
    bias = initializers(r.path)[graph.find_head(tuned).bias]
    assert bias.shape == (len(CLASSES),) and np.any(bias != 0)
    assert r.val_accuracy_before == pytest.approx(finetune_head(exported, train, tmp_path / "x.onnx", val=val,
                                                                epochs=1).val_accuracy_before)


def test_image_folder(exported, data, tmp_path, capsys):
    (pixels, labels), (vp, vl) = data
    keep = labels != 2  # a class without a folder is fine
    save_images(tmp_path / "train", pixels[keep], labels[keep], suffix=".jpg")
    save_images(tmp_path / "val", vp, vl)
    (tmp_path / "train" / CLASSES[0] / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    argv = ["finetune-head", "--model", str(exported), "--data", str(tmp_path / "train"),
            "--val", str(tmp_path / "val"), "--out", str(tmp_path / "tuned.onnx"), "--epochs", "5"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["samples"] == int(keep.sum()) and d["val_samples"] == 60
    assert [Path(s["path"]).name for s in d["skipped"]] == ["broken.png"]
    assert d["train_accuracy_after"] >= 0.9 and d["val_accuracy_after"] > d["val_accuracy_before"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "training accuracy" in text and "validation accuracy" in text
    assert f"wrote {tmp_path / 'tuned.onnx'}" in text
    image = tmp_path / "val" / CLASSES[1] / "0001.png"
    assert main(["predict", "--model", str(tmp_path / "tuned.onnx"), str(image)]) == 0
    assert capsys.readouterr().out.split()[1] == CLASSES[1]


def test_bad_data(exported, data, tmp_path):
    (pixels, labels), _ = data
    out = tmp_path / "o.onnx"
    (tmp_path / "zebra").mkdir(parents=True)
    (tmp_path / "cat").mkdir()
    with pytest.raises(ImageError, match="classes the model does not have: zebra"):
        finetune_head(exported, tmp_path, out)
    with pytest.raises(ImageError, match="no class sub-folders"):
        finetune_head(exported, tmp_path / "cat", out)
    with pytest.raises(ImageError, match="does not exist"):
        finetune_head(exported, tmp_path / "missing", out)
    (tmp_path / "zebra").rmdir()
    with pytest.raises(ImageError, match="no readable PNG or JPEG image"):
        finetune_head(exported, tmp_path, out)
    with pytest.raises(ImageError, match=r"uint8 pixels \[N, 3, 16, 16\]"):
        finetune_head(exported, (pixels.astype(np.float32), labels), out)
    with pytest.raises(ImageError, match=r"uint8 pixels \[N, 3, 16, 16\]"):
        finetune_head(exported, (pixels[:, :, :8], labels), out)
    with pytest.raises(ImageError, match="labels outside 0..2"):
        finetune_head(exported, (pixels, labels + 1), out)
    with pytest.raises(ImageError, match="one integer label per image"):
        finetune_head(exported, (pixels, labels[:-1]), out)
    assert not out.exists()


def test_bad_arguments_and_models(exported, data, tmp_path):
    train, _ = data
    for kw, message in [({"epochs": 0}, "epochs"), ({"lr": 0.0}, "learning rate"), ({"optimizer": "lion"}, "lion"),
                        ({"backend": "tensorflow"}, "unknown backend 'tensorflow'; choose from numpy, onnxruntime")]:
        with pytest.raises(ExportError, match=message):
            finetune_head(exported, train, tmp_path / "o.onnx", **kw)
    with pytest.raises(ExportError, match="folder .* does not exist"):
        finetune_head(exported, train, tmp_path / "no" / "o.onnx")
    with pytest.raises(ExportError, match="missing.onnx does not exist"):
        finetune_head(tmp_path / "missing.onnx", train, tmp_path / "o.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\xff\xfe not a protobuf")
    with pytest.raises(ExportError, match="junk.onnx is not an ONNX model"):
        finetune_head(tmp_path / "junk.onnx", train, tmp_path / "o.onnx")
    # logits that do not come from a linear head
    model = onnx.load(str(exported))
    head = graph.find_head(model)
    model.graph.node[head.node].op_type = "Add"
    del model.graph.node[head.node].attribute[:]
    onnx.save(model, str(tmp_path / "nohead.onnx"))
    with pytest.raises(ExportError, match="not a model written by 'edgerev export'"):
        finetune_head(tmp_path / "nohead.onnx", train, tmp_path / "o.onnx")
    # no edgerev metadata
    model = onnx.load(str(exported))
    del model.metadata_props[:]
    set_props(model, {"note": "x"})
    onnx.save(model, str(tmp_path / "bare.onnx"))
    with pytest.raises(ExportError, match="lacks edgerev metadata"):
        finetune_head(tmp_path / "bare.onnx", train, tmp_path / "o.onnx")


def test_cli_errors(exported, tmp_path, capsys):
    assert main(["finetune-head", "--model", str(exported), "--data", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.match(r"edgerev finetune-head: error: data folder .*none does not exist", err)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_without_torch(exported, data, tmp_path, backend):
    """The whole fine-tuning (artifacts included) runs where torch cannot be imported; the numpy backend
    also where ONNX Runtime training cannot (the README's install: plain onnxruntime)."""
    if backend == "onnxruntime":
        needs_ort_training()
    (pixels, labels), (vp, vl) = data
    np.savez(tmp_path / "d.npz", x=pixels, y=labels, vx=vp, vy=vl)
    block = "sys.modules['onnxruntime.training'] = None" if backend == "numpy" else ""
    code = f"""
        import numpy as np
        {block}
        from edgerev.export.finetune import finetune_head
        d = np.load({str(tmp_path / "d.npz")!r})
        r = finetune_head({str(exported)!r}, (d["x"], d["y"]), {str(tmp_path / "t.onnx")!r}, val=(d["vx"], d["vy"]),
                          epochs=5, backend={backend!r})
        print(r.val_accuracy_before, r.val_accuracy_after)
        assert sys.modules["torch"] is None and not any(m.startswith("torch.") for m in sys.modules)
    """
    done = run_without_torch(code, Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    before, after = map(float, done.stdout.split())
    assert after >= 0.9 and after > before
