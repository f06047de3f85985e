"""The daemon's rooms depend one way: storage, intake, learning, service, each importing only from the
shared modules (config, errors, layout) and the rooms before it (daemon/README.md). Read statically,
every import in every module, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "daemon"
ROOMS = ["storage", "intake", "learning", "service"]


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.startswith("edgerev_daemon")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("edgerev_daemon")]
    return out


def test_every_module_lives_in_a_room_or_is_shared():
    flat = sorted(p.name for p in ROOT.glob("*.py"))
    assert flat == ["__init__.py", "config.py", "errors.py", "layout.py"]
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("_")) == sorted(ROOMS)


def test_a_room_imports_only_from_the_rooms_before_it():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts == ("__init__.py",):
            continue  # the package's own re-exports
        rank = ROOMS.index(parts[0]) if len(parts) > 1 else -1  # the shared modules come first
        for line, name in imports(path):
            room = name.split(".")[1] if name.count(".") >= 1 else None
            if room in ROOMS and ROOMS.index(room) > rank:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from edgerev_daemon.service.daemon import Daemon\n")
    assert imports(bad) == [(2, "edgerev_daemon.service.daemon"), (2, "edgerev_daemon.service.daemon.Daemon")]


def test_learning_takes_the_service_through_the_interface_it_declares():
    """A learning module that drives a job of the daemon names its argument's type, the interface learning
    declares (edgerev_daemon.learning.host.JobHost), never the service's Daemon: an untyped ``daemon`` hid the
    arrow from learning up to service from the check above."""
    untyped = []
    for path in sorted((ROOT / "learning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                    if a.arg == "daemon" and (a.annotation is None or ast.unparse(a.annotation) != "JobHost"):
                        untyped.append(f"learning/{path.name}:{node.lineno} {node.name}({a.arg})")
    assert not untyped, "\n".join(untyped)


def test_the_daemon_has_what_learning_asks_of_it():
    import inspect

    from edgerev_daemon.learning.host import JobHost
    from edgerev_daemon.service.daemon import Daemon

    init = ast.parse(inspect.getsource(Daemon.__init__).strip())
    targets = [t for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    targets += [e for t in targets if isinstance(t, ast.Tuple) for e in t.elts]  # self.a, self.b = ...
    assigned = {t.attr for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert set(JobHost.__annotations__) <= assigned
    methods = [n for n, v in vars(JobHost).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert methods
    for name in methods:
        want = list(inspect.signature(getattr(JobHost, name)).parameters)
        assert list(inspect.signature(getattr(Daemon, name)).parameters) == want, name
