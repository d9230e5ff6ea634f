"""Batch sweeps: a grid of runs, each in its own folder, restartable.

Modules
-------
grid
    Compose a sweep config (``configs/sweep/<name>.yaml``) and expand its grid
    into jobs, each with a deterministic folder and its declared iterations.
state
    What a job's folder holds (nothing, a finished run, an interrupted run, an
    incomplete one, a run of another config) and so what to do with it.
runner
    Run the jobs as subprocesses, a few at a time, behind one progress bar.
multirun
    What a job of Hydra's multirun does with a folder that already holds
    something: skip, resume or restart, as the batch script does.
listing
    The text the batch script prints.
progress
    The file through which a job tells the sweep how far it has got.

This package imports nothing from the others at import time, so that
:mod:`nip_like.experiment` can use :mod:`nip_like.sweeps.progress`.
"""
