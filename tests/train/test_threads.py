"""Training threads: a setting of the recipe (and so of the daemon's training section), fewer than the cores by
default, restored after a run; bad values are one line naming the key."""

from __future__ import annotations

import pytest
import torch

from edgerev.config import ConfigError
from edgerev.train.config import TrainConfig, available_cores, default_threads
from edgerev.train.trainer import training_threads
from edgerev_daemon import config_from_dict


def test_the_default_leaves_a_core_for_the_devices_other_work():
    assert default_threads() == max(1, available_cores() - 1)


def test_threads_are_set_for_the_run_and_restored_after():
    before = torch.get_num_threads()
    with training_threads(None) as n:
        assert n == default_threads() == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), training_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("a failed run")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [0, -1, available_cores() + 1])
def test_a_thread_count_outside_the_cores_is_one_line_naming_the_key(threads):
    with pytest.raises(ConfigError, match=rf"^threads: must lie in 1\.\.{available_cores()} \(the cores this process "
                                          rf"may run on\), got {threads}$"):
        TrainConfig(threads=threads)
    with pytest.raises(ConfigError, match=r"^training\.train\.threads: must lie in 1\.\."):
        config_from_dict({"data_dir": "d", "training": {"train": {"threads": threads}}})


def test_the_daemon_takes_the_setting():
    assert config_from_dict({"data_dir": "d", "training": {"train": {"threads": 1}}}).training.train.threads == 1
