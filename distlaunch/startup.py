"""The launcher's start-up without the cyclic garbage collector.

Start-up allocates tens of thousands of objects that live as long as the process
(modules, classes, functions) and makes next to no reference cycles, yet its
allocations trigger some 25 young-generation collections and a few older ones: ~5 ms of
a ~85 ms single-node launch. ``pause_gc`` turns the collector off for `run` (from the
start of the pre-parsed form, ``preparse``; from click's ``run`` callback);
``resume_gc`` turns it back on, with what start-up made moved to the permanent
generation (``gc.freeze``: later collections skip it), once the workers' supervision
starts (``WorkerGroup.run``) or the mode turns out to be another
(``command.run_parsed``). Reference counting frees everything else meanwhile, as always.
"""

import gc

_paused = False


def pause_gc() -> None:
    """Turn the collector off until ``resume_gc`` (a no-op where it is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """Turn the collector back on if ``pause_gc`` turned it off (else a no-op), after
    freezing what exists now into the permanent generation. Idempotent."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
