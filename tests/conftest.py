import os

import pytest
import torch
from hypothesis import settings

# Hypothesis fails an example that runs longer than 200 ms by default: a timing test in disguise, which a
# loaded machine turns red. Speed is measured in benchmarks/, not here.
settings.register_profile("edgerev", deadline=None)
settings.load_profile("edgerev")

# the tests use tiny shapes: one thread is faster than two fighting over them
torch.set_num_threads(1)
# ... and so do the processes the tests start (the daemon, the kill -9 children, the CLI). With one OpenMP
# thread per core, a training step whose threads spin-wait for each other while another process holds a core
# ran 4.7x slower in wall time (6x the CPU time) on a loaded 2-core machine: that, not the sleeps, is what
# stretched the suite from minutes to half an hour under load.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
