"""A run process SIGKILLed mid-step leaves nothing behind: a real run of the per-batch job from the CLI
(`dagster job execute`: multiprocess executor, steps forked from a preloaded forkserver) on bundled
clips is killed once the captions step has started its embedded Ray. Within 30 s no process it
started is alive and no table has a new commit; `video-assets recover` marks the run failed (freeing
its slot in the "accelerator" pool) and the rerun completes the batch. Bounded; loopback only."""

import glob
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import psutil
import pytest
from dagster import DagsterInstance, DagsterRunStatus

from tests.fixtures.processes import cli_env, started_by
from tests.fixtures.samples import REPO, copy_samples

BIN = Path(sys.executable).parent
CLIPS = ["realshort.mp4", "asl_eat.mkv", "chaplin.mp4"]
TABLES = ("raw_videos", "video_metadata", "captions", "structured_events", "alerts", "review_queue")

pytestmark = pytest.mark.e2e


def _run(args, env, timeout=600):
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def _commits(tables: Path) -> dict[str, int]:
    """Commit files per table: a commit anyone makes after the kill shows here."""
    return {t: len(glob.glob(str(tables / t / "_delta_log" / "*.json"))) for t in TABLES}


def _job(key: str) -> list[str]:
    tags = json.dumps({"dagster/partition": key})
    return [
        str(BIN / "dagster"),
        "job",
        "execute",
        "-m",
        "video_assets.definitions",
        "-j",
        "batch_pipeline",
        "--tags",
        tags,
    ]


@pytest.mark.slow
def test_a_killed_run_stops_writing_and_its_rerun_completes(dagster_home, volume_dir, tmp_path):
    copy_samples(volume_dir, CLIPS)
    env = cli_env(dagster_home, volume_dir)
    tables = dagster_home / "tables"
    out = _run([sys.executable, "-m", "video_assets.cli", "register"], env)
    [key] = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("new batch")]
    _run(
        [
            str(BIN / "dagster"),
            "asset",
            "materialize",
            "-m",
            "video_assets.definitions",
            "--select",
            "vlm_model,caption_prompt,speech_model,frame_encoder,text_encoder",
        ],
        env,
    )

    log = tmp_path / "killed_run.log"
    with open(log, "w") as f:
        run = subprocess.Popen(_job(key), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Mid-step: the captions step has started its embedded Ray (a raylet under the run process).
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and run.poll() is None:
            try:
                tree = psutil.Process(run.pid).children(recursive=True)
                if any("raylet" in p.name() for p in tree):
                    break
            except psutil.Error:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"the captions step never started Ray\n{log.read_text()[-4000:]}", pytrace=False)
        before = _commits(tables)
        assert before["captions"] == 0, "captions already committed: the kill came too late to test anything"
        started = started_by(dagster_home)
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)

        # Within 30 s nothing it started is alive (polled: done as soon as the last one is gone), and
        # nothing committed since the kill (with no process left, nothing can commit later).
        deadline = time.monotonic() + 30
        while (left := started_by(dagster_home)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, "still alive 30 s after the kill: " + "; ".join(
            f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in left
        )
        assert len(started) >= 5, [p.pid for p in started]  # the probe saw the run's processes at all
        assert _commits(tables) == before
    finally:
        for proc in started_by(dagster_home):  # only if the assertions above failed
            proc.kill()

    with DagsterInstance.get() as instance:
        [record] = [r for r in instance.get_run_records() if r.dagster_run.job_name == "batch_pipeline"]
        assert record.dagster_run.status == DagsterRunStatus.STARTED  # nobody has noticed yet
    out = _run([sys.executable, "-m", "video_assets.cli", "recover"], env)
    assert f"run {record.dagster_run.run_id}: its process is gone; marked failed" in out
    with DagsterInstance.get() as instance:
        assert instance.get_run_by_id(record.dagster_run.run_id).status == DagsterRunStatus.FAILURE

    _run(_job(key), env, timeout=900)
    caps = pl.read_delta(str(tables / "captions"))
    assert sorted(caps["uri"].str.split("/").list.last().unique()) == sorted(CLIPS)
    assert (caps["status"] == "ok").all()
    events = pl.read_delta(str(tables / "structured_events"))
    assert events.height == caps.height
    assert not started_by(dagster_home)
