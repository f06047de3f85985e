import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

from edgerev.source_tree import map_package_dirs

# the daemon's tests and the CLI's import edgerev_daemon: from a checkout that was never installed (a lent
# GPU machine without network runs ``PYTHONPATH=. python -m pytest -m gpu``) it is the daemon/ folder
map_package_dirs()

# What the suite can do without: a machine that lacks one (the GPU machine has no Flower, no onnxscript, and
# maybe no hypothesis) skips the test files that import it, saying which, instead of failing their collection.
OPTIONAL = {"hypothesis": "hypothesis", "flwr": "Flower (pip install 'edgerev[fleet]')", "onnxscript": "onnxscript"}

if importlib.util.find_spec("hypothesis") is not None:
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
# torch.compile (the fused quantizer's tests) compiles in a pool of worker processes by default: on two cores
# beside the other xdist worker, starting that pool cost more than it saved (86 s against 52 s, cold cache)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def gpu_memory_of_its_own(request):
    """A GPU test starts from what it makes: what earlier tests left is collected and the cache emptied, and the
    allocator's peaks are reset (the caps and peaks these tests read are the process's); the allocator's cap is
    lifted after it. A test that caps the allocator runs in a process of its own (``tests.helpers.own_process``)."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)  # a cap a test (or the trainer it ran) set is not the next one's


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory):
    """The stage profiles the tests measure, in the run's temporary folder and shared by its workers: never in the
    user's cache (``~/.cache/edgerev``), which a later run would read back where CI, on a fresh machine, measures
    again. The cache writes each file whole through a rename, so two workers measuring at once is safe. A test that
    needs an empty cache sets its own; an ``EDGEREV_CACHE`` the caller set is kept."""
    if os.environ.get("EDGEREV_CACHE"):
        yield Path(os.environ["EDGEREV_CACHE"])
        return
    from tests import profiles

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "edgerev-cache"
    os.environ["EDGEREV_CACHE"] = str(root)
    profiles.SHARED = root.with_name("measured-profiles")  # tests/profiles.py's, beside it: no cache reads them
    try:
        yield root
    finally:
        os.environ.pop("EDGEREV_CACHE", None)
        profiles.SHARED = None


def pytest_collection_modifyitems(config, items):
    # The longest tests (a minute or more each) go first, then the other slow ones, then the rest: a worker
    # that started a long test late ran it alone while the other was idle (the README page's run, once
    # collected late, ended a run by itself for 8 minutes). A stable sort: the order is otherwise pytest's.
    items.sort(key=lambda item: (item.get_closest_marker("longest") is None, item.get_closest_marker("slow") is None))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (a GPU machine may lack it) the hook does not exist
def pytest_xdist_make_scheduler(config, log):
    """With workers (``-n``), a worker that runs out of tests takes half of what another has queued (xdist's
    ``worksteal``). The default (``load``) queues each worker's first tests in one block up front: the long tests
    sorted to the front all went to one worker, which ran them while the other finished early. ``-n`` alone sets
    ``--dist load``, so an explicit ``--dist load`` cannot be told from it and takes ``worksteal`` too; any other
    ``--dist`` is the caller's."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test file whose import fails for want of an optional package (``OPTIONAL``) is skipped, naming it."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    found = re.search(r"No module named '([\w.]+)'", str(report.longrepr))
    name = found.group(1).split(".")[0] if found else None
    if name in OPTIONAL and importlib.util.find_spec(name) is None:
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"Skipped: needs {OPTIONAL[name]}, not installed")
