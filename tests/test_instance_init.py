"""The Dagster instance is created once, before parallel use: commands first-touching a fresh
DAGSTER_HOME at once left the SQLite run storage with two alembic heads (1 in 3 tries), after which
every command failed. `video-assets` (every subcommand, and `make ui` through `video-assets init`)
creates it under a file lock first."""

import fcntl
import os
import sqlite3
import subprocess
import sys
import time

from tests.conftest import REPO
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
    with open(home / INIT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = _start(home)
        try:
            time.sleep(8)  # ample time for it to import and reach the instance (about 3 s here)
            assert proc.poll() is None, proc.communicate()[0]
            assert not (home / "history").exists() and not (home / "dagster.yaml").exists()
        except BaseException:
            _stop([proc])
            raise
    try:
        out = proc.communicate(timeout=180)[0]
    finally:
        _stop([proc])
    assert proc.returncode == 0, out
    assert len(_alembic_heads(home / "history" / "runs.db")) == 1
