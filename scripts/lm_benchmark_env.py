"""The process environment of the LM benchmark scripts, set before torch is imported.

``benchmark_lm.py``, ``benchmark_lm_rollout.py`` and ``benchmark_lm_chat.py``
call :func:`set_script_environment` when run from the command line, before
they import torch (``OMP_WAIT_POLICY`` is read then). This module imports
nothing heavy, so that a script can import it first. Importing a benchmark
script, as the tests do, leaves the environment alone.
"""

from __future__ import annotations

import os

#: Environment of a run from the command line (values already set are kept).
SCRIPT_ENVIRONMENT: dict[str, str] = {
    # Nothing is downloaded.
    "HF_HUB_OFFLINE": "1",
    # TRL warns that rollout_func is experimental; the benchmark uses it on purpose.
    "TRL_EXPERIMENTAL_SILENCE": "1",
    # Idle OpenMP threads sleep instead of spinning. With the default policy, two torch threads on two
    # cores that another process also uses make these tiny models about 100 times slower (a thread
    # spins at each parallel region until the other gets a time slice). Read when torch is imported.
    "OMP_WAIT_POLICY": "PASSIVE",
    # The CPU memory probe starts the profiler while tensors are alive, which PyTorch warns about.
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # TRL's DPO shows a progress bar while it precomputes the reference log-probs.
    "TQDM_DISABLE": "1",
}


def set_script_environment() -> None:
    """Set every variable of :data:`SCRIPT_ENVIRONMENT` that the environment does not already set."""
    for name, value in SCRIPT_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
