"""The fleet's device side: a device's daemon behind the fleet's ClientApp (:mod:`edgerev.fleet.client`).

The ClientApp asks a :class:`~edgerev.fleet.client.DeviceLink` for each request; here are the two the daemon
gives it. :class:`DaemonLink` runs the request as a job of a daemon held in this process (the simulation,
:mod:`edgerev_daemon.service.simulate`). :class:`DataDirLink` is a SuperNode's: ``app`` is the ClientApp it runs
(``[tool.flwr.app.components] clientapp = "edgerev_daemon.service.fleet:app"``). The SuperNode names the
device's daemon config in its node config
(``flower-supernode --node-config 'daemon-config="/etc/edgerev/daemon.yaml"'``). Each message opens that
data directory as the daemon does (its lock, its recovery), runs the request as a job of it
(:class:`DaemonLink`), and closes it; when the daemon is running, the request is handed to it
through the data directory (:mod:`edgerev_daemon.learning.handoff`) and its loop runs it between its own jobs.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context

from edgerev.fleet.client import make_client_app
from edgerev.fleet.model import Consideration, FleetError, FleetModel, RoundResult
from edgerev_daemon.learning.fleet import consider, label_counts, refuse, train_round
from edgerev_daemon.learning.host import JobHost

NODE_CONFIG_KEY = "daemon-config"


class DaemonLink:
    """A daemon held in this process (:class:`edgerev_daemon.service.daemon.Daemon`): the simulation, or a
    SuperNode that owns the device's data directory. ``stop`` is polled at every training step."""

    def __init__(self, daemon: JobHost, stop: Callable[[], bool] = lambda: False) -> None:
        self.daemon, self.stop = daemon, stop

    def classes(self) -> dict[str, int]:
        return label_counts(self.daemon)

    def train_round(self, fm: FleetModel) -> RoundResult:
        return train_round(self.daemon, fm, self.stop)

    def consider(self, fm: FleetModel) -> Consideration:
        return consider(self.daemon, fm)

    def refused(self, what: str, error: str) -> None:
        refuse(self.daemon, what, error)


class DataDirLink:
    """The daemon of ``config_path``: opened for each request and closed after it, or, when the daemon is
    running (it holds the data directory's lock), asked through the data directory
    (:mod:`edgerev_daemon.learning.handoff`), waiting at most ``timeout`` seconds for its answer."""

    HANDOFF = {"classes": "classes", "train_round": "round", "consider": "model", "refused": "refused"}

    def __init__(self, config_path: str, timeout: float = 3600.0) -> None:
        self.config_path, self.timeout = config_path, timeout

    def _call(self, name: str, *args):
        from edgerev_daemon.config import load_config
        from edgerev_daemon.errors import LockError
        from edgerev_daemon.learning.handoff import submit, wait_result
        from edgerev_daemon.service.daemon import Daemon

        config = load_config(self.config_path)
        try:
            daemon = Daemon(config, config_path=self.config_path)
        except LockError:
            root = config.layout.root
            if name == "refused":
                rid = submit(root, "refused", what=args[0], error=args[1])
            else:
                rid = submit(root, self.HANDOFF[name], args[0] if args else None)
            return wait_result(root, rid, self.timeout)
        with daemon:
            return getattr(DaemonLink(daemon), name)(*args)

    def classes(self):
        return self._call("classes")

    def train_round(self, fm):
        return self._call("train_round", fm)

    def consider(self, fm):
        return self._call("consider", fm)

    def refused(self, what: str, error: str) -> None:
        self._call("refused", what, error)


def link_for(context: Context) -> DataDirLink:
    path = context.node_config.get(NODE_CONFIG_KEY)
    if not isinstance(path, str) or not path:
        raise FleetError(f"the SuperNode's node config lacks {NODE_CONFIG_KEY}=\"/path/to/daemon.yaml\"")
    timeout = context.run_config.get("timeout", 3600.0)
    return DataDirLink(path, float(timeout) if isinstance(timeout, (int, float)) else 3600.0)


app = make_client_app(link_for)
