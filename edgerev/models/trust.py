"""The trust boundary: what the owner names is code edgerev may run; what arrives in a file is data.

A model source is either named by the device's owner or it arrives as a file.

- **Named by the owner, trusted:** a registry name, or a factory ``package.module:callable`` given on the
  command line (``--arch``, ``--trust-factory``), in a recipe or a daemon's config (``model.arch``,
  ``model.trust_factories``), to a Python call (``resolve_model``, ``load_model``, ``fit``, ``plan``), or
  registered by an installed package as an entry point of group ``edgerev.models``. Naming a factory is
  trusting its module: importing it runs whatever the module runs, before the factory is called.
- **Arrived as a file, data:** a model directory's ``model.json``, an ONNX file, its metadata and its sidecar
  ``model.onnx.json``, weights. A file never names code to run. A model directory's ``arch`` is a registry
  name, ``onnx`` (its graph is the directory's own ``source.onnx``), or a factory the owner allows by one of
  the ways above (:func:`check_file_arch`); anything else is refused from the string alone, before anything
  is imported.

Every file a model names, implicitly (``model.json``, ``model.safetensors``, ``source.onnx``, a sidecar) or
explicitly (an ONNX initializer's external data), is opened only inside its folder: :func:`confined`
resolves the name (links followed, ``..`` applied) and refuses it unless it still lies inside, before it
is read. That check and the later open are two steps: a model folder is what someone copied onto the
device, not a folder another user rewrites while edgerev reads it (the daemon's inbox is, and its intake
walks folders by descriptor: ``edgerev_daemon.intake.confined``).

No torch and no import of anything a file names here: the daemon's config checks and its registry use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from edgerev.errors import TrustError
from edgerev.models.names import ARCHS, SourceKind, source_kind

#: the entry-point group in which an installed package registers the factories a model file may name
ENTRY_POINT_GROUP = "edgerev.models"
#: what a model directory's ``arch`` is when its graph is the directory's own copy of an ONNX file
ONNX_ARCH = "onnx"



def trust_help(factory: str) -> str:
    """How the owner allows ``factory``: every way, each with the name to give."""
    return (f"allow it, if you trust its module, with --trust-factory {factory} (Python: trust_factories="
            f"[{factory!r}]), a config's model.trust_factories, or an installed package's {ENTRY_POINT_GROUP!r} "
            "entry point")


def factory_name(factory: str | Callable) -> str:
    """``package.module:callable`` for a factory given by name, or by the callable (a class, a function) itself.

    Raises:
        TrustError: the string is not spelled as a factory, or the callable cannot be named (defined in a function).
    """
    if isinstance(factory, str):
        name = factory
    else:
        module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
        if not (callable(factory) and isinstance(module, str) and isinstance(qualname, str)) or "<" in qualname:
            raise TrustError(f"trust_factories: {factory!r} is neither package.module:callable nor a callable "
                             "defined at a module's top level")
        name = f"{module}:{qualname}"
    try:
        kind = source_kind(name)
    except ValueError:
        kind = None
    if kind is not SourceKind.FACTORY:
        raise TrustError(f"trust_factories: {name!r} is not a factory package.module:callable")
    return name


def owner_factories(factories: Iterable[str | Callable] = ()) -> frozenset[str]:
    """The factories the owner named (strings or callables), by name."""
    return frozenset(factory_name(f) for f in factories)


def registered_factories() -> frozenset[str]:
    """The factories installed packages register as entry points of group ``edgerev.models`` (read from the
    packages' metadata: nothing is imported)."""
    from importlib.metadata import entry_points

    return frozenset(f"{ep.module}:{ep.attr}" for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.attr)


def allows(factory: str, trust: Iterable[str | Callable] = ()) -> bool:
    """Whether the factory named ``factory`` is one the owner allows: in ``trust``, or registered by an installed
    package."""
    return factory in owner_factories(trust) or factory in registered_factories()


def check_file_arch(arch: str, where: str, trust: Iterable[str | Callable] = ()) -> SourceKind:
    """What a model file's ``arch`` names, if a file may name it: a registry name (``REGISTRY``), ``onnx``
    (``ONNX``: the directory's ``source.onnx``), or a factory in ``trust`` or registered by an installed package
    (``FACTORY``).

    Args:
        where: the file and field, as messages name them (``run/model.json: arch``).
        trust: the factories the owner allows (names or callables).

    Raises:
        TrustError: anything else, in one line, before anything is imported.
    """
    if arch in ARCHS:
        return SourceKind.REGISTRY
    if arch == ONNX_ARCH:
        return SourceKind.ONNX
    try:
        kind = source_kind(arch)
    except ValueError:
        kind = None
    if kind is SourceKind.FACTORY:
        if allows(arch, trust):
            return SourceKind.FACTORY
        module = arch.partition(":")[0]
        raise TrustError(f"{where}: {arch!r} is a factory (code in module {module}) that its owner has not allowed; "
                         f"a file never names code to run: {trust_help(arch)}")
    raise TrustError(f"{where}: {arch!r} is not what a model file may name: a registry name "
                     f"({', '.join(ARCHS)}), {ONNX_ARCH!r} (the directory's source.onnx) or a factory its owner allows")


def confined(folder: str | Path, name: str, what: str) -> Path:
    """The file ``name`` of ``folder``, resolved, refused unless it lies inside ``folder`` (no symbolic link and
    no ``..`` out of it; ``folder`` itself may be a link, as a daemon's ``current`` is).

    Args:
        what: the file or field that names it, as messages name it (``m.onnx: external data of 'W'``).

    Raises:
        TrustError: ``name`` is empty, holds a NUL, or leads outside ``folder`` (one line; nothing is read).
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise TrustError(f"{what}: {name!r} is not a file name")
    base = Path(folder).resolve()
    try:
        path = (base / name).resolve()
    except (OSError, RuntimeError):  # a loop of links
        raise TrustError(f"{what}: {name!r} cannot be resolved (a loop of symbolic links)") from None
    if base not in path.parents:
        raise TrustError(f"{what}: {name!r} leads outside {folder} (a symbolic link or '..'); a model's files are "
                         "read only inside its own folder")
    return path
