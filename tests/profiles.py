"""Cost profiles shared by the planner and CLI tests: measured once per test process, or recorded in tests/data.

Measuring a profile runs every stage in every mode on fake and real tensors (about 6 s for the small RevNeXt
below, 20 s for the default one at 32x32), so the tests measure the small models once and read the default
models' profiles from JSON files recorded on a CPU with::

    python -c "import json, torch; torch.manual_seed(0); from edgerev.models import create_model; \\
    from edgerev.memory.measure.profile import measure_profile; p = measure_profile(create_model('revnext'), 32); \\
    json.dump(p.to_json(), open('tests/data/profile-revnext-32-cpu.json', 'w'), separators=(',', ':'))"

(and the same for resnet18; recorded with PROFILE_VERSION 1, whose JSON layout is what ``Profile.from_json``
reads). Only their bytes and their structure matter to the tests, not their seconds.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
from pathlib import Path

from torch import nn

from edgerev.memory.measure.profile import measure_profile
from edgerev.memory.solve.costs import Profile
from edgerev.models import create_model

DATA = Path(__file__).parent / "data"

#: a RevNeXt with every level but one block, at stem width 8: ten stages, all five modes
SMALL_REVNEXT = ("revnext", (("width", 8), ("blocks", (1, 1, 1, 1, 1))))
#: a ResNet-18 at base width 8: eleven stored stages (store, store8, store4)
SMALL_RESNET = ("resnet18", (("width", 8),))


def small_model(spec: tuple = SMALL_REVNEXT) -> nn.Module:
    arch, overrides = spec
    return create_model(arch, **dict(overrides))


#: where a run's workers share the profiles :func:`measured` makes (set by tests/conftest.py; None: each process
#: measures its own)
SHARED: Path | None = None


@functools.cache
def measured(spec: tuple = SMALL_REVNEXT, size: int = 16) -> Profile:
    """The measured profile of ``small_model(spec)`` at ``size`` (measured once per run, by the first worker that
    asks, the others wait for it and read it; do not modify).

    Seconds are timed at batches 4 and 8, twice: the tests check bytes, which do not depend on it (nor on which
    worker measured them).
    """
    if SHARED is None:
        return measure_profile(small_model(spec), size, batches=(4, 8), repeats=2)
    SHARED.mkdir(parents=True, exist_ok=True)
    path = SHARED / f"{spec[0]}-{hashlib.sha256(repr(spec).encode()).hexdigest()[:12]}-{size}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return Profile.from_json(json.loads(path.read_text()))
        prof = measure_profile(small_model(spec), size, batches=(4, 8), repeats=2)
        path.write_text(json.dumps(prof.to_json()))
        return prof


@functools.cache
def recorded(arch: str, size: int = 32) -> Profile:
    """A profile of the default ``arch`` measured on a CPU and kept in tests/data."""
    return Profile.from_json(json.loads((DATA / f"profile-{arch}-{size}-cpu.json").read_text()))
