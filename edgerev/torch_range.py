"""The PyTorch releases edgerev supports, and the one-line warning for a torch outside them.

The range is set by the devices edgerev is deployed on, not by the newest torch: a Jetson on JetPack 6 runs
NVIDIA's PyTorch 2.6 (``2.6.0a0+df5bbc09d1.nv24.12`` in the NGC 24.12 iGPU image, deploy/Dockerfile.jetson),
and a GTX 750 needs 2.14.x, the last release with CUDA 12.6 wheels and so with ``sm_50`` kernels
(deploy/GTX750.md). CI runs the whole test suite on 2.14.1 and the training, export and daemon paths on 2.6.0
(``.ci/run``). pyproject.toml declares the same range as ``torch>=2.6.0a0,<2.15``: the ``a0`` admits NVIDIA's
pre-release-numbered 2.6 build, which pip would otherwise replace with a PyPI wheel that cannot use the Jetson's
GPU (tests/test_torch_range.py checks that both places agree).

Outside the range edgerev warns once, at import of its model code, and goes on: a newer torch usually works
(and a user may know it does), an older one fails later at a specific place (the ONNX export first). A refusal
would stop both for what is only a likely problem. Silence it by its message (``-W`` cannot name a category in a
package): ``python -W "ignore:edgerev supports torch"`` or ``PYTHONWARNINGS="ignore:edgerev supports torch"``.
"""

from __future__ import annotations

import re
import warnings

#: (major, minor) of the oldest supported release, and of the first release past the range
OLDEST = (2, 6)
FIRST_UNSUPPORTED = (2, 15)
#: the releases CI tests, one at each end
TESTED = ("2.6.0", "2.14.1")


class UnsupportedTorchWarning(UserWarning):
    """The installed torch lies outside the releases edgerev supports."""


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string, or None if it has none.

    Only the release counts: ``2.6.0a0+df5bbc09d1.nv24.12`` (NVIDIA's Jetson build) is 2.6, ``2.14.1+cu126`` 2.14.
    """
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def problem(version: str) -> str | None:
    """One line saying why torch ``version`` is outside the supported range, or None inside it."""
    r = release(version)
    if r is not None and OLDEST <= r < FIRST_UNSUPPORTED:
        return None
    lo, hi = ".".join(map(str, OLDEST)), f"{FIRST_UNSUPPORTED[0]}.{FIRST_UNSUPPORTED[1] - 1}"
    return (f"edgerev supports torch {lo} to {hi} (tested with {' and '.join(TESTED)}), but torch {version} is "
            f"installed: expect failures (ONNX export first); install torch>={lo},<{FIRST_UNSUPPORTED[0]}."
            f"{FIRST_UNSUPPORTED[1]}")


def warn_if_unsupported(version: str | None = None) -> bool:
    """Warn with :class:`UnsupportedTorchWarning` if torch is outside the range.

    Args:
        version: a torch version string; default: the installed torch's.

    Returns:
        True if a warning was issued.
    """
    if version is None:
        import torch

        version = str(torch.__version__)
    text = problem(version)
    if text is None:
        return False
    warnings.warn(text, UnsupportedTorchWarning, stacklevel=2)
    return True
