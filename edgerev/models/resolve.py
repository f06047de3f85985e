"""One resolver: whatever names a model becomes the ``nn.Module`` the rest of edgerev trains.

:func:`resolve_model` takes

- a **registry name** (``revnext``; :func:`edgerev.models.list_models`);
- an **edgerev model directory** (a training run's output or a daemon's version: ``model.json`` +
  ``model.safetensors``), its architecture and weights;
- an **ONNX file** (``*.onnx``), imported to a trainable graph by :mod:`edgerev.models.onnx_import`;
- a **factory** ``package.module:callable`` returning an ``nn.Module`` (``torchvision.models:resnet18``,
  ``edgerev.models.designs:mobilenet_v2``, one's own), with ``args`` as its keyword arguments;
- an ``nn.Module`` object (from Python: :func:`edgerev.fit`), used as it is (recorded by what rebuilds it, below).

``weights`` (a registry name, a factory or a module) loads a safetensors file, or a ``state_dict``
saved by ``torch.save``, read with ``torch.load(weights_only=True)``: a file never runs code.
``num_classes`` sets the classifier's rows: a registry model or a factory that takes a ``num_classes``
argument is built with it; otherwise (pretrained weights, a directory, an ONNX file) the source is
built as it is and its classifier, the last linear layer (:func:`edgerev.models.spec.head_name`), is
replaced by a fresh one with that many rows (keeping new classes' rows by name is the continual
path's business: :func:`edgerev.train.continual.grow_head`).

What the caller names is trusted: a factory given as ``source`` is imported and called. A model directory
or an ONNX file is data (:mod:`edgerev.models.trust`): a directory's ``model.json`` names a registry model,
``onnx`` or a factory the caller allows (``trust_factories``) or an installed package registers, and is
refused before any import otherwise; each file it holds is read only inside it.

It returns a :class:`~edgerev.models.handle.ModelHandle`: the module and what the rest of edgerev needs to know of
it (input, normalization, classes and head, input and output names, what rebuilds it, its planning surface and its
exporter). Each kind of source is one handler in :data:`HANDLERS`; nothing past them asks the module or where it
came from. A module object's owner may declare on it, as attributes, what a class cannot say: ``mean`` and ``std``
(the normalization its weights were trained with), ``arch`` and ``model_args`` (the factory and arguments that
rebuild it; :func:`rebuild_error` says when they cannot), and ``in_channels``, ``num_classes`` and ``image_size``
where its layers cannot say them. A timm module (or one a factory builds) without its owner's ``mean`` and ``std``
carries those of the configuration timm pairs with it (``pretrained_cfg``). Without ``arch``, a module of timm or
torchvision is recorded by the builder that makes it (``timm:create_model`` with its ``model_name``,
``torchvision.models:resnet18``...; :mod:`edgerev.models.builders`), any other by its class.

Bad input is refused in one line (:class:`ModelSourceError`) before anything is written: a module
that does not import, a factory that raises or returns no module, a weights file that is missing,
of another format, or whose names or shapes do not fit (the first few named).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from edgerev.errors import EdgerevError, described
from edgerev.models.builders import NoBuilder, package_builder, package_normalization, shapes_differ, weight_shapes
from edgerev.models.directory import (
    INFO,
    ONNX_SOURCE,
    WEIGHTS,
    CheckpointError,
    ModelInfo,
    load_state,
    load_tensors,
    read_info,
)
from edgerev.models.handle import ModelHandle, describe
from edgerev.models.names import SourceKind, source_kind
from edgerev.models.trust import check_file_arch, confined


class ModelSourceError(EdgerevError):
    """A model source cannot be turned into a model: the message names the source and what is wrong."""


def resolve_model(source: str | Path | nn.Module | ModelHandle, *, weights: str | Path | None = None,
                  args: dict | None = None, num_classes: int | None = None,
                  trust_factories: Iterable[str | Callable] = ()) -> ModelHandle:
    """The handle of the model ``source`` names (see the module docstring), with ``weights`` loaded and
    ``num_classes`` rows. A handle given as ``source`` is returned with them applied.

    ``source`` is the caller's: a factory it names is imported and called. A model directory is data: the
    factory its ``model.json`` names is built only when it is in ``trust_factories`` (names
    ``package.module:callable`` or the callables themselves) or registered by an installed package
    (:mod:`edgerev.models.trust`).

    Raises:
        ModelSourceError: the source or its weights cannot be used (one line).
        UnknownModelError: ``source`` is a string that names no kind of source.
        edgerev.errors.UnsupportedModel: an ONNX file edgerev cannot import (from the importer).
        CheckpointError: a model directory whose description or weights cannot be used (naming file and field).
        edgerev.errors.TrustError: a model directory that names a factory not allowed, or a file outside it.
    """
    args = dict(args or {})
    if isinstance(source, ModelHandle):
        if args:
            raise ModelSourceError("args are for a registry name or a factory, not for a resolved model")
        return _finish(source, weights, num_classes)
    if isinstance(source, nn.Module):
        kind = SourceKind.MODULE
    else:
        source = str(source)
        kind = source_kind(source)
    if kind in (SourceKind.DIRECTORY, SourceKind.ONNX):
        if weights is not None:
            raise ModelSourceError(f"weights: {source} carries its own weights; leave weights out")
        if args:
            raise ModelSourceError(f"args: {source} carries its own architecture; leave args out")
    handle = HANDLERS[kind](source, args, None if weights is not None else num_classes, trust_factories)
    return _finish(handle, weights, num_classes)


def _from_registry(name: str, args: dict, num_classes: int | None, trust) -> ModelHandle:
    from edgerev.models import create_model

    model = create_model(name, **args, **({} if num_classes is None else {"num_classes": num_classes}))
    return describe(model, arch=name, args=args)


def _from_module(model: nn.Module, args: dict, num_classes: int | None, trust) -> ModelHandle:
    if args:
        raise ModelSourceError("args are for a registry name or a factory, not for a module object")
    declared = _declared(model)
    try:
        arch = module_arch(model)
    except ModelSourceError:
        arch = None  # planning needs no name; a model directory does (fit refuses then: rebuild_error)
    model_args = declared.get("model_args")
    handle = describe(model, arch=arch, args=dict(model_args) if isinstance(model_args, dict) else {},
                      mean=_floats(declared.get("mean")), std=_floats(declared.get("std")),
                      in_channels=_count(declared.get("in_channels")), image_size=_count(declared.get("image_size")),
                      fixed_classes=_count(declared.get("num_classes")))
    if handle.mean is None and handle.std is None:
        handle = _package_normalization(handle)
    if "arch" in declared or "model_args" in declared:
        return handle  # the owner said what rebuilds it
    try:
        built = package_builder(model, handle.num_classes, handle.in_channels)
    except NoBuilder:
        return handle  # recorded by its class; fit refuses it with the reason (rebuild_error)
    return handle if built is None else handle.replace(arch=built[0], args=built[1])


def _count(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _declared(model: nn.Module) -> dict:
    """What a module object's owner declared on it (see the module docstring): its own attributes ``arch``,
    ``model_args``, ``mean``, ``std``, ``in_channels``, ``num_classes`` and ``image_size`` (:data:`_DECLARED`),
    read here once, where the module becomes a handle."""
    own = vars(model)
    return {k: own[k] for k in _DECLARED if k in own}


#: what a module object's owner may declare on it; ``num_classes`` and ``in_channels`` where its layers cannot say
_DECLARED = ("arch", "model_args", "mean", "std", "in_channels", "num_classes", "image_size")


def _floats(value) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        return tuple(float(v) for v in value) or None
    except (TypeError, ValueError):
        return None


def _from_directory(text: str, args: dict, num_classes: int | None, trust) -> ModelHandle:
    path = Path(text).expanduser()
    if not (path / "model.json").is_file():
        raise ModelSourceError(f"{text} is not a model directory (no model.json in it)")
    return load_handle(path, trust_factories=trust)[0]


def module_arch(model: nn.Module) -> str:
    """What rebuilds a module object: the ``arch`` its owner declared when it names a source, else its class as
    ``package.module:Class`` (built with its declared ``model_args``, or no arguments).

    Raises:
        ModelSourceError: the class cannot be named (defined inside a function).
    """
    arch = _declared(model).get("arch")
    if isinstance(arch, str):
        try:
            source_kind(arch)
            return arch
        except EdgerevError:
            pass
    cls = type(model)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if "<" in name:
        raise ModelSourceError(f"{cls.__qualname__} is defined inside a function; define the class at a module's top "
                               "level so its model directory can rebuild it")
    return name


def rebuild_error(handle: ModelHandle) -> str | None:
    """Why ``handle.arch`` and ``handle.args`` would not rebuild ``handle``'s module with its weights' names and
    shapes (None: they do). A model directory rebuilds its model this way, so :func:`edgerev.fit` asks before
    training. The copy is built on the meta device (nothing allocated) where the builder allows, else on the CPU.
    """
    if handle.arch is None:
        cls = type(handle.module)
        return f"{cls.__qualname__} is defined inside a function; define the class at a module's top level"
    if handle.onnx_source is not None or source_kind(handle.arch) not in (SourceKind.REGISTRY, SourceKind.FACTORY):
        return None  # an ONNX import or a directory rebuilds from its own files
    try:
        with torch.device("meta"):
            again = resolve_model(handle.arch, args=dict(handle.args), num_classes=handle.num_classes)
    except ModelSourceError:
        try:
            again = resolve_model(handle.arch, args=dict(handle.args), num_classes=handle.num_classes)
        except ModelSourceError as e:
            return _no_builder(handle) or str(e)
    except EdgerevError as e:
        return str(e)
    differ = shapes_differ(weight_shapes(handle.module), weight_shapes(again.module))
    if differ:
        return (f"{handle.arch}{'(**' + _shown(dict(handle.args)) + ')' if handle.args else '()'} builds another "
                f"model (its weights differ at {', '.join(differ[:3])})")
    return None


def _no_builder(handle: ModelHandle) -> str | None:
    """Why no builder of a known package was found for a module recorded by its class (None: not such a module)."""
    cls = type(handle.module)
    if handle.arch != f"{cls.__module__}:{cls.__qualname__}" or handle.args:
        return None
    try:
        package_builder(handle.module, handle.num_classes, handle.in_channels)
    except NoBuilder as e:
        return str(e)
    return None


def _finish(handle: ModelHandle, weights: str | Path | None, num_classes: int | None) -> ModelHandle:
    """Load ``weights`` (the classifier first sized as in the file), then give the classifier ``num_classes`` rows."""
    if weights is not None:
        state = load_weights(weights)
        rows = state.get(f"{handle.head}.weight") if handle.head is not None else None
        if rows is not None and rows.dim() == 2 and rows.shape[0] != handle.num_classes:
            handle.set_head_rows(rows.shape[0])
        load_state(handle.module, state, str(weights))
    if num_classes is not None:
        set_head_rows(handle, num_classes)
    return handle


def set_head_rows(model: nn.Module | ModelHandle, rows: int) -> None:
    """Replace the classifier (its last linear layer) by a fresh one of the same kind with ``rows`` rows
    (:meth:`ModelHandle.set_head_rows`).

    Raises:
        ModelSourceError: the model has no linear layer whose rows could be its classes, and returns another count.
    """
    handle = describe(model)
    if handle.head is None and handle.fixed_classes != rows:
        raise ModelSourceError(f"{type(handle.module).__name__} has no linear layer whose rows could be its "
                               f"{rows} classes")
    handle.set_head_rows(rows)


def _from_factory(text: str, args: dict, num_classes: int | None, trust) -> ModelHandle:
    module_name, _, attr = text.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (a user's module may fail with anything while it imports)
        raise ModelSourceError(f"{text}: cannot import {module_name} ({described(e)})") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ModelSourceError(f"{text}: {module_name} has no {attr}")
    if not callable(fn):
        raise ModelSourceError(f"{text}: {attr} is a {type(fn).__name__}, not a callable that builds a model")
    if num_classes is not None and _takes(fn, "num_classes") and "num_classes" not in args:
        call_args, later = {**args, "num_classes": num_classes}, None
    else:
        call_args, later = args, num_classes
    try:
        model = fn(**call_args)
    except Exception as e:  # noqa: BLE001  (the factory is the user's code: whatever it raises is one line)
        raise ModelSourceError(f"{text} raised {described(e)}") from None
    if not isinstance(model, nn.Module):
        raise ModelSourceError(f"{text} returned a {type(model).__name__}, not a torch.nn.Module")
    handle = _package_normalization(describe(model, arch=text, args=dict(args)))
    if later is not None:
        set_head_rows(handle, later)
    return handle


def _package_normalization(handle: ModelHandle) -> ModelHandle:
    """``handle`` with the normalization its module's package pairs with it (timm's ``pretrained_cfg``), if any."""
    found = package_normalization(handle.module, handle.in_channels)
    return handle if found is None else handle.replace(mean=found[0], std=found[1])


def _takes(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _from_onnx(text: str, args: dict, num_classes: int | None, trust) -> ModelHandle:
    path = Path(text).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"ONNX file {path} does not exist")
    try:
        from edgerev.models.onnx_import import load_onnx
    except ImportError as e:
        raise ModelSourceError(f"{path}: this edgerev cannot import ONNX files ({described(e)})") from None
    return describe(load_onnx(path, classifier=True))  # its handle carries the file's bytes, names and input


#: each kind of source and the one function that makes its handle: ``handler(source, args, num_classes, trust)``
HANDLERS: dict[SourceKind, Callable[..., ModelHandle]] = {
    SourceKind.REGISTRY: _from_registry,
    SourceKind.DIRECTORY: _from_directory,
    SourceKind.FACTORY: _from_factory,
    SourceKind.MODULE: _from_module,
    SourceKind.ONNX: _from_onnx,
}


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of a ``state_dict`` saved with ``torch.save`` (read with
    ``weights_only=True``: no code runs); a checkpoint dict holding it under ``state_dict`` or ``model``
    is unwrapped.

    Raises:
        ModelSourceError: the file is missing, of neither format, or holds no tensors by name.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"weights file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(9)
    if path.suffix == ".safetensors" or _looks_safetensors(head, path.stat().st_size):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, ValueError, OSError) as e:
            raise ModelSourceError(f"weights file {path} is not a valid safetensors file ({described(e)})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (pickle refusals, zip errors, truncation: all mean 'not a state_dict')
        raise ModelSourceError(f"weights file {path} is neither safetensors nor a state_dict saved by torch.save "
                               f"({described(e)})") from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in obj.items()):
        raise ModelSourceError(f"weights file {path} holds a {type(obj).__name__}, not a state_dict "
                               "(names to tensors)")
    return obj


def _looks_safetensors(head: bytes, size: int) -> bool:
    """safetensors starts with the little-endian length of its JSON header, then ``{``."""
    return len(head) == 9 and head[8:] == b"{" and 0 < int.from_bytes(head[:8], "little") < size


def build_model(info: ModelInfo, folder: str | Path | None = None,
                trust_factories: Iterable[str | Callable] = ()) -> ModelHandle:
    """The model ``info`` describes, fresh weights, one row per class, through :func:`resolve_model` (its handle).

    ``info`` is a file's: its ``arch`` must be a registry name, ``onnx`` (rebuilt from the copy of its file in
    the model directory ``folder``, read only inside it) or a factory in ``trust_factories`` or registered by
    an installed package; anything else is refused before any import (:func:`edgerev.models.trust.check_file_arch`).

    Raises:
        edgerev.errors.TrustError: ``arch`` names what a file may not, or ``source.onnx`` leads out of ``folder``.
        CheckpointError: the architecture cannot be built with the file's ``model_args``.
    """
    where = str(Path(folder) / INFO) if folder is not None else INFO
    kind = check_file_arch(info.arch, f"{where}: arch", trust_factories)
    if kind is SourceKind.ONNX:
        if folder is None:
            raise CheckpointError("an imported ONNX model is rebuilt from its model directory's source.onnx")
        confined(folder, ONNX_SOURCE, f"{folder}: {ONNX_SOURCE}")
        if not (Path(folder) / ONNX_SOURCE).is_file():
            raise CheckpointError(f"{where}: arch: {info.arch!r} is an imported ONNX model, rebuilt from the "
                                  f"directory's {ONNX_SOURCE}, which is not there")
        handle = resolve_model(str(Path(folder) / ONNX_SOURCE), num_classes=len(info.classes))
    else:
        try:
            handle = resolve_model(info.arch, args=info.model_args, num_classes=len(info.classes))
        except Exception as e:  # noqa: BLE001  (the arguments are a file's: whatever they make the builder raise)
            raise CheckpointError(f"{where}: model_args: {info.arch} cannot be built with {_shown(info.model_args)} "
                                  f"({described(e)})") from None
    # the normalization its weights are trained with, and its classes
    return handle.replace(mean=info.mean, std=info.std, classes=info.classes)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_handle(folder: str | Path, arch: str | None = None, classes: Sequence[str] | None = None, *,
                trust_factories: Iterable[str | Callable] = ()) -> tuple[ModelHandle, ModelInfo, str]:
    """Rebuild the model saved in ``folder`` with its weights; returns ``(handle, info, sha256)``.

    Args:
        arch: refuse a checkpoint of another architecture.
        classes: refuse a checkpoint whose classes differ.
        trust_factories: the factories (``package.module:callable`` or the callables) the caller allows
            ``folder``'s ``model.json`` to name: a run of one's own factory is reloaded by naming it here.

    Raises:
        CheckpointError: the description or the weights cannot be used (naming the file and field).
        edgerev.errors.TrustError: ``model.json`` names a factory not allowed, or a file leads out of ``folder``:
            refused before anything is imported or the weights are read.
    """
    info, raw = read_info(folder)
    check_file_arch(info.arch, f"{Path(folder) / INFO}: arch", trust_factories)  # before the weights are read
    if arch is not None and info.arch != arch:
        raise CheckpointError(f"{folder} holds a {info.arch} model, not {arch}")
    if classes is not None and tuple(classes) != info.classes:
        raise CheckpointError(f"{folder} was trained on classes {list(info.classes)}, not {list(classes)}")
    sha = raw.get("weights_sha256")
    state = load_tensors(Path(folder) / WEIGHTS, sha)
    handle = build_model(info, folder, trust_factories)
    load_state(handle.module, state, str(folder))
    return handle, info, sha


def load_model(folder: str | Path, arch: str | None = None, classes: Sequence[str] | None = None, *,
               trust_factories: Iterable[str | Callable] = ()) -> tuple[nn.Module, ModelInfo, str]:
    """:func:`load_handle`'s module: ``(model, info, sha256)``, for code that only runs the model."""
    handle, info, sha = load_handle(folder, arch, classes, trust_factories=trust_factories)
    return handle.module, info, sha
