"""The multiprocess executor's forkserver ends with the run process that started it, even while a step it forked
is still alive (each step holds the forkserver's "alive" pipe, so on its own it would wait for them). A real
forkserver with the product's preload, its parent SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.fixtures.samples import REPO

# A run process: one step (a sleep) forked from the forkserver; prints the forkserver's pid and the step's.
PARENT = """
import multiprocessing as mp, sys, time, psutil
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(sys.argv[1:])
step = ctx.Process(target=time.sleep, args=(120,))
step.start()
print(psutil.Process(step.pid).ppid(), step.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _forkserver_after_its_parent_is_killed(preload: list[str]) -> bool:
    """Whether the forkserver is still alive 5 s after its parent was SIGKILLed, a step of it still running."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *preload], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    forkserver, step = map(int, parent.stdout.readline().split())
    try:
        assert _alive(forkserver) and _alive(step)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _alive(forkserver) and time.monotonic() < deadline:
            time.sleep(0.1)
        return _alive(forkserver)
    finally:
        for pid in (step, forkserver):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's parent-death signal is Linux's")
def test_the_forkserver_dies_with_its_run_process_while_a_step_lives():
    assert not _forkserver_after_its_parent_is_killed(["resources.forkserver", "json"])
    # Without the product's preload it outlives its parent while the step holds its pipe: the check can fail.
    assert _forkserver_after_its_parent_is_killed(["json"])
