"""The Dagster instance is created once, before parallel use: commands first-touching a fresh
DAGSTER_HOME at once left the SQLite run storage with two alembic heads (1 in 3 tries), after which
every command failed. `video-assets` (every subcommand, and `make ui` through `video-assets init`)
creates it under a file lock first."""

import ctypes
import fcntl
import os
import re
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.samples import REPO
from video_assets.cli import INIT_LOCK


def _env(home) -> dict:
    # PYTHONPATH first: the checkout under test, not whatever the console script was installed from.
    return {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)}


def _start(home) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "video_assets.cli", "init"],
        cwd=REPO,
        env=_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # this test's own child, by PID
            proc.wait(timeout=30)


class _Opens:
    """Counts the opens of one file by anyone (inotify), read without blocking. Closes are watched
    too: inotify merges identical unread events, and an open, close, open reads as three."""

    IN_OPEN, IN_CLOSE = 0x20, 0x08 | 0x10

    def __init__(self, path: Path):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, ctypes.get_errno()
        assert self._libc.inotify_add_watch(self.fd, str(path).encode(), self.IN_OPEN | self.IN_CLOSE) >= 0
        self.count = 0

    def poll(self) -> int:
        try:
            while data := os.read(self.fd, 4096):
                for offset in range(0, len(data), 16):  # events of a watched file carry no name: 16 bytes
                    _, mask, _, _ = struct.unpack_from("iIII", data, offset)
                    self.count += bool(mask & self.IN_OPEN)
        except BlockingIOError:
            pass
        return self.count

    def close(self) -> None:
        os.close(self.fd)


def _blocked_on(path: Path, pid: int) -> bool:
    """Whether ``pid`` waits in flock() for ``path``: the kernel lists it as a blocked waiter ("->")."""
    inode = os.stat(path).st_ino
    waiters = re.findall(r"->\s+FLOCK\s+\S+\s+\S+\s+(\d+)\s+\S+:(\d+)\s", Path("/proc/locks").read_text())
    return (str(pid), str(inode)) in waiters


def _alembic_heads(db) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]


def test_two_commands_on_a_fresh_home_at_once(tmp_path):
    home = tmp_path / "fresh_home"  # does not exist yet: the commands create it
    procs = [_start(home), _start(home)]
    try:
        outs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        _stop(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert (home / "dagster.yaml").read_text() == (REPO / "dagster_home" / "dagster.yaml").read_text()
    for db in (home / "history" / "runs.db", home / "schedules" / "schedules.db", home / "history/runs/index.db"):
        assert len(_alembic_heads(db)) == 1, db
    # And the instance works for the next command.
    after = subprocess.run(
        [sys.executable, "-c", "from dagster import DagsterInstance; print(len(DagsterInstance.get().get_runs()))"],
        cwd=REPO,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert after.returncode == 0 and after.stdout.strip() == "0", after.stderr[-3000:]


def test_a_command_waits_for_the_one_creating_the_instance(tmp_path):
    # While another process holds the lock (as the first command does while it creates the storages),
    # a second command creates nothing; it proceeds once the lock is released.
    home = tmp_path / "home"
    home.mkdir()
    path = home / INIT_LOCK
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        opens = _Opens(path)  # from here on, every open of the lock file is the command's
        proc = _start(home)
        try:
            # Contended: the command waits in flock() for our lock (the kernel lists it as a waiter),
            # or, were it a polling lock, opened the file again after a failed try. Not a fixed wait:
            # whatever the machine's speed, the command is seen at the lock before anything is checked.
            deadline = time.monotonic() + 120
            while not (_blocked_on(path, proc.pid) or opens.poll() >= 2):
                assert proc.poll() is None, f"finished while the lock was held:\n{proc.communicate()[0]}"
                assert time.monotonic() < deadline, "the command never reached the instance lock in 120 s"
                time.sleep(0.05)
            assert proc.poll() is None
            assert not (home / "history").exists() and not (home / "dagster.yaml").exists()
        except BaseException:
            _stop([proc])
            raise
        finally:
            opens.close()
    try:
        out = proc.communicate(timeout=180)[0]
    finally:
        _stop([proc])
    assert proc.returncode == 0, out
    assert len(_alembic_heads(home / "history" / "runs.db")) == 1
