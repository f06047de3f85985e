"""Reconstruction SNR by depth, and where it goes: the engine, the float32 block inverse, float32 storage.

For ``revnext`` and ``layerwise`` at 1, 2, 4 and 8 blocks (or layer triples) per level, at init, batch 8,
32x32, one step, against the float64 forward of the same weights (the truth):

* ``diagnose_min_db``: ``edgerev diagnose``'s minimum (the engine's float32 reconstruction against the
  float32 plain forward; the two references agree to about 128 dB, so this is the engine's own error);
* ``engine_vs_float64_min_db``: the same reconstruction against the float64 truth;
* ``floor_diagnose_min_db``, ``floor_vs_float64_min_db``: the same two with every hybrid block in ``floor``
  mode, which runs ``F`` and ``G`` forward on copies of the block's halves instead of rebuilding the
  halves through the layer inverses (the CPU's way);
* ``floor_restoring_diagnose_min_db``: ``floor`` the way a GPU runs it (``Execution.floor_restore``), which
  rebuilds the halves through the layer inverses, twice per chain;
* ``block_inverse_min_db``: a float32 forward, then float32 stage inverses one after another, each
  block's halves restored by the block inverse alone (what the authors' ``RevBlock`` does with copies
  of ``y1`` and ``x2``; edgerev's ``invert`` backward instead recovers them through ``G``'s and ``F``'s layer
  inverses, in place, to hold 2.5 activation volumes rather than 3);
* ``storage_floor_min_db``: the float64 forward's top activation rounded once to float32, every inverse
  in float64: what storing the top in float32 alone costs, for any engine;
* ``rms_bottom`` / ``rms_top``: the stream's RMS at the first block's input and at the top.

    python benchmarks/snr_depth.py --out results/snr_depth.json
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json
from torch import Tensor, nn

from edgerev.diagnostics import depth_overrides, diagnose
from edgerev.engine import executing, plain, supported_modes
from edgerev.memory.measure.peak import set_modes
from edgerev.models import create_model


def _snr(ref: Tensor, est: Tensor) -> float | None:
    err = (ref.double() - est.double()).pow(2).sum().item()
    return None if err == 0 else 10 * math.log10(ref.double().pow(2).sum().item() / err)


def _min(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(min(values), 1) if values else None


def _module_inputs(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    names = {m: n for n, m in model.named_modules()}
    seen: dict[str, Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a: seen.setdefault(names[mod], a[0].detach().clone()))
             for m in model.body.modules() if m is not model.body]
    with plain(model), torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def _stage_inputs(model: nn.Module, x: Tensor) -> tuple[list[Tensor], Tensor]:
    """Inputs of stages 1.. (the stem convolution is stored, never inverted) and the top activation."""
    stages = list(model.body.stages)
    ins = []
    with torch.no_grad():
        h = stages[0](x)
        for s in stages[1:]:
            ins.append(h.clone())
            h = s(h)
    return ins, h


def _invert(model: nn.Module, top: Tensor) -> list[Tensor]:
    """Stage inverses from the top down, each with the statistics of the last forward."""
    recs = []
    with torch.no_grad():
        h = top
        for s in reversed(list(model.body.stages)[1:]):
            h = s.inverse(h)
            recs.append(h)
    return recs[::-1]


def measure(arch: str, depth: int, batch: int = 8, size: int = 32, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = create_model(arch, **depth_overrides(arch, depth)).train()
    m64 = copy.deepcopy(model).double()
    x = torch.randn(batch, model.in_channels, size, size)
    target = torch.randint(0, model.num_classes, (batch,))
    truth = _module_inputs(m64, x.double())

    def engine_db(modes: str | None) -> float | None:
        got: dict[str, Tensor] = {}
        engine = copy.deepcopy(model)
        if modes is not None:
            set_modes(engine, modes)
        names = {m: n for n, m in engine.named_modules()}
        with executing(engine, probe=lambda mod, t: got.setdefault(names[mod], t.detach().clone())):
            F.cross_entropy(engine(x), target).backward()
        return _min(_snr(truth[n], t) for n, t in got.items() if n in truth and truth[n].shape == t.shape)

    true_ins, top64 = _stage_inputs(m64, x.double())
    stored = _invert(m64, top64.float().double())
    m32 = copy.deepcopy(model)
    _, top32 = _stage_inputs(m32, x)
    blockwise = _invert(m32, top32)
    rms = lambda t: round(t.pow(2).mean().sqrt().item(), 2)  # noqa: E731
    d = diagnose(arch, depth=depth, batch=batch, size=size, seed=seed)
    floor = "floor" in {m.value for s in model.body.stages for m in supported_modes(s)}
    df = diagnose(arch, depth=depth, batch=batch, size=size, seed=seed, modes="floor") if floor else None
    dr = diagnose(arch, depth=depth, batch=batch, size=size, seed=seed, modes="floor", floor_restore=True) \
        if floor else None
    return {
        "depth": depth,
        "invertible_stages": d["invertible_stages"],
        "diagnose_min_db": round(d["min_snr_db"], 1) if d["min_snr_db"] is not None else None,
        "diagnose_min_param_cosine": d["min_param_cosine"],
        "engine_vs_float64_min_db": engine_db(None),
        "floor_diagnose_min_db": round(df["min_snr_db"], 1) if df and df["min_snr_db"] is not None else None,
        "floor_diagnose_min_param_cosine": df["min_param_cosine"] if df else None,
        "floor_vs_float64_min_db": engine_db("floor") if floor else None,
        "floor_restoring_diagnose_min_db": round(dr["min_snr_db"], 1) if dr and dr["min_snr_db"] is not None
        else None,
        "floor_restoring_diagnose_min_param_cosine": dr["min_param_cosine"] if dr else None,
        "block_inverse_min_db": _min(_snr(t, r) for t, r in zip(true_ins, blockwise)),
        "storage_floor_min_db": _min(_snr(t, r) for t, r in zip(true_ins, stored)),
        "rms_bottom": rms(true_ins[0]),
        "rms_top": rms(top64),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--archs", nargs="+", default=["revnext", "layerwise"])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    result = {"setup": {"batch": 8, "size": 32, "seed": 0, "dtype": "float32 against a float64 forward"},
              "by_arch": {a: [measure(a, d) for d in args.depths] for a in args.archs}}
    write_json(result, args.out)


if __name__ == "__main__":
    main()
