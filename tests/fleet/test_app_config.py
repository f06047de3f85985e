"""The Flower App's run config (``deploy/fleet-app/pyproject.toml``) names every fleet setting: ``flwr run``
refuses a ``--run-config`` key the app does not declare, so a setting missing there cannot be used."""

from pathlib import Path

import pytest

from edgerev.fleet.settings import FleetSettings

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, as Flower is

APP = Path(__file__).resolve().parents[2] / "deploy" / "fleet-app" / "pyproject.toml"


def test_the_apps_config_declares_every_setting_and_reads_back():
    declared = tomllib.loads(APP.read_text())["tool"]["flwr"]["app"]["config"]
    assert sorted(declared) == sorted(FleetSettings().to_run_config())
    FleetSettings.from_run_config(declared)  # every value of the right type and in range
