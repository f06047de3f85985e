"""What a user reads runs: the README's and the guides' commands, the presets, the paths the docs name.

Each fenced ``sh`` block (bash, ``set -euo pipefail``) and ``python`` block of a page runs in order in one
scratch folder per page; a block is skipped only under a marker that names what CI lacks (docs/testing-docs.md
says which marker means what, and what runs instead). The quick checks here run in every suite; running the
pages trains models for minutes, so those are marked slow.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: the pages whose commands a user follows: run by test_page_runs
RUN_PAGES = [README, DOCS / "install.md", *sorted((DOCS / "guides").glob("*.md")), DOCS / "reference" / "commands.md"]
#: every Markdown text a user reads: checked for markers, cited paths and stale statements
TEXTS = [README, ROOT / "configs" / "README.md", ROOT / "deploy" / "README.md", ROOT / "deploy" / "GTX750.md",
         *sorted(p for p in DOCS.rglob("*.md"))]
MARKERS = ("network", "root", "docker", "gpu", "data", "forever", "slow")
MARKER = re.compile(r"<!-- docs: (.*?) -->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MAX_README_LINES = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # what the block needs that CI lacks, or None: it runs


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, each with the marker right above it."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        before = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = MARKER.fullmatch(before)
        marker = mk.group(1).removeprefix("not-run ").strip() if mk else None
        out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", marker))
        i += 1
    return out


def tracked() -> set[str]:
    """Files in a checkout: tracked, or new and not ignored (results/ and runs/ are ignored: never in one)."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    return set(r.stdout.splitlines())


def _configref():
    spec = importlib.util.spec_from_file_location("configref", DOCS / "_tools" / "configref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- quick checks


@pytest.mark.parametrize("page", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_markers_are_known_and_sit_above_a_block(page):
    lines = page.read_text().splitlines()
    for n, line in enumerate(lines):
        m = MARKER.fullmatch(line.strip())
        if not m:  # a marker is a line of its own; one named in a sentence or a table is not one
            continue
        assert m.group(1).startswith("not-run "), f"{page.name}:{n + 1}: unknown marker {m.group(0)}"
        what = m.group(1).removeprefix("not-run ").strip()
        assert what in MARKERS, f"{page.name}:{n + 1}: unknown marker {what!r}; known: {', '.join(MARKERS)}"
        nxt = next((x for x in lines[n + 1:] if x.strip()), "")
        fence = FENCE.match(nxt)
        assert fence and fence.group(2), f"{page.name}:{n + 1}: a marker must sit right above a code block"


def test_the_marker_table_names_every_marker():
    text = (DOCS / "testing-docs.md").read_text()
    for m in MARKERS:
        assert f"<!-- docs: not-run {m} -->" in text, f"docs/testing-docs.md does not say what '{m}' means"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; details belong in docs/ (at most {MAX_README_LINES})"


def _ci() -> str:
    return (ROOT / ".ci" / "run").read_text()


def test_readme_setup_lines_are_cis():
    """The README's first two commands: the demo in one environment, the tests in another, as CI builds it."""
    first = blocks(README)[0]
    assert first.lang == "sh" and first.marker == "network"
    demo, tests = first.code.strip().splitlines()
    ci = _ci()
    pin = re.search(r"pip install --quiet (torch==\S+)", ci).group(1)
    extras = re.search(r"pip install --quiet -e '(\.\[[^]]+\])'", ci).group(1)
    test_command = re.search(r"^(python -m pytest -q -n auto)$", ci, re.M).group(1)
    assert f"pip install {pin} " in tests and f"pip install -e '{extras}'" in tests and tests.endswith(test_command)
    assert f"pip install {pin} " in demo and demo.endswith("&& edgerev daemon demo")
    venvs = [re.match(r"python3 -m venv (\S+) ", line).group(1) for line in (demo, tests)]
    assert venvs[0] != venvs[1], "runtime and ort-training both install onnxruntime: two environments"
    assert "'.[runtime]'" in demo and "ort-training" not in demo


def test_torch_pins_agree_with_ci():
    """Every torch==X a user is told to install is CI's newest end (2.6.0 is CI's oldest, named only there)."""
    pin = re.search(r"pip install --quiet torch==(\S+)", _ci()).group(1)
    files = [*TEXTS, ROOT / "deploy" / "Dockerfile.cuda"]
    for path in files:
        for v in re.findall(r"torch==([0-9][\w.+]*)", path.read_text()):
            assert v == pin, f"{path.relative_to(ROOT)} pins torch=={v}; CI tests torch=={pin}"
    for v in re.findall(r"ARG TORCH_VERSION=(\S+)", (ROOT / "deploy" / "Dockerfile.cuda").read_text()):
        assert v == pin, f"deploy/Dockerfile.cuda builds torch {v}; CI tests {pin}"


TOP = ("edgerev", "daemon", "configs", "deploy", "benchmarks", "tests", "docs", ".ci", "results")
PATHLIKE = re.compile(r"`([\w.-]+(?:/[\w.*<>{}-]+)+/?)(?:::\w+)?`")


def _cited(page: Path) -> set[str]:
    """Repository paths a page names: in backticks (from the repository root) or as relative links."""
    text = page.read_text()
    found = {m.group(1) for m in PATHLIKE.finditer(text) if m.group(1).split("/")[0] in TOP}
    for m in re.finditer(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
        target = (page.parent / m.group(1)).resolve()
        found.add(str(target.relative_to(ROOT)) if target.is_relative_to(ROOT) else m.group(1))
    return {f for f in found if not any(c in f for c in "*<>{}") and "NNNN" not in f}


@pytest.mark.parametrize("page", [p for p in TEXTS if "reference/configuration" not in str(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_files_are_tracked(page):
    """A file the docs name must be in every checkout (results/ and runs/ are outputs git ignores)."""
    files = tracked()
    dirs = {str(p) for f in files for p in Path(f).parents}
    for cited in sorted(_cited(page)):
        assert not cited.startswith("results/"), f"{page.name} cites {cited}: results/ is ignored by git"
        path = cited.rstrip("/")
        assert path in files or path in dirs, f"{page.name} cites {cited}, which is not in a checkout"


def test_config_reference_is_current():
    assert not _configref().stale(), "docs/reference/configuration.md is stale: python docs/_tools/configref.py --write"


def test_config_reference_names_every_key():
    """Every field of every config class appears with its full key path (the generator walks them all)."""
    import dataclasses

    from edgerev_daemon.config import DaemonConfig

    page = (DOCS / "reference" / "configuration.md").read_text()
    for f in dataclasses.fields(DaemonConfig.__dataclass_fields__["promotion"].default_factory()):
        assert f"`promotion.{f.name}`" in page
    assert "`training.memory.profile`" in page and "`memory.mode`" in page and "`data.train.kind`" in page


def test_every_preset_loads_and_validates():
    from edgerev.fleet.simulate import load_simulation
    from edgerev.train.config import load_config as load_recipe
    from edgerev_daemon.config import load_config as load_daemon

    loaders = {"configs": load_recipe, "configs/daemon": load_daemon, "configs/fleet": load_simulation}
    presets = sorted((ROOT / "configs").rglob("*.yaml"))
    assert presets
    for p in presets:
        folder = str(p.parent.relative_to(ROOT))
        assert folder in loaders, f"{p.relative_to(ROOT)}: no test loads presets of {folder}/"
        loaders[folder](p)


def test_the_cpu_preset_is_writable_by_its_user():
    """configs/daemon/cpu.yaml runs as a normal user; /var/lib/edgerev is the service's (root-made) directory."""
    import yaml

    data_dir = yaml.safe_load((ROOT / "configs" / "daemon" / "cpu.yaml").read_text())["data_dir"]
    assert not data_dir.startswith("/var/"), data_dir


STALE = {
    "three exact modes": "there are four exact modes (invert, floor, recompute, store)",
    "Xavier NX class": "deploy/ supports JetPack 6, which a Xavier cannot run",
    "diverges at high lr without it": "the paper's stem and head removed the divergence (benchmarks/high_lr.py)",
    "Defaults are the paper's recipe": "the defaults are one-cycle, warm-up 0.25, batch 128: after the paper",
    "the paper's CIFAR-10 recipe": "configs/cifar10.yaml is after the paper (one-cycle, clipping), not its recipe",
    "torch>=2.2": "the supported range is torch>=2.6.0a0,<2.15",
}


@pytest.mark.parametrize("path", [*TEXTS, *sorted((ROOT / "configs").rglob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stale_statement(path):
    text = path.read_text()
    for phrase, why in STALE.items():
        assert phrase not in text, f"{path.relative_to(ROOT)} says {phrase!r}: {why}"
    for n, line in enumerate(text.splitlines()):
        if "promotion.tolerance" in line:
            assert "gone" in line or "removed" in line, f"{path.name}:{n + 1}: promotion.tolerance was replaced"


def test_rollback_and_rebuild_are_never_run_beside_the_service():
    """Both take the data directory's lock: every place that runs them on a service says to stop it first."""
    for page in TEXTS:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if not re.search(r"daemon (rollback|rebuild) --config /etc", line):
                continue
            context = " ".join(lines[max(0, n - 2):n + 1]).lower()
            assert "stop" in context, f"{page.name}:{n + 1}: runs rollback/rebuild without stopping the daemon"


# ------------------------------------------------------------------------------------------------ the pages


def _env(home: Path, cache: Path) -> dict:
    env = dict(os.environ)
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HOME=str(home),
               OMP_NUM_THREADS="1", EDGEREV_CACHE=str(cache), MPLCONFIGDIR=str(home / ".mpl"), PYTHONPATH=str(ROOT))
    return env


def _run_forever(block: Block, cwd: Path, env: dict) -> None:
    """A service block: start it, wait until it serves, stop it with SIGTERM: it must exit cleanly."""
    (command,) = [line.split("#")[0].strip() for line in block.code.splitlines() if line.strip()]
    proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "serving " in line:
                break
        else:
            pytest.fail(f"{block.page.name}:{block.line}: {command} exited before serving:\n{''.join(seen)}")
        proc.send_signal(signal.SIGTERM)
        proc.stderr.read()
        assert proc.wait(timeout=600) == 0, f"{block.page.name}:{block.line}: {command} did not stop cleanly"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _readme_setup(page: Path) -> list[Block]:
    """The README's first command minus the setup CI has done already (the venv and pip lines): the demo."""
    first = blocks(page)[0]
    demo = first.code.strip().splitlines()[0].split(" && ")[-1]
    return [Block(page, first.line, "sh", demo + "\n", None)]


# What the pages train runs small while tested: a page shows the recipe a user runs, the test checks that its
# commands work together and leave what the page says (CHECKS). The recipes' outcomes are tested at full length
# elsewhere: tests/train/test_trainer.py::test_cpu_demo_preset_reaches_its_stated_accuracy (configs/cpu-demo.yaml),
# tests/daemon/service/test_cli.py::test_demo_status_check_rollback (the demo on 300 images, as two guides run
# it: its first model is promoted, status and check agree).

#: the demo while a page runs: 150 images, one job of 8 steps instead of 16 (the fewest for a job is 100). Its
#: first model is still promoted (0.90 on 21 held-out images, chance 0.20), which the pages' checks need.
DEMO = "edgerev daemon demo --images 150"

#: where the demo writes its data directory (``DEMO`` run in a folder that holds none yet)
DEMO_DIR = Path("runs") / "daemon-demo"


#: commands that several pages run alike, each sequence with the folders it writes. They do the same every time
#: (generated images and data, fixed seeds, the page's small presets, a new folder), so the first page to get
#: there runs them in a folder of its own shared by the run's workers, and every page takes a copy of the folders
#: they wrote and of what they printed. A page whose folder holds one of those folders already (the README's
#: second demo, after its first) runs them itself. Each sequence is 15-30 s of a worker on a 2-core machine.
SHARED = {
    (DEMO,): (DEMO_DIR,),  # the README and the daemon, device and labelling guides start so
    ("edgerev train --config configs/cpu-demo.yaml --out runs/demo",): (Path("runs/demo"),),  # training, export
    ("edgerev train --config configs/cpu-demo-old.yaml --out runs/old",  # the README and the continual guide
     "edgerev train --config configs/finetune-demo.yaml --out runs/new"): (Path("runs/old"), Path("runs/new")),
}


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> Path:
    """A folder the run's workers share (beside their temporary folders) for :func:`_shared`."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "docs-shared"


STATEFUL = re.compile(r"\s*(cd|export|source|\.)\s|\s*\w+=")


def _pieces(block: Block, work: Path) -> list[Block | tuple[str, ...]]:
    """``block`` in the order it runs: the lines that run in the page's folder as blocks, and in between each
    sequence of :data:`SHARED` it holds, one command a line, whose folders ``work`` has none of yet (its key). Each
    piece runs in a shell of its own, so a sequence is looked for only above the block's first here-document,
    continued line, or line that sets the shell's state (``cd``, ``export``, a variable)."""
    if block.lang != "sh" or block.marker is not None:
        return [block]
    lines = block.code.splitlines()
    plain = next((i for i, x in enumerate(lines) if "<<" in x or x.endswith("\\") or STATEFUL.match(x)), len(lines))
    said = [(i, " ".join(COMMENT.sub("", x).split())) for i, x in enumerate(lines[:plain])]
    said = [(i, c) for i, c in said if c]
    for k in range(len(said)):
        for key, folders in SHARED.items():
            if tuple(c for _, c in said[k:k + len(key)]) != key or any((work / f).exists() for f in folders):
                continue
            first, last = said[k][0], said[k + len(key) - 1][0]
            before = Block(block.page, block.line, "sh", "\n".join(lines[:first]) + "\n", None)
            after = Block(block.page, block.line + last + 1, "sh", "\n".join(lines[last + 1:]) + "\n", None)
            return [*([before] if before.code.strip() else []), key, *([after] if after.code.strip() else [])]
    return [block]


def _shared(key: tuple[str, ...], work: Path, env: dict, shared: Path) -> str:
    """The commands ``key`` of :data:`SHARED` for ``work``, a page's folder: run once in the run (the first page to
    get there runs them; the others wait for it), their folders copied into ``work``; what they printed."""
    folder = shared / str(list(SHARED).index(key))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        printed = folder / "stdout.txt"
        if not printed.exists():
            ran = folder / "work"
            ran.mkdir(exist_ok=True)
            _configs(ran)
            r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(key)], cwd=ran, env=env,
                               capture_output=True, text=True)
            assert r.returncode == 0, f"{key}: exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
            printed.write_text(r.stdout)
        for f in SHARED[key]:
            shutil.copytree(folder / "work" / f, work / f, symlinks=True)
        return printed.read_text()


#: the presets the pages train, rewritten in a page's scratch configs/ with these keys (the rest are the preset's)
SMALL_PRESETS = {
    name: {"data": {"train": {"samples": 320}, "val": {"samples": 200}}, "train": {"epochs": 1}}
    for name in ("cpu-demo.yaml", "cpu-demo-old.yaml", "finetune-demo.yaml")
}
#: per page, (the text in its blocks, what runs in its place): each must be found, so that an edited page fails
#: here instead of running long unnoticed
SMALL_TEXT = {
    "README.md": [("edgerev daemon demo\n", f"{DEMO}\n"),
                  ("--batch 8 --size 240 --fake", "--batch 8 --size 64 --fake"),  # training.md's, at 64 too
                  ("edgerev daemon demo  ", f"{DEMO}  "),
                  ("train: {kind: synthetic, samples: 1000}", "train: {kind: synthetic, samples: 128}")],
    "docs/guides/daemon.md": [("edgerev daemon demo --images 300\n", f"{DEMO}\n")],
    "docs/guides/device.md": [("edgerev daemon demo\n", f"{DEMO}\n")],
    "docs/guides/labelling.md": [("edgerev daemon demo --images 300\n", f"{DEMO}\n")],
    "docs/guides/training.md": [("train: {kind: synthetic, samples: 1000}", "train: {kind: synthetic, samples: 128}")],
}


#: per page, the page that runs some of its blocks as they are: those blocks run there, not a second time here.
#: The README's "Training under a memory cap" quickstart is the training guide's first two blocks (a minute of
#: CPU in each page's run, the capped recipe's measured profile most of it); a README block whose commands
#: differ from every block of the guide's (comments and spacing aside, after SMALL_TEXT) runs in the README.
RUN_BY = {"README.md": "docs/guides/training.md"}
COMMENT = re.compile(r"(^|\s+)#.*$")


def _commands(block: Block) -> tuple[str, ...]:
    """A block's commands without comments and spacing: what two pages run alike."""
    return tuple(" ".join(c.split()) for c in (COMMENT.sub("", line) for line in block.code.splitlines()) if c.strip())


def _run_elsewhere(page: Path) -> set[tuple[str, ...]]:
    """The commands of the page that runs some of ``page``'s blocks (RUN_BY), each runnable block's."""
    other = RUN_BY.get(str(page.relative_to(ROOT)))
    if other is None:
        return set()
    return {_commands(b) for b in _small(ROOT / other, blocks(ROOT / other))
            if b.marker is None and b.lang in ("sh", "python")}


@dataclass(frozen=True)
class Check:
    """What a page's run must leave behind: files in its scratch folder, and lines its commands print (regular
    expressions searched in the stdout of all its blocks together)."""

    files: tuple[str, ...] = ()
    printed: tuple[str, ...] = ()


DEMO_PRINTS = (r"ingest: \d+ stored", r"ONNX model: \S+\.onnx", r"prediction with ONNX Runtime for ")
HEAD_TUNED = r"trained the head \(numpy [\d.]+\) on \d+ images"
TRAIN_DONE = r"done: \d+ steps, validation accuracy \d\.\d{4}"
CHECKS = {
    "README.md": Check(  # runs/demo, runs/capped and the plan's "predicted peak": the training guide's (RUN_BY)
        files=("runs/daemon-demo/current/model.onnx", "runs/old/summary.json", "runs/old/model.safetensors",
               "runs/new/summary.json", "new.onnx"),
        printed=(*DEMO_PRINTS, r"demo run 2: ", TRAIN_DONE, r"old classes \d\.\d{4}, new classes \d\.\d{4}",
                 r"wrote new\.onnx: [\d,]+ bytes", r"ONNX Runtime against PyTorch: max abs difference",
                 r"example\.png: class\d ", r"^\d+ \d+$")),
    "docs/install.md": Check(printed=(r"^edgerev \S+$",)),
    "docs/guides/bring-your-own-model.md": Check(
        files=("pretrained.onnx", "runs/v1/summary.json", "runs/v2/summary.json", "updated.onnx", "tuned.onnx",
               "runs/lcnet/summary.json", "lcnet.onnx", "lcnet-cli.onnx"),
        printed=(r"^updated\.onnx \[\('image', \['batch', 3, 32, 32\]\)\] \[\('scores', \['batch', 6\]\)\]$",
                 r"wrote updated\.onnx: ", r"images/class5/\S+\.png: class\d ", HEAD_TUNED,
                 r"wrote tuned\.onnx in ", r"^\d+ \d+$")),
    "docs/guides/continual.md": Check(files=("runs/old/summary.json", "runs/new/summary.json"),
                                      printed=(r"'forgetting': ", r"'start_old_acc': ")),
    "docs/guides/daemon.md": Check(
        files=("runs/daemon-demo/current/model.onnx",),
        printed=(*DEMO_PRINTS, r'"current": \{', r"samples, \d+ blobs: consistent")),
    "docs/guides/device.md": Check(
        files=("runs/daemon-demo/current/model.onnx", "mydevice/daemon.yaml"),
        printed=(*DEMO_PRINTS, r"example\.png: class\d ")),
    "docs/guides/export.md": Check(
        files=("runs/demo/summary.json", "demo.onnx", "demo-tuned.onnx"),
        printed=(TRAIN_DONE, r"wrote demo\.onnx: ", r"images/class3/\S+\.png: class\d ", HEAD_TUNED,
                 r"wrote demo-tuned\.onnx in ")),
    "docs/guides/labelling.md": Check(
        files=("runs/daemon-demo/current/model.onnx",),
        printed=(*DEMO_PRINTS, r"questions")),
    "docs/guides/training.md": Check(
        files=("runs/demo/summary.json", "runs/demo/model.safetensors", "runs/capped/summary.json"),
        printed=(TRAIN_DONE, r"done: 2 steps, validation accuracy", r"predicted peak")),
    "docs/reference/commands.md": Check(printed=(r"usage: edgerev ", r"usage: edgerev daemon ")),
}


def _configs(work: Path) -> None:
    """The page's configs/: the repository's, with SMALL_PRESETS rewritten small."""
    import yaml

    from edgerev.config import merged

    (work / "configs").mkdir()
    for entry in (ROOT / "configs").iterdir():
        if entry.name in SMALL_PRESETS:
            preset = merged(yaml.safe_load(entry.read_text()), SMALL_PRESETS[entry.name])
            (work / "configs" / entry.name).write_text(yaml.safe_dump(preset, sort_keys=False))
        else:
            (work / "configs" / entry.name).symlink_to(entry)


def _small(page: Path, todo: list[Block]) -> list[Block]:
    """The page's blocks with SMALL_TEXT in place."""
    name = str(page.relative_to(ROOT))
    for old, new in SMALL_TEXT.get(name, []):
        assert any(old in b.code for b in todo), f"{name}: no block holds {old!r} (tests/test_docs.py SMALL_TEXT)"
        todo = [Block(b.page, b.line, b.lang, b.code.replace(old, new), b.marker) for b in todo]
    return todo


@pytest.mark.slow
@pytest.mark.longest  # a page that trains: half a minute to a minute and a half, first, beside the rest (conftest.py)
@pytest.mark.parametrize("page", [p for p in RUN_PAGES if any(b.marker is None and b.lang in ("sh", "python")
                                                              for b in blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs(page, tmp_path, profile_cache, shared_runs):
    work = tmp_path / "work"
    work.mkdir()
    _configs(work)
    (work / "benchmarks").symlink_to(ROOT / "benchmarks")
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home, profile_cache)  # the run's, shared (tests/conftest.py): a measured profile is a minute of CPU
    todo = _small(page, (_readme_setup(page) if page == README else []) + blocks(page))
    printed = []
    elsewhere = _run_elsewhere(page)
    for block in todo:
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if _commands(block) in elsewhere:
            continue
        if block.marker == "forever":
            _run_forever(block, work, env)
            continue
        if block.marker is not None or block.lang not in ("sh", "python"):
            continue
        for piece in _pieces(block, work):
            if isinstance(piece, tuple):
                printed.append(_shared(piece, work, env, shared_runs))
                continue
            if piece.lang == "sh":
                argv = ["bash", "-c", "set -euo pipefail\n" + piece.code]
            else:
                argv = [sys.executable, "-c", piece.code]
            r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
            assert r.returncode == 0, (f"{where}: exit {r.returncode}\n$ {shlex.join(argv)[:2000]}\n"
                                       f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}")
            printed.append(r.stdout)
    name = str(page.relative_to(ROOT))
    for path in CHECKS[name].files:
        assert (work / path).is_file(), f"{name}: its commands wrote no {path}"
    out = "".join(printed)
    for pattern in CHECKS[name].printed:
        assert re.search(pattern, out, re.M), f"{name}: nothing printed matches {pattern!r}:\n{out[-4000:]}"


def test_the_readmes_training_quickstart_runs_in_the_training_guide():
    """The README blocks RUN_BY leaves to the training guide: its memory, plan and train commands and the capped
    recipe, which the guide runs alike (an edit that makes them differ runs them in the README again)."""
    elsewhere = _run_elsewhere(README)
    skipped = [b for b in _small(README, blocks(README)) if _commands(b) in elsewhere]
    assert [c for b in skipped for c in _commands(b) if c.startswith("edgerev ")] == [
        "edgerev memory --arch revnext --batch 8 --size 64 --fake",
        "edgerev plan --arch revnext --size 32 --budget 64MiB --estimate",
        "edgerev train --config configs/cpu-demo.yaml --out runs/demo",
        "edgerev train --config capped.yaml --out runs/capped"]
    assert all(b.marker is None for b in skipped)


def test_each_shared_sequence_is_run_by_two_pages_or_more(tmp_path):
    """A sequence of SHARED is worth sharing only while pages run it alike (an edit that makes one differ leaves it
    to run in each page, and this says so), and a page's piece around it keeps the rest of its block."""
    runs = {key: [] for key in SHARED}
    for page in RUN_PAGES:
        elsewhere = _run_elsewhere(page)
        for block in _small(page, blocks(page)):
            if _commands(block) in elsewhere:
                continue
            pieces = _pieces(block, tmp_path)
            assert [c for x in pieces for c in (x if isinstance(x, tuple) else _commands(x))] == list(_commands(block))
            for x in pieces:
                if isinstance(x, tuple):
                    runs[x].append(page.name)
    assert all(len(pages) >= 2 for pages in runs.values()), runs
    for state in ("cd sub", "export X=1", "X=1"):  # the pieces run in shells of their own: a block that sets any
        block = Block(README, 1, "sh", f"{state}\n{DEMO}\n", None)  # runs whole
        assert _pieces(block, tmp_path) == [block]


def test_every_page_that_runs_has_checks():
    """A page test_page_runs runs says what its commands must leave (CHECKS), and nothing else is named there."""
    ran = {str(p.relative_to(ROOT)) for p in RUN_PAGES if any(b.marker is None and b.lang in ("sh", "python")
                                                              for b in blocks(p))}
    assert ran == set(CHECKS)
    assert set(SMALL_TEXT) <= ran
