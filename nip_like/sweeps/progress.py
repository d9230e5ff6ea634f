"""How a job tells a sweep how far it has got: a small file holding one number.

A sweep started by ``scripts/run_sweep.py`` sets the environment variable
:data:`PROGRESS_FILE_ENV` for each job. The job's entry point hands
:func:`progress_from_environment` to :func:`nip_like.experiment.run_experiment`,
and the job then writes into that file the
number of loop iterations it has completed, counting those of earlier sessions
when it resumed, after every iteration of every loop decorated with
:func:`~nip_like.trainers.base.attach_progress_bar`. The sweep reads the files
to advance its one overall progress bar.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable naming the progress file of a job.
PROGRESS_FILE_ENV = "NIP_LIKE_PROGRESS_FILE"


class ProgressFile:
    """Count completed iterations and write the count to a file.

    An instance is callable with a number of iterations, as
    :attr:`nip_like.trainers.base.Trainer.on_progress` expects.

    Parameters
    ----------
    path : Path
        The file to write.
    done : int
        Iterations completed before this session (a resumed run's).
    """

    def __init__(self, path: Path, done: int = 0) -> None:
        self.path = Path(path)
        self.done = int(done)
        self._write()

    def __call__(self, iterations: int) -> None:
        """Add ``iterations`` to the count and rewrite the file."""
        self.done += int(iterations)
        self._write()

    def _write(self) -> None:
        # Replace the file in one step, so that a reader never sees it half written.
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(str(self.done))
        os.replace(temporary, self.path)


def progress_from_environment(done: int) -> ProgressFile | None:
    """The progress hook of a job that a sweep started (:data:`PROGRESS_FILE_ENV` set), else None.

    Parameters
    ----------
    done : int
        Iterations the job completed in earlier sessions.
    """
    path = os.environ.get(PROGRESS_FILE_ENV)
    return ProgressFile(Path(path), done) if path else None


def read_progress(path: Path) -> int | None:
    """Return the count in a progress file, or ``None`` if there is none yet."""
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
