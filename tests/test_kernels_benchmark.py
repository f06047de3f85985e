"""benchmarks/kernels.py, the kernel-count benchmark: its counts on a tiny RevNeXt, and the JSON it writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernels.py"
TINY = {"width": 4}


def _load_script():
    """benchmarks/kernels.py as a module (benchmarks/ is not a package; ``kernels`` is also a PyPI name)."""
    sys.path.insert(0, str(SCRIPT.parent))  # for its own imports (_common)
    try:
        spec = importlib.util.spec_from_file_location("edgerev_kernels_benchmark", SCRIPT)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


kernels = _load_script()


def test_a_step_counts_more_kernels_inverted_than_stored_by_autograd():
    plain = kernels.count_row("revnext", "plain", batch=2, size=16, overrides=TINY)
    invert = kernels.count_row("revnext", "invert", batch=2, size=16, overrides=TINY)
    for row in (plain, invert):
        assert set(row) >= {"ops", "ops_by_phase", "flops", "top_ops"}
        assert isinstance(row["ops"], int) and row["ops"] > 0 and row["flops"] > 0
        assert sum(row["ops_by_phase"].values()) == row["ops"]
        assert all(row["ops_by_phase"][p] > 0 for p in kernels.PHASES)
        assert 0 < len(row["top_ops"]) <= 10 and sum(row["top_ops"].values()) <= row["ops"]
        assert not set(row["top_ops"]) & (kernels.NOT_KERNELS | kernels.SYNCS)
    assert plain["ops"] < invert["ops"]
    assert plain["flops"] < invert["flops"]  # the backward rebuilds the activations it did not keep


def test_the_trainers_step_launches_a_few_kernels_beyond_the_bare_step_whatever_the_model_s_size():
    """The optimizer's update, the saved batch-norm statistics and the value checks run over all tensors at once
    (multi-tensor ops): on a GPU a fixed few launches a step, not one or more per parameter or buffer."""
    small = kernels.host_syncs("revnext", "invert", overrides={**TINY, "blocks": [1, 1, 1, 1, 1]})
    large = kernels.host_syncs("revnext", "invert", overrides=TINY)
    assert small["host_syncs"] == large["host_syncs"] == 1  # the step's one read: its loss and checks
    assert small["trainer_extra_ops"] == large["trainer_extra_ops"] <= 16


def test_floor_rows_count_and_account_the_way_a_gpu_runs_it():
    """A floor row is one step, the GPU's way (its chains' gradient maps undone; ``Execution.floor_restore``),
    wherever it is counted or accounted: its ops are those of that way, not of the CPU's by slices, and its peak is
    the fake-tensor account of that way."""
    from edgerev.engine import executing
    from edgerev.memory.measure.peak import fake_step_peak

    row = kernels.count_row("revnext", "floor", batch=2, size=16, overrides=TINY)
    peak = kernels.peak_row("revnext", "floor", batch=2, size=16, overrides=TINY)["peak_bytes"]
    counts = {}
    for way in (True, False):
        model = kernels.build("revnext", TINY)
        kernels.configure(model, "floor")
        with executing(model, floor_restore=way):
            counts[way] = sum(kernels.count_step(model, 2, 16).ops.values())
    assert row["ops"] == counts[True] != counts[False]
    model = kernels.build("revnext", TINY)
    model.set_modes("floor")
    modes = tuple(str(m) for m in model.body.modes)
    assert peak == fake_step_peak(model, modes, 2, 16, floor_restore=True)


@pytest.mark.slow
def test_the_json_has_a_row_per_mode_with_its_ratios_to_plain_autograd(tmp_path):
    out = tmp_path / "kernels.json"
    result = kernels.main(["--models", "revnext", "--modes", "invert", "--width", "4", "--batch", "2",
                           "--sizes", "16", "--plan-sizes", "", "--jobs", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["counted_on"] == "meta" and result["planned"] == []
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "invert"}
    for r in rows.values():
        assert (r["model"], r["batch"], r["size"]) == ("revnext", 2, 16)
        for key in ("ops", "flops", "peak_bytes", "host_syncs"):
            assert isinstance(r[key], int) and r[key] >= 0, (key, r)
        assert r["ops"] > 0 and r["peak_bytes"] > 0
    assert rows["plain"]["ops_vs_plain"] == rows["plain"]["flops_vs_plain"] == 1.0
    assert rows["invert"]["ops_vs_plain"] > 1 and rows["invert"]["flops_vs_plain"] > 1
    assert rows["invert"]["peak_bytes_vs_plain"] < 1  # what invert is for


@pytest.mark.slow
def test_the_quantizer_is_counted_fused_as_cuda_runs_it_and_eager_on_request(tmp_path):
    """store8's rows count the fused quantizer (each operator at its launches) unless ``--eager-quantizer``, which
    counts the CPU's eager kernels: more of them, for the same FLOPs; the JSON says which it counted."""
    def store8(*extra):
        result = kernels.main(["--models", "revnext", "--modes", "store8", "--width", "4", "--batch", "2",
                               "--sizes", "16", "--plan-sizes", "", "--jobs", "0", *extra,
                               "--out", str(tmp_path / "k.json")])
        return result, next(r for r in result["rows"] if r["mode"] == "store8")

    fused_json, fused = store8()
    eager_json, eager = store8("--eager-quantizer")
    assert fused_json["quantizer"].startswith("fused") and eager_json["quantizer"] == "eager"
    assert {"encode", "decode"} <= set(fused["top_ops"]) and "encode" not in eager["top_ops"]
    assert fused["ops"] < eager["ops"] and fused["flops"] == eager["flops"]


def test_caps_are_a_factor_of_a_modes_peak_or_bytes():
    """``--caps`` takes ``MODE:FACTOR`` (a plan waits for that mode's peak) and byte sizes (the issue's 610 MB: a
    plan of its own, nothing to wait for); anything else is refused by name."""
    a = kernels.parse(["--models", "revnext", "--sizes", "", "--plan-sizes", "240",
                       "--caps", "floor:1.10,610MB", "--out", "k.json"])
    assert a.caps == [("floor", 1.10), ("bytes", 610e6)]
    plans = {t.key: t for t in kernels.tasks_for(a) if t.kind == "plan"}
    assert plans[("plan", 240, "floor", 1.10)].reference == ("peak", "revnext", "floor", 32, 240)
    absolute = plans[("plan", 240, "bytes", 610e6)]
    assert absolute.reference is None and absolute.kwargs["budget"] == 610_000_000
    with pytest.raises(SystemExit):
        kernels.parse(["--caps", "floor", "--out", "k.json"])
