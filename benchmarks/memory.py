"""Memory figures of the reversible core, written as JSON.

* the five architectures at the paper's setting (batch 32, 240x240), predicted with fake tensors,
  and measured for real with the CPU tracker at 32x32 (or on CUDA with ``--device cuda``);
* depth independence: RevNeXt with every level's block count doubled, against the default.

    python benchmarks/memory.py --out results/memory.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import write_json

from edgerev.cli import PAPER_PEAK_BYTES, PAPER_PIXELS
from edgerev.memory.measure.peak import measure
from edgerev.models import create_model


def depth_check(batch: int, size: int, device: str, fake: bool) -> dict:
    """Peak of revnext against revnext with twice the hybrid blocks at every level."""
    base_blocks = (2, 2, 2, 2, 3)
    deep_blocks = tuple(2 * b for b in base_blocks)
    base = measure("revnext", batch, size, device=device, fake=fake, blocks=base_blocks)
    deep = measure("revnext", batch, size, device=device, fake=fake, blocks=deep_blocks)
    e = next(create_model("revnext").parameters()).element_size()
    extra_weights = (deep["params"] - base["params"]) * e
    allowed = 2 * extra_weights + 0.01 * base["peak_bytes"]
    growth = deep["peak_bytes"] - base["peak_bytes"]
    return {
        "batch": batch, "size": size, "device": device, "fake": fake,
        "blocks": [list(base_blocks), list(deep_blocks)],
        "invertible_stages": [sum(base_blocks) + 4, sum(deep_blocks) + 4],
        "peak_bytes": [base["peak_bytes"], deep["peak_bytes"]],
        "peak_growth_bytes": growth,
        "extra_weight_bytes": extra_weights,
        "allowed_growth_bytes": allowed,
        "growth_over_extra_weights_and_grads": growth - 2 * extra_weights,
        "ok": growth <= allowed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--real-size", type=int, default=32)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    archs = list(PAPER_PEAK_BYTES)
    result = {
        "torch": torch.__version__,
        "paper_setting_predicted": [measure(n, 32, 240, fake=True) for n in archs],
        "measured": [measure(n, 32, a.real_size, device=a.device) for n in archs],
        "depth": [depth_check(32, a.real_size, a.device, False), depth_check(32, 240, "cpu", True)],
        "paper_peak_bytes": PAPER_PEAK_BYTES,
        "paper_bytes_per_pixel": {k: v / PAPER_PIXELS for k, v in PAPER_PEAK_BYTES.items()},
    }
    write_json(result, a.out)


if __name__ == "__main__":
    main()
