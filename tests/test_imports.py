"""The house rules of the imports: the library never imports the service, pure planner modules import no torch,
the engine nothing from memory/, no import cycle among edgerev's modules (counting the imports inside functions: a
lazy import is still an arrow, and the old engine -> memory -> engine cycle was one), and edgerev's rooms keep
their order (ROOMS below: no arrow runs back up a layer). The daemon's rooms keep theirs:
tests/daemon/test_rooms.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = ["edgerev.sizes", "edgerev.models.directory", "edgerev.models.carried",  # and every module of memory's solvers
        *sorted(f"edgerev.memory.solve.{p.stem}" for p in (ROOT / "edgerev" / "memory" / "solve").glob("*.py")
                if p.stem != "__init__")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The edgerev modules ``path`` imports (at module level only, or anywhere; ``if TYPE_CHECKING`` aside)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(_walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "edgerev" or m.startswith("edgerev.")}


def _walk(node: ast.AST):
    """``ast.walk`` without the blocks that only type checkers run."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            continue
        yield from _walk(child)


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / "edgerev").rglob("*.py")}
    g = {}
    for name, path in files.items():
        targets = set()
        for m in imports(path, top_level_only):
            while m not in files and "." in m:  # ``from edgerev.layers.base import x`` names a module
                m = m.rsplit(".", 1)[0]
            if m in files and m != name:
                targets.add(m)
        g[name] = targets
    return g


def test_the_module_graph_has_no_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(g[n]):
            if state.get(m) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(m):], m]))
            if m not in state:
                visit(m, [*path, m])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])


def test_the_engine_imports_nothing_from_memory():
    for name in ("edgerev.engine", "edgerev.checkpointing"):
        path = ROOT / (name.replace(".", "/") + ".py")
        bad = [m for m in imports(path, top_level_only=False) if m.startswith("edgerev.memory")]
        assert not bad, f"{name} imports {bad}"


def test_layers_and_models_never_import_memory_or_train():
    for folder in ("layers", "models"):
        for path in (ROOT / "edgerev" / folder).rglob("*.py"):
            bad = [m for m in imports(path, top_level_only=False)
                   if m.startswith(("edgerev.memory", "edgerev.train"))]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_torch(module):
    path = ROOT / (module.replace(".", "/") + ".py")
    direct = {n.names[0].name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import)}
    direct |= {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m == "torch" or m.startswith("torch.") for m in direct), f"{module} imports torch"
    # and nothing it pulls in does either: a fresh interpreter
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, f"importing {module} loads torch"


def test_private_torch_apis_live_in_one_module():
    offenders = []
    for path in (ROOT / "edgerev").rglob("*.py"):
        if path.name == "_torchapi.py":
            continue
        text = path.read_text()
        if "._cdata" in text or "fake_tensor import" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


SERVICE = ("edgerev_daemon", "daemon")  # the service's installed name, and its folder's (python-daemon's name)


def every_import(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, where it does: at module level, inside functions, under ``TYPE_CHECKING``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def test_the_library_never_imports_the_service():
    """Arrows run one way: edgerev_daemon (daemon/) imports edgerev, never the reverse, lazily or not. What needs
    both lives in the service, and the library reaches it only through entry points (edgerev.cli) that it does
    not import. No module of either imports ``daemon``: that name is python-daemon's."""
    wrong = []
    for tree, banned in (("edgerev", SERVICE), ("daemon", ("daemon",))):
        for path in sorted((ROOT / tree).rglob("*.py")):
            wrong += [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in every_import(path)
                      if name.split(".")[0] in banned]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_every_kind_of_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import edgerev_daemon\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from edgerev_daemon.config import DaemonConfig\n"
                   "def f():\n    from edgerev_daemon.learning import fleet\n    import daemon.config\n")
    assert [(n, m) for n, m in every_import(bad) if m.split(".")[0] in SERVICE] == [
        (1, "edgerev_daemon"), (4, "edgerev_daemon.config"), (6, "edgerev_daemon.learning"), (7, "daemon.config")]


#: edgerev's rooms, lowest first: a module imports from its own room and from the tiers below it, never from a room
#: above it or beside it in its tier. A module is in the room of the longest prefix that names it. The package
#: ``edgerev`` itself stands outside: it re-exports every room lazily, and reading its ``__version__`` is no arrow.
ROOMS: list[dict[str, tuple[str, ...]]] = [
    {"shared": ("edgerev.errors", "edgerev.lazy", "edgerev.sizes", "edgerev.atomic", "edgerev.enums",
                "edgerev._torchapi", "edgerev.torch_range", "edgerev.exits", "edgerev.source_tree", "edgerev.config",
                "edgerev.finite")},
    {"layers": ("edgerev.layers", "edgerev.quantize", "edgerev.approximate")},
    {"engine": ("edgerev.engine", "edgerev.checkpointing")},
    {"models": ("edgerev.models",)},
    {"memory.solve": ("edgerev.memory.solve",)},  # pure: cost types and solvers, no torch
    {"memory.measure": ("edgerev.memory.measure",), "memory.graph": ("edgerev.memory.graph",)},
    {"memory": ("edgerev.memory",)},  # the package's face: the tracker's names
    {"memory.plan": ("edgerev.memory.plan",)},
    {"train": ("edgerev.train",)},
    {"export": ("edgerev.export",)},
    {"front": ("edgerev.api", "edgerev.cli", "edgerev.__main__", "edgerev.diagnostics", "edgerev.doctor",
               "edgerev.fleet")},
]
MEMORY_ROOMS = ("solve", "measure", "plan")  # memory's sub-packages; graph.py is a room of one module


def room_of(module: str) -> tuple[str, int] | None:
    """``(room, tier)`` of an edgerev module, or None for one no room names."""
    best = None
    for tier, rooms in enumerate(ROOMS):
        for room, prefixes in rooms.items():
            for p in prefixes:
                if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                    best = (len(p), room, tier)
    return None if best is None else best[1:]


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p) if root == ROOT else ".".join(p.relative_to(root).with_suffix("").parts)
            .removesuffix(".__init__"): p for p in (root / "edgerev").rglob("*.py")}


def targets(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """The edgerev modules ``path`` imports and where: ``from a.b import c`` names ``a.b.c`` when that is a module,
    and ``import a.b.c`` the longest of ``a.b.c``, ``a.b``, ``a`` that is one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out.append((node.lineno, f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                            else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    resolved = set()
    for line, m in out:
        while m not in known and "." in m:
            m = m.rsplit(".", 1)[0]
        if m in known and m.startswith("edgerev"):
            resolved.add((line, m))
    return sorted(resolved)


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import in the tree at ``root`` that runs up a tier or across to a room beside its own."""
    files = modules(root)
    wrong = []
    for name, path in sorted(files.items()):
        here = room_of(name)
        if name == "edgerev" or here is None:
            continue
        for line, target in targets(path, set(files)):
            there = room_of(target)
            if target == "edgerev" or there is None or there[0] == here[0]:
                continue
            if there[1] >= here[1]:
                wrong.append(f"{path.relative_to(root)}:{line} ({here[0]}) imports {target} ({there[0]})")
    return wrong


def test_every_module_is_in_a_room():
    files = modules(ROOT)
    assert not [m for m in files if m != "edgerev" and room_of(m) is None]
    flat = sorted(p.name for p in (ROOT / "edgerev" / "memory").glob("*.py"))
    assert flat == ["__init__.py", "graph.py"], "memory/ keeps its modules in its rooms: " + ", ".join(MEMORY_ROOMS)


def test_no_import_runs_back_up_a_layer():
    """The rooms' order, lazy imports and those under ``TYPE_CHECKING`` included: memory never imports train or
    export, models never export, memory's solvers nothing of its measurement, graph capture or planning."""
    wrong = upward_imports()
    assert not wrong, "\n".join(wrong)


def test_the_order_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "edgerev"
    for name, text in {"__init__.py": "", "memory/__init__.py": "", "memory/solve/__init__.py": "",
                       "memory/solve/costs.py": "def f():\n    from edgerev.memory.plan import autoplan\n",
                       "memory/plan/__init__.py": "", "memory/plan/autoplan.py": "from edgerev.train import norms\n",
                       "memory/graph.py": "from edgerev.memory.solve.costs import f\n",
                       "train/__init__.py": "", "train/norms.py": "", "models/__init__.py": "import edgerev.export\n",
                       "export/__init__.py": ""}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert upward_imports(tmp_path) == [
        "edgerev/memory/plan/autoplan.py:1 (memory.plan) imports edgerev.train.norms (train)",
        "edgerev/memory/solve/costs.py:2 (memory.solve) imports edgerev.memory.plan.autoplan (memory.plan)",
        "edgerev/models/__init__.py:1 (models) imports edgerev.export (export)"]
