"""A run folder written by an earlier version of nip_like still resumes, to the metrics of an uninterrupted run.

``tests/data/run_written_2026_12_02`` is a hidden-bits run (4 iterations of 128
frames, a checkpoint after each) stopped after its second iteration, written by
commit 34c2cad, before the modules were renamed (``nip_like.agents``,
``nip_like.optim``, ``nip_like.pretrain``, ``nip_like.lm.checkpoints`` and
others). Its ``last.pt`` pickles no nip_like class, only dicts, tensors and
TensorDicts, so that a module's new name cannot break it; this test holds that.
A change that alters the training arithmetic on purpose changes the resumed
run's metrics too: then write the folder again with the code before that
change, as the module docstring says it was written (``run.checkpoint_every=1``,
stopped when the third iteration starts), and say so in the commit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nip_like.resume
from nip_like.experiment import run_experiment
from nip_like.resume import load_run_config

OLD_RUN = Path(__file__).parent / "data" / "run_written_2026_12_02"


def test_a_run_folder_written_before_the_module_renames_resumes_to_the_uninterrupted_runs_metrics(tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(OLD_RUN, run_dir)
    config = load_run_config(run_dir)
    assert config.trainer.num_iterations == 4 and not (run_dir / "summary.json").exists()

    assert nip_like.resume.main([str(run_dir)]) == 0

    uninterrupted = run_experiment(config, tmp_path / "uninterrupted")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"]
    assert summary["test_metrics"] == uninterrupted
