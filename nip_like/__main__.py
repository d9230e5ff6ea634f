"""``python -m nip_like`` / ``nip-like``: run an experiment from the Hydra config.

Examples
--------
``python -m nip_like``                                  the default experiment
``python -m nip_like trainer.num_iterations=50 seed=3``  with overrides
``python -m nip_like --multirun seed=0,1,2``            one run per seed
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from nip_like.cli import CONFIG_DIR, report_errors
from nip_like.config import register_configs
from nip_like.experiment import format_metrics, run_experiment


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _run(config: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with report_errors():
        metrics = run_experiment(config, run_dir)
    if config.logger.print_metrics:
        print(f"Final test metrics ({run_dir}):")
        print(format_metrics(metrics))


def main() -> None:
    """Console entry point."""
    register_configs()
    # Like ``python -m``, let a trainer in the current folder load by dotted path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # TorchRL announces every storage allocation at INFO; keep the console for progress and results.
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    # Let Hydra's config errors propagate, so that they are reported in one line.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    with report_errors():
        _run()


if __name__ == "__main__":
    sys.exit(main())
