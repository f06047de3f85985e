"""What an imported ONNX model looks like from outside: the facts a drop-in replacement must keep.

No torch here: the resolver and the daemon read these facts before deciding to build a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgerev.errors import UnsupportedModel

LAYOUTS = ("NCHW", "NHWC")


@dataclass(frozen=True)
class OnnxIO:
    """The original file's interface, kept so the exported update loads where the original did.

    Attributes:
        input_name: the graph input's name.
        input_shape: its shape, ``None`` where a dimension is dynamic (the batch always is).
        layout: ``NCHW`` or ``NHWC``, from where the channel axis lies.
        dtype: the input's element type (``float32``: the only one imported).
        output_names: the graph outputs' names (one: a classifier's scores).
        output_shape: the output's shape, ``None`` where dynamic.
        batch_name: the symbolic name of the batch dimension in the original file.
        opset: the file's default-domain opset.
        softmax_axis: the axis of a final Softmax the import dropped so training runs on logits, or None. The
            export keeps the original's Softmax, so the exported file outputs probabilities as the original did.
        classes: class names from the file's metadata or the sidecar, in output order, or ``()``.
        mean, std: per-channel normalization ``(pixels / 255 - mean) / std`` the model expects, or ``()``.
        resize: the side images are resized to before a center crop to ``input_shape``, or None.
        fixed_batch: the batch size the file fixed (exporters without a dynamic batch write 1), or None. The
            import makes the batch dynamic; the export keeps the file's input shape.
    """

    input_name: str
    input_shape: tuple[int | None, ...]
    layout: str
    dtype: str
    output_names: tuple[str, ...]
    output_shape: tuple[int | None, ...]
    batch_name: str
    opset: int
    softmax_axis: int | None = None
    classes: tuple[str, ...] = ()
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    resize: int | None = None
    fixed_batch: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise UnsupportedModel(f"io.layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if len(self.input_shape) != 4:
            raise UnsupportedModel(f"io.input_shape: an image input has 4 dimensions, got {self.input_shape}")
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise UnsupportedModel("io.mean, io.std: one mean and one positive std per channel")
        if self.mean and len(self.mean) != self.in_channels:
            raise UnsupportedModel(f"io.mean: {len(self.mean)} values for {self.in_channels} input channels")

    @property
    def in_channels(self) -> int:
        """Channels of the image input."""
        c = self.input_shape[1] if self.layout == "NCHW" else self.input_shape[3]
        return int(c or 0)

    @property
    def image_size(self) -> int | None:
        """Height and width of the input when both are fixed and equal, else None."""
        h, w = (self.input_shape[2:] if self.layout == "NCHW" else self.input_shape[1:3])
        return h if h is not None and h == w else None
