"""``python -m nip_like`` / ``nip-like``: run an experiment from the Hydra config.

Examples
--------
``python -m nip_like``                                  the default experiment
``python -m nip_like trainer.num_iterations=50 seed=3``  with overrides
``python -m nip_like --multirun seed=0,1,2``            one run per seed
``python -m nip_like +sweep=ppo_vs_dpo``                a ready sweep (``configs/sweep/``)
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from nip_like import start_up

if __name__ == "__main__":  # before the imports below: the collector waits until the run is built (nip_like.start_up)
    start_up.pause_for_start_up()

import hydra  # noqa: E402 - after the pause above
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from nip_like import distributed, run_lock
from nip_like.cli import (
    EXIT_INTERRUPTED,
    check_group_options,
    report_errors,
    report_job_errors,
    select_user_components,
)
from nip_like.config import CONFIG_DIR, register_configs
from nip_like.errors import ConfigError
from nip_like.experiment import format_metrics, run_experiment
from nip_like.sweeps.multirun import run_multirun_job
from nip_like.sweeps.progress import progress_from_environment


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _run(config: DictConfig) -> None:
    # Set here as well as in main(): a launcher may run jobs in fresh worker processes.
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # In a sweep, a failing job must not stop the others: it reports its error in one line
    # and raises, Hydra records the failure, runs the other jobs, then raises the first failure.
    # A job of a sweep run again skips, resumes or restarts (nip_like.sweeps.multirun).
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        if distributed.current().enabled:
            with report_errors():
                raise ConfigError("a sweep (--multirun) cannot run under torchrun: start each run with torchrun instead")
        with report_job_errors(run_dir):
            metrics = run_multirun_job(config, run_dir)
    else:
        with report_errors():
            metrics = run_experiment(config, run_dir, progress=progress_from_environment)
    if metrics is not None and config.logger.print_metrics and distributed.current().is_writer:
        print(f"Final test metrics ({run_dir}):")
        print(format_metrics(metrics))


def main() -> None:
    """Console entry point."""
    start_up.pause_for_start_up()  # the imports of the run's build (TorchRL, transformers) happen later, lazily
    register_configs()
    # Like ``python -m``, let a trainer in the current folder load by dotted path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # TorchRL announces every storage allocation at INFO; keep the console for progress and results.
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    # Let Hydra's config errors propagate, so that they are reported in one line.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        with report_errors():
            # A trainer, scenario or protocol in the user's file registers its schema when imported: before composing.
            check_group_options(sys.argv[1:])
            sys.argv[1:] = select_user_components(sys.argv[1:])
            sys.argv[1:] = distributed.hydra_overrides(sys.argv[1:])
            _run()
    except KeyboardInterrupt:  # before or after the run (a run reports its own interruption)
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        start_up.start_up_over()  # the run ended, or never got built (a refused config, --cfg job, ...)
        run_lock.release_all()
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
