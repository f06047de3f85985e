"""Malformed model files, as a class: any JSON in any field of a model directory's ``model.json``, an ONNX file's
sidecar or metadata, or an initializer's external-data fields gives a model or one of the model-file errors, in
one line naming the file; never another exception, and never an import of what the file names."""

from __future__ import annotations

import importlib
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgerev.errors import TrustError, UnsupportedModel
from edgerev.models.directory import CheckpointError, load_model
from edgerev.models.names import ARCHS
from edgerev.models.onnx_import import load_onnx
from edgerev.models.onnx_import.read import read_onnx
from tests.models.model_files import VALID_INFO, classifier, model_directory, save_onnx, with_external_data

TINY = "tests.resolve_factories:tiny"
#: what a file might name as code: none of these modules may be imported because a file said so
NAMED_CODE = ("os", "subprocess", "tests.resolve_factories", "edgerev_never_a_module")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
# keys no model here takes (a real argument with a huge value would allocate, which is not what this tests)
arg_names = st.text(min_size=1, max_size=6).filter(lambda k: k not in ("classes", "width", "num_classes", "depth"))
archs = st.sampled_from([*ARCHS, "onnx", "os:system", "subprocess:call", TINY, "edgerev_never_a_module:build",
                         "./elsewhere", "../up/m.onnx", "/abs", "m.onnx", "vgg"]) | json_values

FIELDS = {
    "arch": archs,
    "classes": st.just(["a", "b"]) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "input_size": st.just(8) | st.integers() | json_values,
    "mean": st.just([0.5] * 3) | st.lists(st.floats(), max_size=4) | json_values,
    "std": st.just([0.25] * 3) | st.lists(st.floats(), max_size=4) | json_values,
    "model_args": st.just({}) | st.dictionaries(arg_names, json_values, max_size=2) | json_values,
    "weights_sha256": st.just("0" * 64) | json_values,
}
absent = object()


@st.composite
def descriptions(draw) -> dict:
    d = {}
    for key, values in FIELDS.items():
        value = draw(st.just(absent) | st.just(VALID_INFO.get(key, absent)) | values)
        if value is not absent:
            d[key] = value
    d.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)))
    return d


@contextmanager
def recorded_imports():
    calls: list[str] = []
    real = importlib.import_module

    def recording(name, package=None):
        calls.append(name)
        return real(name, package)

    with mock.patch.object(importlib, "import_module", recording):
        yield calls


def _no_named_code(calls: list[str]) -> None:
    assert not [n for n in calls if any(n == m or n.startswith(m + ".") for m in NAMED_CODE)], calls


def _one_line_naming(e: Exception, name: str) -> None:
    text = str(e)
    assert "\n" not in text and name in text, text


PROPERTY = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(descriptions(), st.booleans())
@example({"arch": "onnx", "classes": ["a", "b"], "input_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3},
         False)  # an imported model's directory without its source.onnx: once a raw ModelSourceError
def test_any_model_json_gives_a_model_or_a_model_file_error(described, hash_recorded):
    with tempfile.TemporaryDirectory() as tmp:
        text = json.dumps(described)  # a hash that does not match is refused too: the weights are a file as well
        folder = model_directory(Path(tmp) / "m", described if hash_recorded else text)
        with recorded_imports() as calls:
            try:
                load_model(folder)
            except (CheckpointError, TrustError) as e:
                _one_line_naming(e, str(folder))
        _no_named_code(calls)


@PROPERTY
@given(st.dictionaries(st.sampled_from(["classes", "mean", "std", "resize", "labels"]), json_values, max_size=4)
       | json_values)
def test_any_sidecar_gives_a_model_or_one_line(sidecar):
    with tempfile.TemporaryDirectory() as tmp:
        path = save_onnx(classifier(), Path(tmp) / "m.onnx", sidecar=sidecar)
        try:
            load_onnx(path, classifier=True)
        except UnsupportedModel as e:
            _one_line_naming(e, "m.onnx")


@PROPERTY
@given(st.dictionaries(st.sampled_from(["classes", "mean", "std", "resize"]),
                       json_values.map(json.dumps) | st.text(max_size=8), max_size=3))
def test_any_metadata_gives_a_model_or_one_line(metadata):
    with tempfile.TemporaryDirectory() as tmp:
        path = save_onnx(classifier(), Path(tmp) / "m.onnx", metadata=metadata)
        try:
            load_onnx(path, classifier=True)
        except UnsupportedModel as e:
            _one_line_naming(e, "m.onnx")


numbers = st.integers(min_value=-3, max_value=10**6).map(str) | st.text(max_size=6)
locations = st.sampled_from(["m.onnx.data", "m.onnx", "../m.onnx.data", "/etc/hostname", "", ".", "sub/x"]) \
    | st.text(max_size=10)


@PROPERTY
@given(st.fixed_dictionaries({}, optional={"offset": numbers, "length": numbers, "location": locations}))
def test_any_external_data_fields_give_a_model_or_one_line(fields):
    with tempfile.TemporaryDirectory() as tmp:
        path = with_external_data(save_onnx(classifier(), Path(tmp) / "m.onnx"), **fields)
        try:
            read_onnx(path)
        except (UnsupportedModel, TrustError) as e:
            _one_line_naming(e, "m.onnx")
