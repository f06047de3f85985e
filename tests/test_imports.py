"""The house rules of the imports: the library never imports the service, pure planner modules import no torch,
the engine nothing from memory/, no import cycle among edgerev's modules (counting the imports inside functions: a
lazy import is still an arrow, and the old engine -> memory -> engine cycle was one). The daemon's rooms keep
their order: tests/daemon/test_rooms.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = ["edgerev.sizes", "edgerev.models.info", "edgerev.models.carried", "edgerev.memory.solve.costs",
        "edgerev.memory.solve.knapsack", "edgerev.memory.solve.segments"]


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
        if path.name == "_torchapi.py" or path.parts[-2] == "layers":  # layers.base.is_fake: the model code's own
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
