"""Federated fine-tuning of a fleet of devices on Flower (``pip install 'edgerev[fleet]'``).

Each device keeps its data and its daemon; a round is a job of that daemon (:mod:`edgerev_daemon.learning.fleet`),
and only weights and per-class counts travel. The pieces:

- :mod:`edgerev.fleet.settings`: the run's settings, as Flower's run config carries them;
- :mod:`edgerev.fleet.aggregate`: the fleet's class registry and the count-weighted averaging of head rows;
- :mod:`edgerev.fleet.strategy`: a FedAvg on ArrayRecords that aggregates with the registry;
- :mod:`edgerev.fleet.server` and :mod:`edgerev.fleet.client`: the ServerApp and the ClientApp;
- :mod:`edgerev.fleet.grid`: a Grid that delivers messages to ClientApps in this process (no Ray);
- :mod:`edgerev.fleet.simulate`: ``edgerev fleet simulate``, N devices with their own data directories.

Importing this package imports neither Flower nor torch; its modules do.
"""
