"""A step process ends with its run process.

Dagster's multiprocess executor forks each step from a forkserver, so a step's parent is the
forkserver, which outlives a killed run process (each step holds it open). A step left behind
finished its work and committed to Delta after its run was SIGKILLed, then idled forever. Python's
multiprocessing gives every such child a sentinel on the process that asked for it (the run
process); it reads as closed the moment that process dies, whatever killed it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading

import psutil

_started = False
_lock = threading.Lock()


def exit_with_run_process() -> bool:
    """In a step process started by the multiprocess executor: a daemon thread that waits for the run
    process to die, then SIGKILLs every process this step started (the embedded Ray's GCS, raylet,
    agents and workers, compute-log tails) and the step itself, so nothing it began keeps writing.
    Returns whether it is watching; False where there is no multiprocessing parent (an in-process
    run, a sensor, a test): there the process is the run, and its own death ends it."""
    global _started
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    with _lock:
        if not _started:
            threading.Thread(target=_watch, args=(parent,), name="exit-with-run", daemon=True).start()
            _started = True
    return True


def _watch(parent) -> None:
    from multiprocessing.connection import wait

    wait([parent.sentinel])
    kill_tree_and_self(f"run process {parent.pid} is gone")


def kill_tree_and_self(reason: str) -> None:
    """SIGKILL: a step that lost its run has nobody to report to, and a graceful stop could still commit."""
    me = psutil.Process()
    children = me.children(recursive=True)
    # stderr, not the Dagster log: the run that owned the log is gone.
    print(
        f"[video-assets] {reason}: killing this step (pid {me.pid}) and {len(children)} processes it started",
        file=sys.stderr,
        flush=True,
    )
    for child in children:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    os.kill(me.pid, signal.SIGKILL)
