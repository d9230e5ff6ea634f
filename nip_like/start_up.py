"""Python's cyclic garbage collector while a program starts.

Importing torch, TensorDict, TorchRL and transformers makes millions of
objects, and the collector walks the growing heap again and again while they
are made: on a 2-core machine about 0.6-0.8 s of the 3-4 s that a run's imports
take (counted with :data:`gc.callbacks`). None of those objects is garbage.
A program that starts, builds one run and trains it (the command line, a
torchrun rank, a resumed run, an evaluation, a fine-tune job) pauses the
collector first (:func:`pause_for_start_up`) and resumes it once the run is
built (:func:`resume_after_start_up`), freezing what the start-up made
(:func:`gc.freeze`): otherwise the first collections after the pause walk all
of it again. Reference counting frees memory as usual throughout; only
reference cycles wait for the collector, and a start-up makes few. When the
run ends (:func:`thaw_start_up`) the frozen objects are handed back to the
collector, so that a program that runs another run after it (a sweep's jobs in
one process) can free the first one's.

Nothing here runs unless a program asks: :func:`nip_like.experiment.run_experiment`
called from Python leaves the collector as it finds it.
"""

from __future__ import annotations

import gc

#: Whether this module paused the collector and has not resumed it yet.
_paused = False
#: Whether this module froze a start-up's objects and has not thawed them yet.
_frozen = False


def pause_for_start_up() -> None:
    """Pause the collector until :func:`resume_after_start_up` (nothing if it is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_after_start_up() -> None:
    """Freeze what the start-up made and turn the collector back on, if :func:`pause_for_start_up` turned it off.

    Otherwise nothing. Called once a run is built, and again (harmlessly)
    when a program ends or fails before that.
    """
    global _paused, _frozen
    if _paused:
        _paused = False
        gc.freeze()
        _frozen = True
        gc.enable()


def thaw_start_up() -> None:
    """Hand the objects :func:`resume_after_start_up` froze back to the collector (nothing if it froze none)."""
    global _frozen
    if _frozen:
        _frozen = False
        gc.unfreeze()


def start_up_over() -> None:
    """The program's run ended, or never got built: the collector back on if it was paused, nothing frozen."""
    resume_after_start_up()
    thaw_start_up()
