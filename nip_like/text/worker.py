"""The worker process of a local fine-tune job: ``python -m nip_like.text.worker JOB_FOLDER``.

Reads ``JOB_FOLDER/spec.json`` (a :class:`~nip_like.text.fine_tune.FineTuneSpec`),
runs it, and keeps ``JOB_FOLDER/status.json`` current (written atomically):
``running`` with its process id while it trains, then ``succeeded`` with the
model's folder, or ``failed`` with a one-line error (the traceback goes to the
job's log). Each optimiser step's metrics are appended to
``JOB_FOLDER/metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from nip_like.checkpoint import write_text_atomic
from nip_like.cli import one_line


def write_status(folder: Path, **status) -> None:
    """Replace the job's ``status.json``."""
    write_text_atomic(json.dumps(status), folder / "status.json")


def main(argv: list[str] | None = None) -> int:
    """Run the job in the folder given on the command line; 0 on success, 1 on failure."""
    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    write_status(folder, status="running", pid=os.getpid())
    try:
        from nip_like.text.fine_tune import FineTuneSpec, fine_tune

        spec = FineTuneSpec.from_json((folder / "spec.json").read_text())
        with open(folder / "metrics.jsonl", "w") as metrics:

            def log(step: dict) -> None:
                metrics.write(json.dumps(step) + "\n")
                metrics.flush()

            print(f"job {spec.job_id}: {spec.method} of {spec.base_model} on {spec.dataset}", flush=True)
            output = fine_tune(spec, log)
        print(f"job {spec.job_id}: saved {output}", flush=True)
        write_status(folder, status="succeeded", pid=os.getpid(), model=str(output))
        return 0
    except BaseException as error:  # noqa: BLE001 - every failure must be reported, then re-raised for the log
        traceback.print_exc()
        write_status(folder, status="failed", pid=os.getpid(), error=one_line(error) or type(error).__name__)
        return 1


if __name__ == "__main__":
    sys.exit(main())
