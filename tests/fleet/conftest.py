"""Fixtures of the fleet tests (Flower is imported inside them: without it the tests skip, not fail)."""

import pytest


@pytest.fixture
def identity():
    """What a SuperLink process sets before running a ServerApp: the task's identity (Flower's
    strategies log and address messages with it)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
