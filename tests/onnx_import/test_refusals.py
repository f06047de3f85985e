"""What the import refuses: one line naming the file, node and op type where there is one; nothing written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgerev.errors import UnsupportedModel
from edgerev.models.onnx_import import check_onnx
from tests.onnx_import.graphs import init, model, node, save

PAGE = "docs/reference/onnx-ops.md"


def refused(path) -> str:
    before = sorted(p.name for p in path.parent.iterdir())
    with pytest.raises(UnsupportedModel) as e:
        check_onnx(path)
    assert sorted(p.name for p in path.parent.iterdir()) == before  # nothing written
    text = str(e.value)
    assert "\n" not in text and path.name in text
    return text


def good() -> onnx.ModelProto:
    return model([node("Conv", ["X", "W"], ["c"]), node("GlobalAveragePool", ["c"], ["g"]), node("Flatten", ["g"])],
                 (1, 3, 8, 8), inits=[init("W", np.ones((4, 3, 3, 3), np.float32))])


def test_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("these are not the weights you are looking for\n" * 20)
    assert "not an ONNX model" in refused(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    assert "not an ONNX model" in refused(path)


def test_truncated_file(tmp_path):
    data = good().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    assert "truncated" in refused(path)


def test_missing_external_data(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(good(), str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    (tmp_path / "m.data").unlink()
    text = refused(path)
    assert "'m.data'" in text and "missing" in text and "'W'" in text


def test_truncated_external_data(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(good(), str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    data = (tmp_path / "m.data").read_bytes()
    (tmp_path / "m.data").write_bytes(data[:10])
    assert "truncated" in refused(path)


def test_unsupported_op(tmp_path):
    m = model([node("Cos", ["X"], ["c"]), node("Relu", ["c"])], (1, 3, 8, 8))
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "node 'cos_c' (Cos) is not supported" in text and PAGE in text


def test_op_of_another_domain(tmp_path):
    m = good()
    m.graph.node.append(helper.make_node("FusedGemm", ["Y"], ["Z"], name="fused", domain="com.microsoft"))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    m.graph.output[0].name = "Z"
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "'fused' (com.microsoft.FusedGemm)" in text and PAGE in text


def test_old_opset(tmp_path):
    m = good()
    m.opset_import[0].version = 12
    assert "opset 12" in refused(save(m, tmp_path / "m.onnx"))


def test_float64_input(tmp_path):
    m = model([node("Relu", ["X"])], (1, 3, 8, 8), in_type=TensorProto.DOUBLE, out_shape=["N", 3, 8, 8])
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    assert "double" in refused(save(m, tmp_path / "m.onnx"))


def test_float16_weights(tmp_path):
    m = model([node("Cast", ["X"], ["h"], to=TensorProto.FLOAT16), node("Conv", ["h", "W"], ["c"]),
               node("Cast", ["c"], to=TensorProto.FLOAT)], (1, 3, 8, 8),
              inits=[init("W", np.ones((4, 3, 3, 3), np.float16))])
    assert "'W' holds float16" in refused(save(m, tmp_path / "m.onnx"))


def test_integer_tensor_at_run_time(tmp_path):
    m = model([node("Cast", ["X"], ["i"], to=TensorProto.INT64), node("Cast", ["i"], to=TensorProto.FLOAT)],
              (1, 3, 8, 8))
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "(Cast)" in text and "float32" in text


def test_cast_like_an_integer_at_run_time(tmp_path):
    m = model([node("CastLike", ["X", "k"], ["i"]), node("Cast", ["i"], to=TensorProto.FLOAT)], (1, 3, 8, 8),
              inits=[init("k", np.array([1], np.int64))], opset=15)
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "(CastLike)" in text and "int64" in text


def test_shape_that_is_not_constant(tmp_path):
    # the batch plus one: shape arithmetic on a dynamic dimension that does not fold (a multiple of it does)
    m = model([node("Shape", ["X"], ["s"]), node("Add", ["s", "one"], ["t"]), node("Reshape", ["X", "t"], ["r"]),
               node("Relu", ["r"])], (1, 3, 8, 8), inits=[init("one", np.array([1, 0, 0, 0], np.int64))],
              out_shape=[None, 3, 8, 8])
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "(Reshape)" in text and "'t'" in text and PAGE in text


def test_reshape_to_a_multiple_of_the_batch_that_does_not_hold_the_data(tmp_path):
    # the batch doubled folds to 2*N, but [2N, 3, 8, 8] cannot hold [N, 3, 8, 8]: torch's -1 would have taken N
    m = model([node("Shape", ["X"], ["s"]), node("Mul", ["s", "two"], ["t"]), node("Reshape", ["X", "t"], ["r"]),
               node("Relu", ["r"])], (1, 3, 8, 8), inits=[init("two", np.array([2, 1, 1, 1], np.int64))],
              out_shape=[None, 3, 8, 8])
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "(Reshape)" in text and "192 elements per sample into [2*N, 3, 8, 8]" in text and PAGE in text


def test_resize_to_a_computed_size(tmp_path):
    m = model([node("GlobalMaxPool", ["X"], ["g"]), node("Cast", ["g"], ["i"], to=TensorProto.INT64),
               node("Reshape", ["i", "four"], ["z"]), node("Resize", ["X", "", "", "z"])], (1, 3, 8, 8),
              inits=[init("four", np.array([4], np.int64))], out_shape=[None, None, None, None])
    assert "(Cast)" in refused(save(m, tmp_path / "m.onnx"))


def test_two_image_inputs(tmp_path):
    m = model([node("Add", ["X", "X2"])], (1, 3, 8, 8),
              extra_inputs=[helper.make_tensor_value_info("X2", TensorProto.FLOAT, ["N", 3, 8, 8])])
    text = refused(save(m, tmp_path / "m.onnx"))
    assert "2 inputs ('X', 'X2')" in text


def test_two_outputs(tmp_path):
    m = good()
    m.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", 4, 6, 6]))
    assert "2 outputs" in refused(save(m, tmp_path / "m.onnx"))


def test_negative_slice_step(tmp_path):
    m = model([node("Slice", ["X", "s", "e", "a", "t"])], (1, 3, 8, 8),
              inits=[init("s", np.array([-1], np.int64)), init("e", np.array([-9], np.int64)),
                     init("a", np.array([3], np.int64)), init("t", np.array([-1], np.int64))])
    assert "negative step" in refused(save(m, tmp_path / "m.onnx"))


def test_no_such_file(tmp_path):
    with pytest.raises(UnsupportedModel, match="no such file"):
        check_onnx(tmp_path / "absent.onnx")
