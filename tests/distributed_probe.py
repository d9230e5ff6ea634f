"""Run ``python -m nip_like`` under torchrun with a probe (for tests/test_distributed.py).

``torchrun ... tests/distributed_probe.py RECORD_DIR [FAIL_RANK FAIL_ITERATION] -- ARGS...``:
rank 0 records, at each iteration, the buffer's data (the whole batch's layout, gathered from
every rank) and torch's global generator state when the buffer is filled, to
``RECORD_DIR/<iteration>.pt``; with ``FAIL_RANK`` and ``FAIL_ITERATION``, that rank raises a
TrainingError when it starts that iteration (1-based). With ``NIP_LIKE_PROBE_SLOW_BUILD=SECONDS``
rank 0 sleeps that long before it builds the trainer (a long warm start); with
``NIP_LIKE_PROBE_FAIL_BUILD=1`` besides, it then fails with a ConfigError.
"""

import os
import sys
import time
from pathlib import Path

from nip_like import start_up

start_up.pause_for_start_up()  # as python -m nip_like does, before its imports

import torch  # noqa: E402

import nip_like.experiment
from nip_like.__main__ import main
from nip_like.errors import ConfigError, TrainingError
from nip_like.trainers.rl import TensorDictRlTrainer

split = sys.argv.index("--")
record_dir, *failure = sys.argv[1:split]
sys.argv[1:] = sys.argv[split + 1:]
fill, iterate = TensorDictRlTrainer.fill_buffer, TensorDictRlTrainer.train_iteration


def recording_fill(self, data):
    if self.distributed.is_writer:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        record = {"data": data.clone(), "rng": torch.get_rng_state()}
        torch.save(record, Path(record_dir) / f"{self.state.iteration + 1}.pt")
    return fill(self, data)


def failing_iteration(self):
    if failure and self.distributed.rank == int(failure[0]) and self.state.iteration + 1 == int(failure[1]):
        raise TrainingError(f"probe failure on rank {self.distributed.rank} at iteration {failure[1]}")
    return iterate(self)


build = nip_like.experiment.build_trainer


def slow_build(config, run_dir):
    if int(os.environ["RANK"]) == 0:
        time.sleep(float(os.environ["NIP_LIKE_PROBE_SLOW_BUILD"]))
        if os.environ.get("NIP_LIKE_PROBE_FAIL_BUILD"):
            raise ConfigError("probe failure while rank 0 builds")
    return build(config, run_dir)


if os.environ.get("NIP_LIKE_PROBE_SLOW_BUILD"):
    nip_like.experiment.build_trainer = slow_build
TensorDictRlTrainer.fill_buffer = recording_fill
TensorDictRlTrainer.train_iteration = failing_iteration
sys.exit(main())
