"""Federated fine-tuning of a fleet of devices on Flower (``pip install 'edgerev[fleet]'``).

Each device keeps its data and its daemon; a round is a job of that daemon, and only weights and per-class counts
travel. The pieces here are the fleet's side and what every side shares; the device's side is the service's
(``edgerev_daemon.service.fleet``: the daemon behind the ClientApp, the SuperNode's app;
``edgerev_daemon.service.simulate``: the run of ``edgerev fleet simulate``), since the library never imports it.

- :mod:`edgerev.fleet.model`: the fleet's model and the messages between the fleet and a device;
- :mod:`edgerev.fleet.settings`: the run's settings, as Flower's run config carries them;
- :mod:`edgerev.fleet.aggregate`: the fleet's class registry and the count-weighted averaging of head rows;
- :mod:`edgerev.fleet.strategy`: a FedAvg on ArrayRecords that aggregates with the registry;
- :mod:`edgerev.fleet.server` and :mod:`edgerev.fleet.client`: the ServerApp and the ClientApp (which asks the
  device through the interface it declares, :class:`edgerev.fleet.client.DeviceLink`);
- :mod:`edgerev.fleet.grid`: a Grid that delivers messages to ClientApps in this process (no Ray);
- :mod:`edgerev.fleet.simulate`: ``edgerev fleet simulate``'s preset and data.

Importing this package imports neither Flower nor torch; its modules do.
"""
