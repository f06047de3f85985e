"""ONNX export: every registry model, a symbolic batch, metadata, verification, atomic writes, bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
import torch

from edgerev.cli import main
from edgerev.engine import plain
from edgerev.errors import ExportError, ShapeError
from edgerev.export.images import normalize
from edgerev.export.metadata import ModelMeta, get_props
from edgerev.export.onnx import MAX_IR, MAX_OPSET, export_onnx, verify_onnx, weights_sha256
from edgerev.export.runtime import inference_session
from edgerev.models import list_models
from edgerev.models.directory import INFO, CheckpointError, ModelInfo, save_model
from edgerev.torch_range import release
from tests.export.exporting import CLASSES, SIZE, make_run, tiny_model

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny RevNeXt model directory and its default (auto) export."""
    root = tmp_path_factory.mktemp("export")
    model, info = make_run(root / "run")
    result = export_onnx(root / "run", root / "model.onnx")
    return model, info, result


def logits_both(path, model: torch.nn.Module, batch: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    x = torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))
    session = inference_session(path)
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with plain(model), torch.no_grad():
        ref = model(x).numpy()
    return got, ref


def test_export_result_versions_and_symbolic_batch(exported):
    model, info, r = exported
    assert r.path.is_file() and r.size_bytes == r.path.stat().st_size
    assert r.max_abs_diff <= 1e-4 and r.batches == (4, 1)
    proto = onnx.load(str(r.path))
    onnx.checker.check_model(proto)
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == r.opset <= MAX_OPSET
    assert proto.ir_version == r.ir_version <= MAX_IR
    batch_dim = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value  # symbolic, not fixed to the example's batch
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim[1:]] == [3, SIZE, SIZE]
    if release(str(torch.__version__)) >= (2, 13):
        # the newest releases export with dynamo: a fallback there would hide a regression (torch 2.6 falls back)
        assert r.exporter == "dynamo"


def dynamo_fails(monkeypatch) -> None:
    """The dynamo exporter fails as torch 2.6's does beside onnxscript 0.7 (a root error under two wrappers)."""
    import edgerev.export.onnx as export_mod

    real = export_mod.torch.onnx.export

    def export(*args, dynamo=True, **kwargs):
        if not dynamo:
            return real(*args, dynamo=False, **kwargs)
        try:
            raise AttributeError("'tuple' object has no attribute 'dtype'")
        except AttributeError as root:
            try:
                raise RuntimeError("Error when translating node %_native_batch_norm_legit_no_training") from root
            except RuntimeError as node:
                raise RuntimeError("Failed to convert. \x1b[96mThis is step 3/3\x1b[0m\n- Next steps") from node

    monkeypatch.setattr(export_mod.torch.onnx, "export", export)


def test_auto_falls_back_to_the_legacy_exporter_where_dynamo_fails(tmp_path, monkeypatch, caplog):
    """The file comes from TorchScript, verified; the log says why in one line; dynamo by name still fails."""
    import edgerev.export.onnx as export_mod

    monkeypatch.setattr(export_mod, "DYNAMO_FROM", (0, 0))  # try dynamo on every torch, 2.6 included
    dynamo_fails(monkeypatch)
    model, info = make_run(tmp_path / "run")
    with caplog.at_level("WARNING", logger="edgerev.export.onnx"):
        r = export_onnx(tmp_path / "run", tmp_path / "auto.onnx")
    assert r.exporter == "legacy" and r.max_abs_diff <= 1e-4
    assert caplog.messages == ["torch.onnx.export failed for revnext: RuntimeError: AttributeError: 'tuple' object "
                               "has no attribute 'dtype'; exporting with the TorchScript exporter instead (verified "
                               "the same way)"]
    got, ref = logits_both(r.path, model, 3)
    assert np.abs(got - ref).max() < 1e-4
    with pytest.raises(ExportError, match="torch.onnx.export failed for revnext: RuntimeError: AttributeError"):
        export_onnx(tmp_path / "run", tmp_path / "dynamo.onnx", exporter="dynamo")
    assert not (tmp_path / "dynamo.onnx").exists()


def test_auto_does_not_try_dynamo_on_torch_2_6(tmp_path, monkeypatch, caplog):
    """NVIDIA's Jetson build: legacy straight away, without the 15 s of a failing dynamo attempt or a warning."""
    import edgerev.export.onnx as export_mod

    dynamo_fails(monkeypatch)
    monkeypatch.setattr(export_mod.torch, "__version__", "2.6.0a0+df5bbc09d1.nv24.12")
    make_run(tmp_path / "run")
    with caplog.at_level("WARNING", logger="edgerev.export.onnx"):
        r = export_onnx(tmp_path / "run", tmp_path / "auto.onnx")
    assert r.exporter == "legacy" and not caplog.messages


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_exported_model_runs_at_any_batch(exported, batch):
    model, _, r = exported
    got, ref = logits_both(r.path, model, batch)
    assert got.shape == (batch, len(CLASSES))
    assert np.abs(got - ref).max() < 1e-4


def test_metadata(exported, tmp_path):
    import edgerev

    _, info, r = exported
    meta = ModelMeta.from_props(get_props(onnx.load(str(r.path))), str(r.path))
    recorded = json.loads((r.path.parent / "run" / INFO).read_text())["weights_sha256"]
    assert meta.classes == CLASSES and meta.input_size == SIZE
    assert meta.mean == info.mean and meta.std == info.std
    assert meta.arch == "revnext" and meta.edgerev_version == edgerev.__version__
    assert meta.weights_sha256 == recorded == r.weights_sha256
    assert meta.fine_tuned is None
    # ONNX Runtime sees the same, as plain strings any client can read
    props = inference_session(r.path).get_modelmeta().custom_metadata_map
    assert json.loads(props["classes"]) == list(CLASSES) and props["input_size"] == str(SIZE)


@pytest.mark.parametrize("arch", list_models())
def test_every_registry_model_exports(arch, tmp_path):
    model, args = tiny_model(arch)
    info = ModelInfo(arch=arch, classes=CLASSES, input_size=SIZE, model_args=args)
    r = export_onnx(model, tmp_path / f"{arch}.onnx", info=info, batch=3)
    assert r.max_abs_diff <= 1e-4 and r.ir_version <= MAX_IR and r.opset <= MAX_OPSET
    got, ref = logits_both(r.path, model.eval(), 5)
    assert np.abs(got - ref).max() < 1e-4


def test_legacy_exporter_keeps_the_batch_symbolic(tmp_path):
    model, info = make_run(tmp_path / "run")
    r = export_onnx(tmp_path / "run", tmp_path / "legacy.onnx", exporter="legacy")
    assert r.exporter == "legacy" and r.ir_version <= MAX_IR and r.opset <= MAX_OPSET
    for batch in (1, 3, 7):
        got, ref = logits_both(r.path, model, batch)
        assert np.abs(got - ref).max() < 1e-4


def test_export_never_changes_the_model(tmp_path):
    """The export runs a copy: the caller's mode, weights and batch-norm statistics stay as they were."""
    model, args = tiny_model("revnext")
    model.train()
    with torch.no_grad():
        model(torch.randn(4, 3, SIZE, SIZE))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    info = ModelInfo(arch="revnext", classes=CLASSES, input_size=SIZE, model_args=args)
    r = export_onnx(model, tmp_path / "m.onnx", info=info, exporter="legacy")
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the hash of a model object is the one save_model would record for it
    assert r.weights_sha256 == weights_sha256(model) == save_model(tmp_path / "run", model, info)


def test_verification_catches_a_mismatch(exported):
    model, info, r = exported
    meta = ModelMeta(classes=info.classes, input_size=info.input_size, mean=info.mean, std=info.std)
    assert verify_onnx(r.path, model, meta, batches=(2,)) <= 1e-4
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.weight += 1e-3  # revnext's head has no bias
    with pytest.raises(ExportError, match=r"disagree .* tolerance 0.000[0-9]+, and ONNX Runtime lies .* float64"):
        verify_onnx(r.path, other, meta, batches=(2,))


def test_without_a_tolerance_the_float64_logits_tell_rounding_from_a_mismatch(exported):
    """Every difference goes to the exact logits: ONNX Runtime's file rounds as PyTorch's float32 does."""
    model, info, r = exported
    meta = ModelMeta(classes=info.classes, input_size=info.input_size, mean=info.mean, std=info.std)
    assert verify_onnx(r.path, model, meta, batches=(2,), tolerance=0.0) <= 1e-4


def test_large_logits_verify_within_their_rounding_and_a_relative_mismatch_is_caught(exported, tmp_path):
    """float32 rounding grows with the logits: logits in the ten thousands export; 1e-3 off relative does not."""
    import copy

    model, info, _ = exported
    loud = copy.deepcopy(model)
    with torch.no_grad():
        loud.head.weight *= 1e4
    r = export_onnx(loud, tmp_path / "loud.onnx", info=info, exporter="legacy")
    got, ref = logits_both(r.path, loud, 7)
    assert np.abs(ref).max() > 1e4 and r.max_abs_diff <= 1e-4 * np.abs(ref).max()
    off = copy.deepcopy(loud)
    with torch.no_grad():
        off.head.weight *= 1 + 1e-3
    meta = ModelMeta(classes=info.classes, input_size=info.input_size, mean=info.mean, std=info.std)
    with pytest.raises(ExportError, match="disagree .* exceeds the tolerance"):
        verify_onnx(r.path, off, meta, batches=(2,))


def test_failed_verification_writes_nothing(tmp_path, monkeypatch):
    import edgerev.export.onnx as export_mod

    make_run(tmp_path / "run")
    real = export_mod._reference_logits
    monkeypatch.setattr(export_mod, "_reference_logits", lambda model, x: real(model, x) + 1e-3)
    out = tmp_path / "model.onnx"
    with pytest.raises(ExportError, match="nothing written"):
        export_onnx(tmp_path / "run", out, exporter="legacy")
    assert not out.exists() and not list(tmp_path.glob(".model.onnx.tmp*"))


@pytest.mark.parametrize("offset, message", [(1e-6, "e-06 at batch 4 exceeds the tolerance 0;"),
                                             (float("nan"), "nan at batch 4 exceeds")])
def test_tolerance_zero_and_non_finite(tmp_path, monkeypatch, offset, message):
    import edgerev.export.onnx as export_mod

    make_run(tmp_path / "run")
    real = export_mod._reference_logits
    monkeypatch.setattr(export_mod, "_reference_logits", lambda model, x: real(model, x) + np.float32(offset))
    with pytest.raises(ExportError, match=message):
        export_onnx(tmp_path / "run", tmp_path / "m.onnx", tolerance=0.0, exporter="legacy")


def test_bad_input(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        export_onnx(tmp_path / "missing", tmp_path / "m.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="model.json"):
        export_onnx(tmp_path / "empty", tmp_path / "m.onnx")
    model, args = tiny_model("revnext")
    info = ModelInfo(arch="revnext", classes=CLASSES, input_size=SIZE, model_args=args)
    with pytest.raises(ExportError, match="folder .* does not exist"):
        export_onnx(model, tmp_path / "no" / "m.onnx", info=info)
    with pytest.raises(ExportError, match="needs its ModelInfo"):
        export_onnx(model, tmp_path / "m.onnx")
    for kw, msg in [({"batch": 0}, "batch"), ({"tolerance": -1.0}, "tolerance"), ({"tolerance": float("nan")},
                    "tolerance"), ({"opset": 22}, "opset"), ({"exporter": "magic"}, "exporter")]:
        with pytest.raises(ExportError, match=msg):
            export_onnx(model, tmp_path / "m.onnx", info=info, **kw)
    bad_size = ModelInfo(arch="revnext", classes=CLASSES, input_size=24, model_args=args)
    with pytest.raises(ShapeError, match="divisible by 16"):
        export_onnx(model, tmp_path / "m.onnx", info=bad_size)
    assert not (tmp_path / "m.onnx").exists()


def test_missing_onnxscript_is_one_clear_error(tmp_path, monkeypatch):
    import edgerev.export.onnx as export_mod

    def no_onnxscript(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'onnxscript'")

    monkeypatch.setattr(export_mod.torch.onnx, "export", no_onnxscript)
    model, args = tiny_model("revnext")
    info = ModelInfo(arch="revnext", classes=CLASSES, input_size=SIZE, model_args=args)
    with pytest.raises(ExportError, match="needs onnxscript.*legacy exporter"):
        export_onnx(model, tmp_path / "m.onnx", info=info)


def test_input_normalization_matches_the_trainer():
    from edgerev.models.directory import normalize as torch_normalize

    pixels = np.random.default_rng(0).integers(0, 256, (2, 3, 4, 4), dtype=np.uint8)
    info = ModelInfo(arch="revnext", classes=CLASSES, input_size=4, mean=(0.1, 0.2, 0.3), std=(0.3, 0.2, 0.1))
    ours = normalize(pixels, info.mean, info.std)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, torch_normalize(torch.from_numpy(pixels), info).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_cli_export(exported, capsys, tmp_path):
    _, _, r = exported
    run = r.path.parent / "run"
    out = tmp_path / "cli.onnx"
    assert main(["export", "--run", str(run), "--out", str(out), "--batch", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["path"] == str(out) and d["batches"] == [2, 1] and d["max_abs_diff"] <= 1e-4
    assert d["ir_version"] <= MAX_IR and d["size_bytes"] == out.stat().st_size
    assert main(["export", "--run", str(run), "--out", str(out), "--exporter", "legacy"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "max abs difference of logits" in text


@pytest.mark.parametrize("argv, message", [
    (["--run", "{tmp}/missing"], "model directory .*missing does not exist"),
    (["--run", "{tmp}"], "model description .*model.json does not exist"),
    (["--run", "{run}", "--tolerance", "-1"], "tolerance must be a non-negative number"),
])
def test_cli_export_errors(exported, capsys, tmp_path, argv, message):
    run = exported[2].path.parent / "run"
    argv = [a.format(tmp=tmp_path, run=run) for a in argv]
    assert main(["export", *argv, "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgerev export: error: ") and len(err.splitlines()) == 1
    assert re.search(message, err)


@pytest.mark.slow
def test_default_revnext_exports(tmp_path):
    """The full-size RevNeXt (stem width 32, 3.86 M parameters) at 32x32."""
    from edgerev.models import create_model

    model = create_model("revnext", num_classes=10)
    # running statistics as a trained model has them: with the initial ones (mean 0, variance 1) nothing
    # normalizes in eval mode, and with every scale at gamma = 1 the untrained logits reach ~9e4, where
    # float32 rounding alone exceeds the absolute tolerance
    for m in model.modules():
        if hasattr(m, "running_mean"):
            m.momentum = 1.0
    with torch.no_grad():
        model.train()(torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    model.eval()
    info = ModelInfo(arch="revnext", classes=tuple(f"c{i}" for i in range(10)), input_size=32)
    r = export_onnx(model, tmp_path / "revnext.onnx", info=info)
    assert r.max_abs_diff <= 1e-4 and r.size_bytes > 4 * 1_900_000
