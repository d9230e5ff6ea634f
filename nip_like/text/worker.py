"""What a fine-tune job runs: :func:`run_job`, submitted through submitit by :mod:`nip_like.text.jobs`.

It reads ``JOB_FOLDER/spec.json`` (a :class:`~nip_like.text.fine_tune.FineTuneSpec`),
runs it, appends each optimiser step's metrics to ``JOB_FOLDER/metrics.jsonl``
and returns the model's folder, which submitit keeps as the job's result. A
failure prints its traceback to the job's log and is raised again as
:class:`JobFailed`, whose message is one line: submitit records it as the
job's error.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

from nip_like import start_up
from nip_like.errors import one_line


class JobFailed(Exception):
    """A fine-tune job failed; the message is its error in one line (the traceback is in the job's log)."""


def run_job(folder: str) -> str:
    """Run the job in ``folder``; the fine-tuned model's folder.

    Raises
    ------
    JobFailed
        With the error in one line, whatever went wrong.
    """
    folder = Path(folder)
    print(f"--- started {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    start_up.pause_for_start_up()  # until the model is loaded (nip_like.start_up)
    try:
        from nip_like.text.fine_tune import FineTuneSpec, fine_tune

        spec = FineTuneSpec.from_json((folder / "spec.json").read_text())
        with open(folder / "metrics.jsonl", "w") as metrics:

            def log(step: dict) -> None:
                metrics.write(json.dumps(step) + "\n")
                metrics.flush()

            print(f"job {spec.job_id}: {spec.method} of {spec.base_model} on {spec.dataset}", flush=True)
            output = fine_tune(spec, log)
    except Exception as error:  # noqa: BLE001 - every failure is reported in one line, its traceback in the log
        traceback.print_exc()
        raise JobFailed(one_line(error) or type(error).__name__) from None
    finally:
        start_up.start_up_over()
    print(f"job {spec.job_id}: saved {output}", flush=True)
    return str(output)
