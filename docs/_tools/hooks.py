"""MkDocs hooks (mkdocs.yml: hooks): the build fails when the generated configuration reference is stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError


def _configref():
    spec = importlib.util.spec_from_file_location("configref", Path(__file__).with_name("configref.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_pre_build(config, **kwargs) -> None:
    if _configref().stale():
        raise PluginError("docs/reference/configuration.md no longer matches the config dataclasses: "
                          "run python docs/_tools/configref.py --write")
