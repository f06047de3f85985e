"""Every supported op against ONNX Runtime (onnx's reference evaluator past opset 21) on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from edgerev.errors import UnsupportedModel
from tests.onnx_import.graphs import INT64_MAX, OPSETS, ORT_MAX_OPSET, assert_matches, init, model, node

pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 4, 8, 8)).astype(np.float32)


def w(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


def flat(op: str, inputs, **attrs):
    """Flatten the image, then ``op``: for the ops of classifier heads."""
    return [node("Flatten", ["X"], ["F"]), node(op, ["F", *inputs], **attrs)]


def axes_input(opset: int, name: str, axes, since: int = 13):
    """(extra node inputs, initializers): axes as an input from ``since`` on, else as the attribute."""
    if opset >= since:
        return [name], [init(name, np.array(axes, np.int64))], {}
    return [], [], {"axes": axes}


def _reduce_mean(opset: int, axes, keepdims: int):
    ins, inits, attrs = axes_input(opset, "ax", axes, since=18)
    return [node("ReduceMean", ["X", *ins], keepdims=keepdims, **attrs)], inits


def _split(opset: int):
    nodes = [node("Split", ["X", "s"], ["a", "b"], axis=1), node("Concat", ["b", "a"], axis=1)]
    equal = ([node("Split", ["X"], ["a", "b"], axis=1, **({"num_outputs": 2} if opset >= 18 else {})),
              node("Concat", ["b", "a"], axis=1)])
    return nodes, [init("s", np.array([1, 3], np.int64))], equal


def _reduce_l2(opset: int):
    ins, inits, attrs = axes_input(opset, "ax", [1], since=18)
    return [node("ReduceL2", ["X", *ins], ["n"], keepdims=1, **attrs), node("Shape", ["X"], ["sh"]),
            node("Expand", ["n", "sh"], ["e"]), node("Div", ["X", "e"])], inits  # F.normalize over the channels


def _gather_reversed_batch(opset: int):
    """The batch in reverse order, by a Gather whose indices a Range computes from the batch size (as the dynamo
    exporter writes as_strided): they are computed when the model runs."""
    one = init("one", np.array(1, np.int64))
    return ([node("Shape", ["X"], ["sh"], start=0, end=1), node("Squeeze", ["sh", "a0"], ["b"]),
             node("Range", ["zero", "b", "one"], ["r"]), node("Sub", ["b", "one"], ["last"]),
             node("Sub", ["last", "r"], ["rev"]), node("Gather", ["X", "rev"], axis=0)],
            [init("a0", np.array([0], np.int64)), init("zero", np.array(0, np.int64)), one])


def _grid_into_conv(opset: int):
    """A positional grid computed from the input's shape alone (ConstantOfShape, CumSum, Sin: EdgeNeXt's Fourier
    encoding) through a Conv whose weights train, added to the input."""
    return ([node("Shape", ["X"], ["sh"]),
             node("ConstantOfShape", ["sh"], ["ones"], value=init("v", np.array([1.0], np.float32))),
             node("CumSum", ["ones", "ax"], ["cs"]), node("Sin", ["cs"], ["s"]),
             node("Conv", ["s", "W"], ["c"], pads=[1, 1, 1, 1]), node("Add", ["X", "c"])],
            [init("ax", np.array(2, np.int64)), init("W", w(4, 4, 3, 3))])


# name -> opset -> (nodes, initializers)
CASES = {
    "reduce_l2_expand": _reduce_l2,
    "gather_reversed_batch": _gather_reversed_batch,
    "grid_into_conv": _grid_into_conv,
    "conv": lambda o: ([node("Conv", ["X", "W", "B"], pads=[1, 1, 1, 1])], [init("W", w(6, 4, 3, 3)), init("B", w(6))]),
    "conv_grouped": lambda o: ([node("Conv", ["X", "W"], group=2, strides=[2, 2], pads=[1, 1, 1, 1])],
                               [init("W", w(6, 2, 3, 3))]),
    "conv_depthwise": lambda o: ([node("Conv", ["X", "W", "B"], group=4, dilations=[2, 2], pads=[2, 2, 2, 2])],
                                 [init("W", w(4, 1, 3, 3)), init("B", w(4))]),
    "conv_asymmetric": lambda o: ([node("Conv", ["X", "W"], strides=[2, 2], pads=[0, 1, 1, 0])],
                                  [init("W", w(3, 4, 3, 3))]),
    "conv_same_upper": lambda o: ([node("Conv", ["X", "W"], strides=[2, 2], auto_pad="SAME_UPPER")],
                                  [init("W", w(3, 4, 4, 4))]),
    "conv_same_lower": lambda o: ([node("Conv", ["X", "W"], auto_pad="SAME_LOWER")], [init("W", w(3, 4, 2, 2))]),
    "conv_valid": lambda o: ([node("Conv", ["X", "W"], auto_pad="VALID")], [init("W", w(3, 4, 3, 3))]),
    "conv_transpose": lambda o: ([node("ConvTranspose", ["X", "W", "B"], strides=[2, 2], pads=[1, 1, 1, 1],
                                       output_padding=[1, 1])], [init("W", w(4, 3, 3, 3)), init("B", w(3))]),
    "conv_transpose_asymmetric": lambda o: ([node("ConvTranspose", ["X", "W"], strides=[2, 2], pads=[0, 1, 1, 0],
                                                  group=2)], [init("W", w(4, 2, 3, 3))]),
    "conv_transpose_asymmetric_ungrouped": lambda o: ([node("ConvTranspose", ["X", "W"], strides=[2, 2],
                                                            pads=[1, 0, 0, 2])], [init("W", w(4, 2, 3, 3))]),
    "batch_norm": lambda o: ([node("BatchNormalization", ["X", "s", "b", "m", "v"], epsilon=1e-3)],
                             [init("s", w(4)), init("b", w(4)), init("m", w(4)),
                              init("v", np.abs(w(4)) + 0.5)]),
    "relu": lambda o: ([node("Relu", ["X"])], []),
    "relu6": lambda o: ([node("Clip", ["X", "lo", "hi"])], [init("lo", np.float32(0)), init("hi", np.float32(6))]),
    "clip": lambda o: ([node("Clip", ["X", "lo", "hi"])], [init("lo", np.float32(-0.5)), init("hi", np.float32(.3))]),
    "clip_max_only": lambda o: ([node("Clip", ["X", "", "hi"])], [init("hi", np.float32(0.2))]),
    "leaky_relu": lambda o: ([node("LeakyRelu", ["X"], alpha=0.2)], []),
    "prelu": lambda o: ([node("PRelu", ["X", "p"])], [init("p", w(4, 1, 1))]),
    "prelu_scalar": lambda o: ([node("PRelu", ["X", "p"])], [init("p", w(1))]),
    "sigmoid": lambda o: ([node("Sigmoid", ["X"])], []),
    "hard_sigmoid": lambda o: ([node("HardSigmoid", ["X"], alpha=0.3, beta=0.4)], []),
    "hard_swish": lambda o: ([node("HardSwish", ["X"])], []),
    "tanh": lambda o: ([node("Tanh", ["X"])], []),
    "erf": lambda o: ([node("Erf", ["X"])], []),
    "gelu_by_erf": lambda o: (  # the TorchScript exporter's GELU
        [node("Div", ["X", "r2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["a"]),
         node("Mul", ["X", "a"], ["m"]), node("Mul", ["m", "half"])],
        [init("r2", np.float32(2 ** 0.5)), init("one", np.float32(1.0)), init("half", np.float32(0.5))]),
    "gelu": lambda o: ([node("Gelu", ["X"])], []),
    "gelu_tanh": lambda o: ([node("Gelu", ["X"], approximate="tanh")], []),
    "softmax_channels": lambda o: ([node("Softmax", ["X"], axis=1)], []),
    "log_softmax": lambda o: ([node("LogSoftmax", ["X"], axis=1)], []),
    "softmax_final": lambda o: (flat("Softmax", []), []),
    "add": lambda o: ([node("Add", ["X", "c"])], [init("c", w(4, 1, 1))]),
    "sub": lambda o: ([node("Sub", ["c", "X"])], [init("c", w(1, 4, 1, 8))]),
    "mul": lambda o: ([node("Relu", ["X"], ["r"]), node("Mul", ["X", "r"])], []),
    "div": lambda o: ([node("Div", ["X", "c"])], [init("c", np.abs(w(8)) + 1)]),
    "constant": lambda o: ([node("Constant", [], ["c"], value=init("v", w(4, 1, 1))), node("Add", ["X", "c"])], []),
    "concat": lambda o: ([node("Relu", ["X"], ["r"]), node("Concat", ["X", "r"], axis=1)], []),
    "split": lambda o: _split(o)[:2],
    "split_equal": lambda o: (_split(o)[2], []),
    "slice": lambda o: ([node("Slice", ["X", "s", "e", "a", "t"])],
                        [init("s", np.array([1, -6], np.int64)), init("e", np.array([INT64_MAX, 7], np.int64)),
                         init("a", np.array([2, 3], np.int64)), init("t", np.array([2, 1], np.int64))]),
    "slice_default_axes": lambda o: ([node("Slice", ["X", "s", "e"])],
                                     [init("s", np.array([0, 1], np.int64)), init("e", np.array([1, 3], np.int64))]),
    "reshape": lambda o: ([node("Reshape", ["X", "s"])], [init("s", np.array([0, 8, -1], np.int64))]),
    "reshape_from_shape": lambda o: ([node("Shape", ["X"], ["sh"]), node("Gather", ["sh", "i"], ["b"], axis=0),
                                      node("Unsqueeze", ["b", "ax"], ["bu"]) if o >= 13 else None,
                                      node("Concat", ["bu", "m1"], ["t"], axis=0), node("Reshape", ["X", "t"])],
                                     [init("i", np.array(0, np.int64)), init("ax", np.array([0], np.int64)),
                                      init("m1", np.array([-1], np.int64))], ["N", 256]),
    "reshape_shape_slice": lambda o: ([node("Shape", ["X"], ["sh"], start=0, end=2),
                                       node("Concat", ["sh", "m1"], ["t"], axis=0), node("Reshape", ["X", "t"])],
                                      [init("m1", np.array([-1], np.int64))]),
    # torch's dynamo exporter without optimization: the batch read, squeezed, reshaped to a vector, then [batch, n]
    "reshape_batch_from_shape": lambda o: ([node("Shape", ["X"], ["sh"], start=0, end=1),
                                            node("Squeeze", ["sh", "a0"], ["b"]), node("Reshape", ["b", "m1"], ["v"]),
                                            node("Concat", ["v", "f"], ["t"], axis=0), node("Reshape", ["X", "t"])],
                                           [init("a0", np.array([0], np.int64)), init("m1", np.array([-1], np.int64)),
                                            init("f", np.array([256], np.int64))]),
    "layer_norm": lambda o: ([node("LayerNormalization", ["X", "s", "b"], epsilon=1e-3)],
                             [init("s", w(8)), init("b", w(8))]),
    "layer_norm_channels": lambda o: ([node("LayerNormalization", ["X", "s"], axis=1)], [init("s", w(4, 8, 8))]),
    # timm's MobileViT from the TorchScript exporter: the batch times the channels as a Reshape target's first entry
    "reshape_batch_times": lambda o: ([node("Shape", ["X"], ["sh"]), node("Gather", ["sh", "i"], ["b"], axis=0),
                                       node("Mul", ["b", "k"], ["bk"]), node("Unsqueeze", ["bk", "ax"], ["bu"]),
                                       node("Concat", ["bu", "m1"], ["t"], axis=0), node("Reshape", ["X", "t"])],
                                      [init("i", np.array(0, np.int64)), init("k", np.array(4, np.int64)),
                                       init("ax", np.array([0], np.int64)), init("m1", np.array([8, 8], np.int64))],
                                      ["M", 8, 8]),
    # torchvision's ShuffleNetV2 from the TorchScript exporter: a Slice's end is arithmetic on a shape, which onnx's
    # shape inference does not follow; the channel shuffle's target divides the slice's channels
    "reshape_of_unknown_sizes": lambda o: (
        [node("Shape", ["X"], ["sh"]), node("Gather", ["sh", "one"], ["c"], axis=0), node("Add", ["c", "one"], ["c1"]),
         node("Div", ["c1", "two"], ["half"]), node("Unsqueeze", ["half", "ax"], ["e"]),
         node("Slice", ["X", "zero", "e", "ax1"], ["S"]), node("Shape", ["S"], ["ss"]),
         node("Gather", ["ss", "zero0"], ["n"], axis=0), node("Gather", ["ss", "one"], ["sc"], axis=0),
         node("Div", ["sc", "two"], ["g"]), node("Unsqueeze", ["n", "ax"], ["nu"]),
         node("Unsqueeze", ["g", "ax"], ["gu"]), node("Concat", ["nu", "two1", "gu", "m1"], ["t"], axis=0),
         node("Reshape", ["S", "t"])],
        [init("one", np.array(1, np.int64)), init("two", np.array(2, np.int64)),
         init("zero0", np.array(0, np.int64)), init("ax", np.array([0], np.int64)),
         init("ax1", np.array([1], np.int64)), init("zero", np.array([0], np.int64)),
         init("two1", np.array([2], np.int64)), init("m1", np.array([-1], np.int64))], ["N", 2, 1, 128]),
    "flatten": lambda o: ([node("Flatten", ["X"])], []),
    "flatten_axis2": lambda o: ([node("Flatten", ["X"], axis=2)], []),
    "transpose": lambda o: ([node("Transpose", ["X"], perm=[0, 2, 3, 1])], []),
    "unsqueeze": lambda o: ([node("Unsqueeze", ["X", *axes_input(o, "ax", [1, -1])[0]],
                                  **axes_input(o, "ax", [1, -1])[2])], axes_input(o, "ax", [1, -1])[1]),
    "squeeze": lambda o: ([node("ReduceMean", ["X", *axes_input(o, "r", [2], 18)[0]],  ["m"], keepdims=1,
                                **axes_input(o, "r", [2], 18)[2]),
                           node("Squeeze", ["m", *axes_input(o, "ax", [2])[0]], **axes_input(o, "ax", [2])[2])],
                          axes_input(o, "ax", [2])[1] + axes_input(o, "r", [2], 18)[1]),
    "global_average_pool": lambda o: ([node("GlobalAveragePool", ["X"])], []),
    "global_max_pool": lambda o: ([node("GlobalMaxPool", ["X"])], []),
    "average_pool": lambda o: ([node("AveragePool", ["X"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
                               []),
    "average_pool_include_pad": lambda o: ([node("AveragePool", ["X"], kernel_shape=[3, 3], pads=[1, 0, 1, 0],
                                                 count_include_pad=1)], []),
    "average_pool_ceil": lambda o: ([node("AveragePool", ["X"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)],
                                    []),
    "max_pool": lambda o: ([node("MaxPool", ["X"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])], []),
    "max_pool_asymmetric": lambda o: ([node("MaxPool", ["X"], kernel_shape=[2, 2], strides=[2, 2],
                                            pads=[0, 0, 1, 1])], []),
    "max_pool_same_upper": lambda o: ([node("MaxPool", ["X"], kernel_shape=[3, 3], strides=[2, 2],
                                            auto_pad="SAME_UPPER")], []),
    "max_pool_ceil": lambda o: ([node("MaxPool", ["X"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)], []),
    "reduce_mean": lambda o: _reduce_mean(o, [2, 3], 1),
    "reduce_mean_flat": lambda o: _reduce_mean(o, [-1, 1], 0),
    "gemm": lambda o: (flat("Gemm", ["W", "B"], transB=1), [init("W", w(5, 256)), init("B", w(5))]),
    "gemm_alpha_beta": lambda o: (flat("Gemm", ["W", "B"], alpha=0.5, beta=2.0),
                                  [init("W", w(256, 5)), init("B", w(1, 5))]),
    "gemm_no_bias": lambda o: (flat("Gemm", ["W"], transB=1), [init("W", w(5, 256))]),
    "matmul": lambda o: (flat("MatMul", ["W"]), [init("W", w(256, 5))]),
    "matmul_add": lambda o: (flat("MatMul", ["W"])[:1] + [node("MatMul", ["F", "W"], ["M"]),
                                                         node("Add", ["M", "B"])], [init("W", w(256, 5)),
                                                                                    init("B", w(5))]),
    "matmul_computed": lambda o: ([node("Transpose", ["X"], ["T"], perm=[0, 1, 3, 2]), node("MatMul", ["X", "T"])],
                                  []),
    "pad_constant": lambda o: ([node("Pad", ["X", "p", "v"])],
                               [init("p", np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)), init("v", np.float32(0.5))]),
    "pad_reflect": lambda o: ([node("Pad", ["X", "p"], mode="reflect")],
                              [init("p", np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64))]),
    "pad_edge": lambda o: ([node("Pad", ["X", "p"], mode="edge")],
                           [init("p", np.array([0, 0, 2, 0, 0, 0, 0, 3], np.int64))]),
    "pad_crop": lambda o: ([node("Pad", ["X", "p"])], [init("p", np.array([0, 1, -1, 0, 0, 0, 0, -2], np.int64))]),
    "resize_nearest": lambda o: ([node("Resize", ["X", "", "s"], mode="nearest",
                                       coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
                                 [init("s", np.array([1, 1, 2, 2], np.float32))]),
    "resize_nearest_half_pixel": lambda o: ([node("Resize", ["X", "", "s"], mode="nearest",
                                                  nearest_mode="round_prefer_ceil")],
                                            [init("s", np.array([1, 1, 0.5, 1.5], np.float32))]),
    "resize_linear": lambda o: ([node("Resize", ["X", "", "s"], mode="linear")],
                                [init("s", np.array([1, 1, 2, 1.5], np.float32))]),
    "resize_linear_align_corners": lambda o: ([node("Resize", ["X", "", "", "z"], mode="linear",
                                                    coordinate_transformation_mode="align_corners")],
                                              [init("z", np.array([2, 4, 5, 11], np.int64))]),
    "resize_cubic": lambda o: ([node("Resize", ["X", "", "s"], mode="cubic")],
                               [init("s", np.array([1, 1, 2, 2], np.float32))]),
    "resize_sizes_from_shape": lambda o: ([node("Shape", ["X"], ["sh"], start=0, end=2),
                                           node("Concat", ["sh", "hw"], ["z"], axis=0),
                                           node("Resize", ["X", "", "", "z"], mode="linear")],
                                          [init("hw", np.array([12, 12], np.int64))]),
    "identity": lambda o: ([node("Identity", ["X"])], []),
    "dropout": lambda o: ([node("Dropout", ["X", "r"])], [init("r", np.float32(0.3))]),
    "gather": lambda o: ([node("Gather", ["X", "i"], axis=1)], [init("i", np.array([3, 0], np.int64))]),
    "gather_scalar": lambda o: ([node("Gather", ["X", "i"], axis=2)], [init("i", np.array(5, np.int64))]),
    "cast": lambda o: ([node("Cast", ["X"], to=TensorProto.FLOAT)], []),
    "cast_like": lambda o: ([node("CastLike", ["X", "t"])], [init("t", np.array([1.0], np.float32))]),
}


#: cases whose op or form an opset introduced (HardSwish 14, Shape's start and end 15, LayerNormalization 17,
#: Gelu 20)
SINCE = {"hard_swish": 14, "layer_norm": 17, "layer_norm_channels": 17, "reshape_shape_slice": 15,
          "resize_sizes_from_shape": 15, "cast_like": 15,
         "reshape_batch_from_shape": 15, "gelu": 20, "gelu_tanh": 20, "gather_reversed_batch": 15}
#: cases onnx's reference evaluator computes wrongly or not at all (ONNX Runtime checks them up to opset 21)
REFERENCE_LACKS = {"conv_transpose_asymmetric": "grouped ConvTranspose", "pad_crop": "negative pads"}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_the_reference(case, opset, tmp_path):
    if opset < SINCE.get(case, 0):
        pytest.skip(f"{case} needs opset {SINCE[case]}")
    if opset > ORT_MAX_OPSET and case in REFERENCE_LACKS:
        pytest.skip(f"onnx's reference evaluator lacks {REFERENCE_LACKS[case]}")
    nodes, inits, *out_shape = CASES[case](opset)
    m = model([n for n in nodes if n is not None], X.shape, inits=inits, opset=opset,
              out_shape=out_shape[0] if out_shape else None)
    assert_matches(m, tmp_path, X)


def test_the_ops_that_make_weights_are_the_layer_ops(tmp_path):
    """LAYER_OPS (what the import computes at run time when a value of shapes reaches it) is read from the converters
    themselves: a case whose import holds parameters has a layer op, and every layer op makes them in some case (not
    in every one: a MatMul of two computed values has none)."""
    from edgerev.models.onnx_import import load_onnx
    from edgerev.models.onnx_import.ops import LAYER_OPS
    from tests.onnx_import.graphs import save

    seen = set()
    for case in sorted(CASES):
        opset = max(SINCE.get(case, 0), min(OPSETS))
        nodes, inits, *out_shape = CASES[case](opset)
        nodes = [n for n in nodes if n is not None]
        m = model(nodes, X.shape, inits=inits, opset=opset, out_shape=out_shape[0] if out_shape else None)
        trains = any(True for _ in load_onnx(save(m, tmp_path / f"{case}.onnx")).parameters())
        ops = {n.op_type for n in nodes}
        assert not trains or ops & LAYER_OPS, (case, ops)
        seen |= ops & LAYER_OPS if trains else set()
    assert seen == LAYER_OPS  # every layer op was seen making weights


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 4), s=st.integers(1, 3), d=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       pads=st.lists(st.integers(0, 2), min_size=4, max_size=4), size=st.integers(7, 10),
       auto=st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
def test_conv_attributes(k, s, d, group, pads, size, auto, tmp_path):
    x = RNG.standard_normal((2, 4, size, size + 1)).astype(np.float32)
    attrs = {"pads": pads} if auto == "NOTSET" else {"auto_pad": auto}
    if auto.startswith("SAME"):
        d = 1  # ONNX Runtime's SAME padding ignores dilation
    m = model([node("Conv", ["X", "W", "B"], strides=[s, s], dilations=[d, d], group=group, **attrs)], x.shape,
              inits=[init("W", w(4, 4 // group, k, k)), init("B", w(4))])
    assert_matches(m, tmp_path, x)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["MaxPool", "AveragePool"]), k=st.integers(1, 4), s=st.integers(1, 3),
       pads=st.lists(st.integers(0, 1), min_size=4, max_size=4), ceil=st.integers(0, 1), include=st.integers(0, 1),
       size=st.integers(6, 9))
def test_pool_attributes(kind, k, s, pads, ceil, include, size, tmp_path):
    pads = [min(p, k // 2) for p in pads]
    if kind == "AveragePool" and not include:
        pads = pads[:2] * 2  # torch cannot exclude asymmetric padding from the average: refused, tested apart
    attrs = {"count_include_pad": include} if kind == "AveragePool" else {}
    x = RNG.standard_normal((2, 3, size, size)).astype(np.float32)
    m = model([node(kind, ["X"], kernel_shape=[k, k], strides=[s, s], pads=pads, ceil_mode=ceil, **attrs)], x.shape)
    try:
        assert_matches(m, tmp_path, x)
    except UnsupportedModel as e:  # the one refusal: a ceil window past the input, where the runtimes disagree
        assert "ceil_mode" in str(e) and ceil
        spans = [size + pads[i] + pads[2 + i] - k for i in range(2)]
        assert any(span % s and (kind == "AveragePool" or (span // s + 1) * s >= size + pads[i]) for i, span in
                   enumerate(spans))


@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["nearest", "linear", "cubic"]), sh=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
       sw=st.sampled_from([0.5, 1.25, 2.0]), align=st.booleans())
def test_resize_scales(mode, sh, sw, align, tmp_path):
    if mode == "nearest":
        attrs = ({"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"} if align
                 else {"nearest_mode": "round_prefer_ceil"})
    else:
        attrs = {"coordinate_transformation_mode": "align_corners" if align else "half_pixel"}
    m = model([node("Resize", ["X", "", "s"], mode=mode, **attrs)], X.shape,
              inits=[init("s", np.array([1, 1, sh, sw], np.float32))])
    assert_matches(m, tmp_path, X, atol=1e-4)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pads=st.lists(st.integers(0, 3), min_size=4, max_size=4), mode=st.sampled_from(["constant", "reflect", "edge"]))
def test_pad_spatial(pads, mode, tmp_path):
    full = np.array([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]], np.int64)
    m = model([node("Pad", ["X", "p"], mode=mode)], X.shape, inits=[init("p", full)])
    assert_matches(m, tmp_path, X)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(-10, 10), end=st.integers(-10, 10), step=st.integers(1, 3), axis=st.integers(1, 3))
def test_slice(start, end, step, axis, tmp_path):
    m = model([node("Slice", ["X", "s", "e", "a", "t"])], X.shape,
              inits=[init("s", np.array([start], np.int64)), init("e", np.array([end], np.int64)),
                     init("a", np.array([axis], np.int64)), init("t", np.array([step], np.int64))])
    if any(d == 0 for d in onnx_out_shape(m)):
        return  # an empty slice: nothing to compare
    assert_matches(m, tmp_path, X)


def onnx_out_shape(m) -> list[int]:
    return [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim[1:]]


def test_the_docs_list_every_op():
    from pathlib import Path

    from edgerev.models.onnx_import.ops import OPS

    page = (Path(__file__).parents[2] / "docs" / "reference" / "onnx-ops.md").read_text()
    table = page.split("## Ops", 1)[1].split("**Folded at import.**", 1)[0]
    listed = {name.strip() for row in table.splitlines() if row.startswith("| ") and "---" not in row
              for name in row.split("|")[1].replace(" to float32", "").split(",")}
    assert set(OPS) | {"Constant", "Shape"} <= listed
