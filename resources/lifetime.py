"""A step process ends with its run process.

Dagster's multiprocess executor forks each step from a forkserver, so a step's parent is the
forkserver, which outlives a killed run process (each step holds it open). A step left behind
finished its work and committed to Delta after its run was SIGKILLed, then idled forever. Python's
multiprocessing gives every such child a sentinel on the process that asked for it (the run
process); it reads as closed the moment that process dies, whatever killed it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

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
    _kill(children)
    os.kill(me.pid, signal.SIGKILL)


def forkserver_ends_with_its_run() -> bool:
    """In the multiprocess executor's forkserver (it preloads ``resources.forkserver``): the kernel SIGKILLs it
    when the run process that started it dies. The forkserver exits on its own only once every holder of its
    "alive" pipe is gone, and each step it forks holds one: a stop once left it running after the run and its
    steps had ended (CI, under load). A forked step does not inherit this. Linux only; False elsewhere."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # The run process may have died before the call: then this process was re-parented already.
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _kill(processes: list[psutil.Process]) -> None:
    for proc in processes:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


# A stop: SIGTERM (Kubernetes, systemd) or SIGINT (Ctrl-C) to a process of this product. Whoever holds the
# Python handler at that moment (ours, Dagster's interrupt capture inside a run, Ray's after ray.init), the
# signal is also written to a wakeup pipe (signal.set_wakeup_fd) that a thread reads: that sets the stop
# flag, which every "start something new" place checks (the next job, the next batch, a Ray start), and
# arms a last resort that ends the process tree if the graceful stop has not finished in time.
STOP_GRACE_S = 25.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_stop = threading.Event()
_stop_signal: list[int] = []
_watching = False


def stop_requested() -> bool:
    """Whether this process was asked to stop (SIGTERM or SIGINT) since ``watch_stop_signals``."""
    return _stop.is_set()


def stop_exit_code() -> int:
    """128 + the signal's number, as a shell reports a process ended by it."""
    return 128 + (_stop_signal[0] if _stop_signal else signal.SIGTERM)


def watch_stop_signals(grace_s: float = STOP_GRACE_S, handlers: bool = True) -> bool:
    """In a process's main thread: SIGTERM and SIGINT set the stop flag and end the process and everything it
    started ``grace_s`` after the first one if it is still alive; with ``handlers`` (a CLI) they also raise
    KeyboardInterrupt where nothing else handles them (inside a run Dagster's capture turns them into an
    interrupted step; a step process keeps Dagster's handlers). Returns whether it is watching (False off the
    main thread, or when the process watches already)."""
    global _watching
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _watching:
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if handlers:
            for sig in STOP_SIGNALS:
                signal.signal(sig, _interrupt)
        threading.Thread(target=_read_signals, args=(read, grace_s), name="stop-signals", daemon=True).start()
        _watching = True
    return True


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _read_signals(fd: int, grace_s: float) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum in STOP_SIGNALS and not _stop.is_set():
                _stop_signal.append(signum)
                _stop.set()
                print(
                    f"[video-assets] {signal.Signals(signum).name}: stopping; nothing new starts "
                    f"(the process ends within {grace_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
                threading.Thread(target=_last_resort, args=(grace_s,), name="stop-deadline", daemon=True).start()


def _last_resort(grace_s: float) -> None:
    """The graceful stop (the step interrupted, Ray shut down, the run marked) did not finish in time."""
    time.sleep(grace_s)
    _kill(psutil.Process().children(recursive=True))
    print(f"[video-assets] not stopped {grace_s:g} s after the signal: ended", file=sys.stderr, flush=True)
    os._exit(stop_exit_code())


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within (a Ray start): SIGTERM and SIGINT raise KeyboardInterrupt at once, so a stop abandons the start
    instead of waiting for it (Dagster defers interrupts while resources start); after, the handlers there
    before are put back, undoing the one ``ray.init`` installs (``sys.exit`` on SIGTERM: in a step an
    unexpected error instead of an interrupt, and the run went on). Main thread only: elsewhere Ray sets none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    try:
        if stop_requested():
            raise KeyboardInterrupt("stopping: nothing new starts after a stop signal")
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
