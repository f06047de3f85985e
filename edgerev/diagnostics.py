"""Numerical diagnostics of the memory-saving backward: reconstruction SNR and gradient angles.

The backward rebuilds every stage input (and, inside hybrid blocks, every layer input) from the
layer above. Rounding errors grow through chains of layer inverses: batch norm amplifies them by
the spread of its scales, leaky ReLU by ``1/slope`` on negative entries. This module measures, on
one training step in float32:

* the SNR (dB) of every reconstructed input against the input the plain forward computed,
  ``10 log10(|x|^2 / |x - x_rec|^2)``; exact reconstructions (pooling) report ``null``;
* the angle (degrees) between the engine's parameter gradient and the plain-autograd gradient of
  the same weights on the same batch, per stage.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.engine import executing, plain
from edgerev.layers.base import Invertible
from edgerev.models import create_model


def snr_db(reference: Tensor, estimate: Tensor) -> float | None:
    """``10 log10(|ref|^2 / |ref - est|^2)``; None when the two are identical."""
    ref = reference.double()
    err = (ref - estimate.double()).pow(2).sum().item()
    if err == 0.0:
        return None
    return 10.0 * math.log10(max(ref.pow(2).sum().item(), 1e-300) / err)


def angle_deg(a: Tensor, b: Tensor) -> float:
    """Angle between two tensors seen as vectors, in degrees (0 when both are zero)."""
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    if na == 0.0 and nb == 0.0:
        return 0.0
    if na == 0.0 or nb == 0.0:
        return 90.0
    cos = max(-1.0, min(1.0, (a @ b).item() / (na * nb)))
    return math.degrees(math.acos(cos))


def depth_overrides(arch: str, depth: int) -> dict:
    """Registry overrides that put ``depth`` blocks (or layer triples) at every level."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    levels = {"revnext": ("blocks", 5), "layerwise": ("layers", 5), "revnet": ("blocks", 4),
              "irevnet": ("blocks", 3)}
    if arch not in levels:
        return {}
    key, n = levels[arch]
    return {key: (depth,) * n}


def _names(model: nn.Module) -> dict[nn.Module, str]:
    return {m: name for name, m in model.named_modules()}


def diagnose(arch: str, depth: int | None = None, batch: int = 8, size: int = 32, seed: int = 0,
             modes: str | None = None, floor_restore: bool | None = None, **overrides) -> dict:
    """One float32 training step of ``arch`` through the engine and through plain autograd.

    ``modes`` sets engine modes as ``edgerev memory --mode`` does (default: each stage's own); ``floor_restore``
    the way floor stages run (``Execution.floor_restore``; None: the CPU's, by slices).
    Returns per-stage and per-layer reconstruction SNR and per-stage gradient angles (JSON-ready).
    """
    from edgerev.memory.measure.peak import set_modes

    if depth is not None:
        overrides = {**depth_overrides(arch, depth), **overrides}
    torch.manual_seed(seed)
    model = create_model(arch, **overrides)
    if modes is not None:
        set_modes(model, modes, arch)
    model.train()
    x = torch.randn(batch, model.in_channels, size, size)
    target = torch.randint(0, model.num_classes, (batch,))
    names = _names(model)

    # reference: inputs of every module as the plain forward computed them, and plain gradients
    inputs: dict[nn.Module, Tensor] = {}

    def record(mod: nn.Module, args: tuple) -> None:
        inputs.setdefault(mod, args[0].detach().clone())

    hooks = [m.register_forward_pre_hook(record) for m in model.body.modules() if m is not model.body]
    with plain(model):
        F.cross_entropy(model(x), target).backward()
    for h in hooks:
        h.remove()
    ref_grads = {p: p.grad.clone() for p in model.parameters()}
    model.zero_grad(set_to_none=True)

    stage_ids = {s: i for i, s in enumerate(model.body.stages)}
    stage_rows: dict[int, dict] = {}
    layer_rows: list[dict] = []

    def probe(module: nn.Module, rec: Tensor) -> None:
        ref = inputs.get(module)
        if ref is None or ref.shape != rec.shape:
            return
        row = {"name": names.get(module, type(module).__name__), "type": type(module).__name__,
               "snr_db": snr_db(ref, rec)}
        if module in stage_ids:
            stage_rows[stage_ids[module]] = row
        else:
            layer_rows.append(row)

    with executing(model, probe=probe, floor_restore=floor_restore):
        F.cross_entropy(model(x), target).backward()

    stages = []
    for i, (stage, mode) in enumerate(zip(model.body.stages, model.body.modes)):
        params = [p for p in stage.parameters()]
        row = stage_rows.get(i, {"name": names[stage], "type": type(stage).__name__, "snr_db": None})
        row = {"index": i, "mode": str(mode), **row}
        if params:
            row["grad_angle_deg"] = angle_deg(torch.cat([p.grad.flatten() for p in params]),
                                              torch.cat([ref_grads[p].flatten() for p in params]))
        stages.append(row)
    snrs = [r["snr_db"] for r in stages + layer_rows if r["snr_db"] is not None]
    angles = [r["grad_angle_deg"] for r in stages if "grad_angle_deg" in r]
    cos = [F.cosine_similarity(p.grad.flatten().double(), ref_grads[p].flatten().double(), dim=0).item()
           for p in model.parameters() if ref_grads[p].norm() > 0]
    return {
        "arch": arch,
        "depth": depth,
        "batch": batch,
        "size": size,
        "invertible_stages": sum(1 for s in model.body.stages if isinstance(s, Invertible)),
        "min_snr_db": min(snrs) if snrs else None,
        "max_grad_angle_deg": max(angles) if angles else None,
        "min_param_cosine": min(cos) if cos else None,
        "stages": stages,
        "layers": layer_rows,
    }
