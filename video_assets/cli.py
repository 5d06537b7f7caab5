"""`video-assets`: register an existing archive in one go, run the demo, show where things are."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

from dagster import DagsterInstance

from resources.settings import REPO_ROOT, dagster_home

INSTANCE_TEMPLATE = REPO_ROOT / "dagster_home" / "dagster.yaml"
INIT_LOCK = ".instance-init.lock"


def init_instance(home: Path | None = None) -> Path:
    """Create the Dagster instance's SQLite storages once, under an exclusive file lock in
    DAGSTER_HOME: two commands first-touching a fresh home at once each stamped the run storage's
    schema, leaving two alembic heads, after which every command failed. Later callers wait for the
    first and find the storages made. Copies the checked-in dagster.yaml into a new home. Returns the home."""
    home = Path(home or dagster_home())
    home.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(home / INIT_LOCK):  # an OS lock: released when this process dies too
        config = home / "dagster.yaml"
        if not config.exists() and INSTANCE_TEMPLATE.exists() and INSTANCE_TEMPLATE != config:
            shutil.copy(INSTANCE_TEMPLATE, config)
        with DagsterInstance.get() as instance:
            # Each touches (and on first use creates and stamps) one storage: runs, event log, schedules.
            instance.get_runs(limit=1)
            instance.event_log_storage.get_asset_records([])
            instance.all_instigator_state()
    return home


def _resources(*names: str) -> dict:
    """The named resources of the definitions (default: volume, tables, vlm), initialised."""
    from video_assets.definitions import build_resources

    built = build_resources()
    # EnvVar-backed fields resolve here, as they would inside a run (Ray is only started by runs).
    return {k: built[k].process_config_and_initialize() for k in (names or ("volume", "tables", "vlm"))}


def _partition_target(first: str, last: str) -> dict:
    """execute_in_process / materialize arguments for one batch or a range of them (one run, as a
    single-run backfill runs it)."""
    from video_assets.defs.maintenance.reprocess import RANGE_END_TAG, RANGE_START_TAG

    if first == last:
        return {"partition_key": first}
    return {"tags": {RANGE_START_TAG: first, RANGE_END_TAG: last}}


def preflight() -> list[str]:
    """What the settings get wrong, checked before any work, each problem naming its setting: the use
    cases, the volume, the tables root (each resource's own start-up check, which runs check again as
    their steps start)."""
    from video_assets.definitions import build_resources

    built, problems = build_resources(), []
    for key in ("structurer", "volume", "tables"):
        try:
            built[key].process_config_and_initialize()
        except (ValueError, RuntimeError) as exc:  # VolumeUnavailable and TablesUnavailable are RuntimeErrors
            problems.append(str(exc))
    return problems


def register_archive(instance: DagsterInstance, batch_size: int | None = None) -> list[str]:
    """Register every unseen file of the volume, as many batches as needed; returns the new batch keys."""
    from video_assets.core.uploads.discovery import printable
    from video_assets.defs.ingest.registration import (
        manifest_batch_keys,
        read_manifest,
        refused_event,
        register_new_files,
    )
    from video_assets.defs.partitions import video_batches

    res = _resources()
    volume, tables = res["volume"], res["tables"]
    if batch_size:
        volume = type(volume)(**{**volume.model_dump(), "batch_size": batch_size})  # model_copy skips config
    listing = volume.listing()
    files = listing.files
    print(f"volume {volume.uri}: {len(files)} video files, {len(listing.refused)} entries refused")
    refused = list(listing.refused)
    while True:
        plan = register_new_files(volume, tables, files)
        refused += plan.unreadable
        unreadable = {r.uri for r in plan.unreadable}
        files = [f for f in files if f.uri not in unreadable]  # tried once per command
        for dup in plan.duplicates:
            print(f"  duplicate: {printable(dup.uri)} has the same bytes as {printable(dup.duplicate_of)}")
        if (event := plan.manifest_event(tables)) is not None:
            instance.report_runless_asset_event(event)
        if plan.remaining == 0:
            break
    for r in refused:
        print(f"  refused: {printable(r.uri)}: {r.reason}")
    if (event := refused_event(refused)) is not None:
        instance.report_runless_asset_event(event)
    known = set(instance.get_dynamic_partitions(video_batches.name))
    new = [k for k in manifest_batch_keys(read_manifest(tables)) if k not in known]
    if new:
        instance.add_dynamic_partitions(video_batches.name, new)
    for k in new:
        print(f"  new batch {k}")
    return new


QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def register_model(instance: DagsterInstance) -> bool:
    """The unpartitioned model assets (vlm_model, caption_prompt): idempotent, so run every time."""
    from video_assets.definitions import defs
    from video_assets.defs.registry import TINY_WARNING

    result = defs.resolve_job_def("register_model").execute_in_process(
        instance=instance, raise_on_error=False, run_config=QUIET
    )
    print(f"register_model: run {result.run_id} {'succeeded' if result.success else 'FAILED'}")
    if result.success and _resources()["vlm"].is_tiny:
        print(f"\n*** {TINY_WARNING} ***\n")
    return result.success


def run_batches(instance: DagsterInstance, keys: list[str]) -> bool:
    """The batch pipeline for ``keys``: one run per stretch of consecutive batches (a partition range, as
    a backfill runs it: every per-batch asset takes a range in one step), so Ray and the models start
    once per step, not once a batch."""
    from resources.lifetime import stop_requested
    from video_assets.definitions import defs
    from video_assets.defs.partitions import consecutive_ranges, video_batches

    job = defs.resolve_job_def("batch_pipeline")
    ok = True
    for first, last in consecutive_ranges(instance.get_dynamic_partitions(video_batches.name), keys):
        if stop_requested():
            raise Stopped(f"batches from {first} on not started")
        started = time.monotonic()
        label = f"batch {first}" if first == last else f"batches {first}...{last}"
        target = _partition_target(first, last)
        result = job.execute_in_process(**target, instance=instance, raise_on_error=False, run_config=QUIET)
        status = "succeeded" if result.success else "FAILED"
        print(f"{label}: run {result.run_id} {status} in {time.monotonic() - started:.1f}s")
        for check in failed_checks(result):
            print(f"  {check}")
        ok &= result.success
    return ok


def failed_checks(result) -> list[str]:
    """A line for each blocking check of the run that failed (it stopped the batch's later assets), with why."""
    return [
        f"check {c.asset_key.to_user_string()}:{c.check_name} failed, blocking the batch"
        + (f": {c.description}" if c.description else "")
        for c in result.get_asset_check_evaluations()
        if not c.passed and c.blocking
    ]


def _recorder_running() -> dict | None:
    """The pid file of this instance's recorder, when the process it names is still that recorder."""
    import json

    from resources.settings import recorder_files
    from video_assets.core.processes import still_running

    try:
        info = json.loads(recorder_files()[0].read_text())
    except (OSError, ValueError):
        return None
    return info if still_running(info["pid"], info["started_at"]) else None


def record_command(args) -> int:
    """Record every camera of ``--config`` into the volume (``core.streams``), one thread per camera, until
    interrupted (or ``--seconds``); each finished segment is a ``stream_segments`` row. One recorder per
    instance, known by its pid file: ``--detach`` starts it in the background, ``--stop`` ends it (SIGTERM:
    the segments being written are finished), ``--status`` says whether it runs and what each camera does
    (its ``camera_health`` row); each failed connection is logged at warning level."""
    import json
    import logging
    import os
    import signal
    import threading

    from resources.settings import recorder_files, stream_credentials
    from video_assets.core.streams.config import load_cameras
    from video_assets.core.streams.recorder import record_all

    pid_file, log_file = recorder_files()
    running = _recorder_running()
    if args.status or args.stop:
        if running is None:
            pid_file.unlink(missing_ok=True)  # a stale file of a recorder that died
            print("no recorder running")
            return 0
        if args.status:
            print(f"recorder running (pid {running['pid']}, {running['config']}); log {log_file}")
            print("\n".join(_camera_lines(running)))
            return 0
        return _stop_recorder(running["pid"], pid_file)
    if not args.config:
        print("video-assets record: --config FILE is needed (or --stop / --status)", file=sys.stderr)
        return 2
    if running is not None:
        print(f"video-assets record: already recording (pid {running['pid']}); `video-assets record --stop` first",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        cameras = load_cameras(args.config)
    except ValueError as exc:
        print(f"video-assets record: {exc}", file=sys.stderr)
        return 2
    if args.detach:
        return _detach_recorder(args, pid_file, log_file)
    res = _resources()
    volume, tables = res["volume"], res["tables"]
    try:
        folders = {c.name: volume.stream_folder(c.name) for c in cameras}
    except ValueError as exc:
        print(f"video-assets record: {exc}", file=sys.stderr)
        return 2
    stop, on_segment, on_health = threading.Event(), segment_writer(tables), health_writer(tables)
    handler = logging.StreamHandler()  # stderr: the terminal, or the detached recorder's log
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    streams_log = logging.getLogger("video_assets.core.streams")
    streams_log.addHandler(handler)
    streams_log.setLevel(logging.INFO)
    streams_log.propagate = False
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.seconds:
        threading.Timer(args.seconds, stop.set).start()
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    config = str(Path(args.config).resolve())
    pid_file.write_text(json.dumps({"pid": os.getpid(), "started_at": time.time(), "config": config}))
    try:
        for c in cameras:
            print(f"recording {c.name} from {c.redacted} into {folders[c.name]} (segments of {c.segment_s:g} s)",
                  flush=True)  # fmt: skip
        record_all(cameras, folders.__getitem__, on_segment, stop, env=stream_credentials(), on_health=on_health)
    finally:
        pid_file.unlink(missing_ok=True)
    print("recorder stopped", flush=True)
    return 0


def segment_writer(tables):
    """What the recorder does with each finished segment: its ``stream_segments`` row (one writer at a time,
    each row one commit keyed by the file, so a rerun writes it once), reported to the instance as a
    ``stream_segments`` materialisation, and a line on stdout."""
    import threading
    from datetime import UTC, datetime

    from video_assets.core.tables import KEYS, STREAM_SEGMENTS, to_arrow
    from video_assets.defs.reports import report_write

    lock = threading.Lock()

    def on_segment(row: dict) -> None:
        with lock:
            tables.merge(
                STREAM_SEGMENTS,
                to_arrow(STREAM_SEGMENTS, [{**row, "recorded_at": datetime.now(UTC)}]),
                KEYS[STREAM_SEGMENTS],
            )
            try:
                report_write(STREAM_SEGMENTS, {"camera": row["camera"], "uri": row["uri"], "reason": row["reason"]})
            except Exception as exc:  # the row is written; only the instance was not told: said, the camera goes on
                print(f"warning: segment {row['uri']} not reported to the Dagster instance: {exc!r}"[:500],
                      file=sys.stderr, flush=True)  # fmt: skip
        print(f"{row['camera']}: {row['uri']} ({row['duration_s']:.1f} s, {row['frames']} frames; {row['reason']})",
              flush=True)  # fmt: skip

    return on_segment


def health_writer(tables):
    """What the recorder does with each change of a camera's health: its ``camera_health`` row (key ``camera``)."""
    import threading

    from video_assets.core.tables import CAMERA_HEALTH, KEYS, to_arrow

    lock = threading.Lock()

    def on_health(row: dict) -> None:
        with lock:
            tables.merge(CAMERA_HEALTH, to_arrow(CAMERA_HEALTH, [row]), KEYS[CAMERA_HEALTH])

    return on_health


def _camera_lines(running: dict) -> list[str]:
    """One line per camera of the running recorder's config, from the ``camera_health`` rows it wrote."""
    from datetime import UTC, datetime

    from video_assets.core.streams.config import load_cameras
    from video_assets.core.tables import CAMERA_HEALTH, SCHEMAS

    try:
        names = [c.name for c in load_cameras(running["config"])]
        rows = _resources("tables")["tables"].read(CAMERA_HEALTH, SCHEMAS[CAMERA_HEALTH]).to_dicts()
    except Exception as exc:  # the status still says the recorder runs
        return [f"  cameras unknown: {exc.__class__.__name__}: {exc}"]
    started = datetime.fromtimestamp(running["started_at"], UTC)
    health = {r["camera"]: r for r in rows if r["updated_at"] >= started}  # this recorder's, not a previous one's

    def at(t) -> str:
        return f"{t:%Y-%m-%d %H:%M:%S}Z"

    lines = []
    for name in names:
        r = health.get(name)
        if r is None:
            lines.append(f"  {name}: connecting (no report yet)")
            continue
        line = f"  {name}: {r['status']} since {at(r['since'])}, {r['connects']} connection(s)"
        if r["consecutive_failures"]:
            line += f", {r['consecutive_failures']} failed in a row"
        if r["last_error"]:
            line += f"; last error ({at(r['last_error_at'])}): {r['last_error']}"
        last = f"{r['last_segment']} ({at(r['last_segment_at'])})" if r["last_segment"] else "none"
        lines.append(f"{line}; last segment: {last}")
    return lines


def _detach_recorder(args, pid_file: Path, log_file: Path) -> int:
    """Start the recorder as a process of its own session (it outlives this command and its terminal), and
    wait until it has written its pid file (or failed: the end of its log is shown)."""
    import subprocess

    log_file.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "video_assets.cli", "record", "--config", str(Path(args.config).resolve())]
    if args.seconds:
        command += ["--seconds", str(args.seconds)]
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO_ROOT)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = _recorder_running()
        if info is not None and info["pid"] == proc.pid:
            print(f"recording in the background (pid {proc.pid}); log {log_file}; stop: video-assets record --stop")
            return 0
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
    print(f"video-assets record: the recorder did not start; its log ({log_file}):\n{tail}", file=sys.stderr)
    return 2


def _stop_recorder(pid: int, pid_file: Path, timeout: float = 60.0) -> int:
    """SIGTERM (each camera finishes its segment), then SIGKILL after ``timeout``; the pid file goes with it."""
    import psutil

    proc = psutil.Process(pid)
    proc.terminate()
    _, alive = psutil.wait_procs([proc], timeout=timeout)
    for p in alive:
        p.kill()
    pid_file.unlink(missing_ok=True)
    print(
        f"recorder stopped (pid {pid})" + (f"; killed, it had not stopped {timeout:g} s after SIGTERM" if alive else "")
    )
    return 0


def retention_command(args) -> int:
    """Delete stream segments older than ``--days`` from the volume (their stream_segments rows keep the
    record, with ``deleted_at``), except the evidence of an alert or a review label; ``--dry-run`` lists."""
    from datetime import UTC, datetime

    res = _resources()
    tables, volume = res["tables"], res["volume"]
    if args.release:
        return release(tables, args.release, datetime.now(UTC))
    if args.days is None:
        print("video-assets retention: --days N is needed (or --release URI ...)", file=sys.stderr)
        return 2
    return retention(tables, volume, args.days, args.dry_run, datetime.now(UTC))


def release(tables, uris: list[str], now) -> int:
    """Release segments from the evidence hold: the next retention may delete them although an alert or a
    label points at them. An unknown file is an error naming it, and nothing is marked."""
    from video_assets.core.tables import KEYS, SCHEMAS, STREAM_SEGMENTS, to_arrow

    segments = {s["uri"]: s for s in tables.read(STREAM_SEGMENTS, SCHEMAS[STREAM_SEGMENTS]).to_dicts()}
    unknown = [u for u in uris if u not in segments]
    if unknown:
        print(f"video-assets retention: not a recorded stream segment: {', '.join(unknown)}", file=sys.stderr)
        return 2
    rows = [
        {**segments[u], "released_at": segments[u].get("released_at") or now} for u in uris
    ]  # old tables: no column
    tables.merge(STREAM_SEGMENTS, to_arrow(STREAM_SEGMENTS, rows), KEYS[STREAM_SEGMENTS])
    for u in uris:
        print(f"released {u}: the next retention past its age deletes it")
    return 0


def retention(tables, volume, days: float, dry_run: bool, now) -> int:
    """``retention_command``'s work on given resources (tests); prints what goes and what is kept."""
    from video_assets.core.streams.retention import expired
    from video_assets.core.tables import ALERTS, KEYS, REVIEW_LABELS, SCHEMAS, STREAM_SEGMENTS, to_arrow

    segments = tables.read(STREAM_SEGMENTS, SCHEMAS[STREAM_SEGMENTS]).to_dicts()
    evidence = set(tables.read(ALERTS, SCHEMAS[ALERTS]).get_column("uri").to_list())
    evidence |= set(u for u in tables.read(REVIEW_LABELS, SCHEMAS[REVIEW_LABELS]).get_column("uri").to_list() if u)
    try:
        gone, kept = expired(segments, now, days, evidence)
    except ValueError as exc:
        print(f"video-assets retention: {exc}", file=sys.stderr)
        return 2
    for s in kept:
        print(f"keep {s['uri']} (evidence: an alert or a review label; `--release URI` lets it go)")
    for s in gone:
        print(
            f"{'would delete' if dry_run else 'delete'} {s['uri']} ({s['camera']}, ended {s['ended_at']:%Y-%m-%d %H:%M})"
        )
    if dry_run:
        print(f"dry run: {len(gone)} segment(s) would be deleted, {len(kept)} kept as evidence")
        return 0
    for s in gone:
        volume.delete(s["uri"])
        # One row at a time, after its file: a crash leaves a row to mark, never a row pointing at nothing.
        tables.merge(STREAM_SEGMENTS, to_arrow(STREAM_SEGMENTS, [{**s, "deleted_at": now}]), KEYS[STREAM_SEGMENTS])
    print(f"{len(gone)} segment(s) deleted, {len(kept)} kept as evidence")
    return 0


def reprocess_command(args) -> int:
    """The batches whose rows came from a model, prompt or structuring no longer in production, each run
    again through exactly the assets downstream of what changed (``defs.maintenance.reprocess``)."""
    from dagster import AssetSelection

    from video_assets.definitions import defs
    from video_assets.defs.common import PER_BATCH_TAG
    from video_assets.defs.maintenance.reprocess import reprocess_plan, runs
    from video_assets.defs.partitions import video_batches

    instance = DagsterInstance.get()
    res = _resources("tables", "mlflow_registry", "vlm", "structurer")
    graph = defs.resolve_asset_graph()
    plan = reprocess_plan(instance, graph, res["tables"], res["mlflow_registry"], res["vlm"], res["structurer"])
    # A batch a run left unfinished (stopped, failed) runs again whole: the batch job's merges are keyed, so
    # what it had written stays one row per key.
    planned = {step["batch"] for step in plan}
    every = sorted(k.to_user_string() for k in AssetSelection.tag(*PER_BATCH_TAG).resolve(graph))
    for batch, reason in unfinished(instance).items():
        if batch not in planned:
            plan.append({"batch": batch, "root": "raw_videos", "reason": f"unfinished: {reason}", "assets": every})
    if not plan:
        print("nothing to reprocess: every batch is complete and its rows are from production")
        return 0
    for step in plan:
        print(
            f"batch {step['batch']}: stale from {step['root']} ({step['reason']}); assets: {', '.join(step['assets'])}"
        )
    todo = runs(instance.get_dynamic_partitions(video_batches.name), plan)
    for run in todo:
        print(f"run: batches {run['first']}...{run['last']}: {', '.join(run['assets'])}")
    if args.dry_run:
        print(f"dry run: {len(todo)} run(s) not started")
        return 0
    return 0 if all(r.success for r in execute_reprocess(instance, todo)) else 1


def execute_reprocess(instance: DagsterInstance, todo: list[dict], assets=None, resources=None) -> list:
    """Each planned run: the batch pipeline's job on its assets only, over its range of batches. ``assets`` and
    ``resources``: the same assets on other resources (tests; a job's own resources cannot be replaced).
    Returns the runs' results."""
    from dagster import AssetKey

    from resources.lifetime import stop_requested
    from video_assets.definitions import defs

    job = defs.resolve_job_def("batch_pipeline")
    results = []
    for run in todo:
        if stop_requested():
            raise Stopped(f"batches from {run['first']} on not started")
        target = _partition_target(run["first"], run["last"])
        selection = [AssetKey(a) for a in run["assets"]]
        if assets is None:
            result = job.execute_in_process(
                **target, asset_selection=selection, instance=instance, raise_on_error=False, run_config=QUIET
            )
        else:
            from dagster import materialize

            result = materialize(
                assets, selection=selection, **target, instance=instance, resources=resources, raise_on_error=False
            )
        print(
            f"batches {run['first']}...{run['last']}: run {result.run_id} {'succeeded' if result.success else 'FAILED'}"
        )
        results.append(result)
    return results


class Stopped(Exception):
    """A stop signal came (``resources.lifetime``): what was not started, for the operator."""


def unfinished(instance: DagsterInstance) -> dict[str, str]:
    """``{batch: reason}``: the batches a run left unfinished (``defs.maintenance.reprocess.incomplete_batches``)."""
    from video_assets.definitions import defs
    from video_assets.defs.maintenance.reprocess import incomplete_batches
    from video_assets.defs.partitions import video_batches

    keys = instance.get_dynamic_partitions(video_batches.name)
    return incomplete_batches(instance, defs.resolve_asset_graph(), keys)


def demo(args) -> int:
    from resources.lifetime import stop_requested
    from video_assets.defs.partitions import video_batches

    instance = DagsterInstance.get()
    if not register_model(instance):
        return 1
    register_archive(instance, args.batch_size)
    keys = instance.get_dynamic_partitions(video_batches.name)
    # Every batch a run left unfinished (stopped, failed after any asset), not only the never-probed ones.
    todo = keys
    if not args.all:
        left = unfinished(instance)  # read once: it reads every per-batch asset's partitions and the batch runs
        todo = [k for k in keys if k in left]
    print(f"{len(todo)} batch(es) to run of {len(keys)}")
    ok = run_batches(instance, todo)
    if stop_requested():
        raise Stopped("evaluate not started")
    ok &= evaluate(instance)
    _print_where(_resources()["tables"])
    return 0 if ok else 1


def evaluate(instance: DagsterInstance) -> bool:
    """golden_set + eval_scores: the production model and prompt scored on every use case's labels."""
    from video_assets.definitions import defs

    result = defs.resolve_job_def("evaluate").execute_in_process(
        instance=instance, raise_on_error=False, run_config=QUIET
    )
    print(f"evaluate: run {result.run_id} {'succeeded' if result.success else 'FAILED'}")
    return result.success


def _print_where(tables) -> None:
    from video_assets.core.tables import SCHEMAS
    from video_assets.core.uploads.discovery import printable

    print("\nTables (Delta Lake; read with polars.read_delta):")
    for name in SCHEMAS:
        if tables.exists(name):
            # Counted from the Delta log's file statistics: no data file is read (sampled_frames holds images).
            print(f"  {name:16s} {tables.table_uri(name)}  ({tables.row_count(name)} rows)")
    if tables.exists("captions"):
        import polars as pl

        caps = tables.read("captions")
        print(
            f"\ncaptions: {caps.filter(pl.col('status') == 'ok').height} ok, "
            f"{caps.filter(pl.col('status') == 'error').height} error rows; for example:"
        )
        for uri, seg, status, prose, error in (
            caps.sort("uri").head(3).select("uri", "segment", "status", "prose", "error").iter_rows()
        ):
            # A file name is the uploader's text: escaped, so a newline in it cannot forge a summary line.
            print(f"  {printable(uri.rsplit('/', 1)[-1])} [{seg}] {status}: {(prose or error or '')[:90]!r}")
    if tables.exists("structured_events"):
        import polars as pl

        ev = tables.read("structured_events")
        print("\nstructured_events by use case and status:")
        for uc, status, n in ev.group_by("use_case", "status").len().sort("use_case", "status").iter_rows():
            print(f"  {uc:16s} {status:10s} {n}")
        for name in ("alerts", "review_queue"):
            if tables.exists(name):
                print(f"{name}: {tables.row_count(name)} rows")
    if tables.exists("eval_scores"):
        import polars as pl

        last = tables.read("eval_scores").sort("evaluated_at").group_by("use_case").last().sort("use_case")
        print("\neval_scores (latest per use case; the tiny model's scores mean nothing):")
        for r in last.to_dicts():
            print(
                f"  {r['use_case']:16s} model v{r['model_version']} prompt v{r['prompt_version']}: "
                f"{r['scored_videos']}/{r['golden_videos']} scored, flagged F1 {r['flagged_f1']:.2f}, "
                f"macro F1 {r['macro_f1']:.2f}, coverage {r['coverage']:.2f}"
            )
    print(f"\nDagster instance: {dagster_home()}")
    print("Open the UI:      make ui   (then http://127.0.0.1:3000)")


def recover(instance: DagsterInstance) -> list[str]:
    """Runs left STARTED by a killed run process: marked failed, their slots freed (every command does this first)."""
    from video_assets.defs.orphans import fail_orphaned_runs, free_slots_of_finished_runs

    failed = fail_orphaned_runs(instance)
    for run_id in failed:
        print(f"run {run_id}: its process is gone; marked failed (rerun its batch to complete it)")
    for run_id in free_slots_of_finished_runs(instance):
        print(f"run {run_id}: ended with a concurrency slot still claimed; freed")
    return failed


def calibration(instance: DagsterInstance) -> list[tuple[dict, float, int]]:
    """What `predict` calibrates on (``defs.engines.calibration_runs``), or an exit saying what to run first."""
    from video_assets.defs.caption_job import calibration_runs

    found = calibration_runs(instance)
    if not found:
        raise SystemExit("no captions materialisation with measured costs yet: run a batch first (make demo)")
    return found


def predict_command(args) -> int:
    """Wall time for N hours of video on M decode workers and E engines, from the last measured batches."""
    from video_assets.core.throughput import StageCosts, decode_workers, predict

    runs = calibration(DagsterInstance.get())
    costs = StageCosts.from_runs(runs)
    workers = (
        decode_workers(args.cpu_workers, args.cluster_cpus, args.engines) if args.cluster_cpus else args.cpu_workers
    )
    p = predict(costs, args.hours * 3600, workers, args.engines)
    sizes = ", ".join(f"{v:.0f} s of video ({r} requests)" for _, v, r in runs)
    print(f"calibrated on {sizes}: {costs}")
    if len(runs) < 2:
        print("one batch size measured: its fixed and per-request costs cannot be told apart (run another size)")
    print(
        f"{args.hours} h of video on {workers} decode workers and {args.engines} engine(s): "
        f"{p.wall_s / 3600:.2f} h wall ({p.wall_s:.0f} s), bound by {p.bound_by}; "
        f"CPU:accelerator {p.cpu_to_accelerator:.2f}; {p.best_cpu_workers} decode workers keep the engines busy"
    )
    return 0


def ray_service_command(args) -> int:
    """Steps join the service instead of embedding a Ray each (start-up paid once, the caption model served
    by Ray Serve between batches)."""
    from resources import ray_service

    if args.action == "serve-config":
        return serve_config_command(args)
    if args.action == "up":
        info = ray_service.up(args.num_cpus)
        print(
            f"local Ray {'started' if info['started'] else 'already running'} at {info['address']} (this instance's token required)"
        )
    elif args.action == "down":
        print(f"local Ray stopped ({ray_service.down()} processes)")
    else:
        address = ray_service.service_address()
        print(f"local Ray at {address}" if address else "no local Ray service (steps embed their own)")
    return 0


def serve_config_command(args) -> int:
    """A Serve config of the production caption model's application, as the steps would deploy it on the
    cluster they join (RAY_ADDRESS, or `ray up`'s local Ray): deployed by `serve deploy` (or a RayService's
    ``serveConfigV2``), it is the application the steps find and use. Asks that cluster for its GPUs, as a
    step does, and downloads the registered model into VLM_CACHE_DIR once, as a step would."""
    import contextlib
    import json

    import ray

    from resources.ray_service import cluster_address, local_ray_address
    from video_assets.core.media.sampling import SamplingConfig
    from video_assets.core.serving import llm
    from video_assets.core.serving.captioner import serve_config
    from video_assets.defs.engines import engine_name, job_spec, resolve_caption_model

    address = cluster_address() or local_ray_address()
    if not address:
        print(
            "video-assets ray serve-config: no Ray outlives the steps here: set RAY_ADDRESS to the cluster that "
            "will serve the model (or run `video-assets ray up`); with an embedded Ray each step loads its own engine",
            file=sys.stderr,
        )
        return 2
    built = _resources("vlm", "mlflow_registry")
    vlm, registry = built["vlm"], built["mlflow_registry"]
    with contextlib.ExitStack() as auth:
        _join_steps_ray(auth)  # only to ask for its GPUs
        try:
            engine = engine_name(vlm)
            if engine not in ("transformers", "vllm"):
                print(
                    f"video-assets ray serve-config: VLM_ENGINE resolves to {engine}: an endpoint is served "
                    "elsewhere already (VLM_ENDPOINT_URL), there is no model to deploy",
                    file=sys.stderr,
                )
                return 2
            try:
                model, pair, _ = resolve_caption_model(registry, vlm)
            except Exception as exc:  # nothing registered, or the registry unreachable: its message says which
                print(f"video-assets ray serve-config: {exc}", file=sys.stderr)
                return 2
            spec = job_spec(SamplingConfig(), vlm, engine, model, "")
        finally:
            ray.shutdown()
    # Each replica fetches the registered model on its own node: no folder shared between nodes.
    config = llm.serve_config(spec) if engine == "vllm" else serve_config(spec)
    text = (
        f"# Ray Serve config: the caption model {vlm.registered_model} version {pair.model_version} "
        f"({vlm.alias}), written by `video-assets ray serve-config`.\n"
        "# Deploy it unchanged (`serve deploy`, or a RayService's serveConfigV2): the steps use a running\n"
        "# application of this name as it is; a config deploy replaces the applications it does not list.\n"
        + json.dumps(config, indent=2)  # JSON is YAML: no YAML writer needed
        + "\n"
    )
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: application {config['applications'][0]['name']}")
    else:
        print(text, end="")
    return 0


def _join_steps_ray(auth) -> None:
    """Join the Ray the steps use (RAY_ADDRESS's, or `ray up`'s with this instance's token, kept in the
    environment while ``auth``, an ExitStack, stays open). No code shipped: only handles and node reads."""
    from resources.ray_cluster import init_ray
    from resources.ray_service import cluster_address, local_ray_address
    from resources.settings import embedded_ray_auth

    auth.enter_context(embedded_ray_auth())
    init_ray(cluster_address() or local_ray_address(), {})


def _caption_model_chat(registry, timeout_s: float):
    """The ask box's LLM when it is the caption model (LLM_BASE_URL=captioner): the production version's
    endpoint, or its Ray Serve application on the Ray the steps join, which this process joins for its
    lifetime (as a step would)."""
    import contextlib

    from video_assets.defs.engines import caption_model_chat

    vlm = _resources("vlm")["vlm"]
    version = str(registry.resolve_alias(vlm.registered_model, vlm.alias).version)  # its files: fetched once, below
    auth = contextlib.ExitStack()  # kept open: the connection lives as long as the service
    return caption_model_chat(vlm, registry, version, lambda: _join_steps_ray(auth), timeout_s)


def _review_token() -> str:
    """This instance's reviewer token, created once (0600) under DAGSTER_HOME."""
    from resources.settings import ensure_secret_file, review_token_path

    return ensure_secret_file(review_token_path()).read_text().strip()


def serve_command(args) -> int:
    """The search service on this instance's index, with the text and frame encoders behind the alias
    (downloaded from MLflow once, like a step does); fails fast when the index does not exist yet."""
    from resources.archive import FRAMES, TEXT
    from video_assets.service.app import create_app
    from video_assets.service.server import IndexMissing, build_searcher, serve

    res = _resources("tables", "volume", "archive", "mlflow_registry", "search_index_store", "llm")
    archive, registry, index = res["archive"], res["mlflow_registry"], res["search_index_store"]
    if not index.exists():
        print(f"error: no search index at {index.uri}: run `make demo` first", file=sys.stderr)
        return 2
    folders = {}
    for kind in (TEXT, FRAMES):
        name = archive.registered_model(kind)
        try:
            folders[kind] = registry.download_model(name, archive.alias, Path(archive.cache_dir) / "registry")
        except Exception as exc:
            print(f"error: cannot load models:/{name}@{archive.alias} ({exc}): run `make demo` first", file=sys.stderr)
            return 2
    try:
        searcher = build_searcher(
            index.uri,
            folders[TEXT][0],
            folders[FRAMES][0],
            text_version=folders[TEXT][1],
            frame_version=folders[FRAMES][1],
        )
    except IndexMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The ask box's LLM (LLM_BASE_URL); none configured: deterministic plans and extractive answers.
    if res["llm"].uses_captioner:
        try:
            llm = _caption_model_chat(registry, res["llm"].timeout_s)
        except Exception as exc:  # no Ray that outlives the steps, nothing registered: the message says which
            print(f"error: LLM_BASE_URL=captioner: {exc}", file=sys.stderr)
            return 2
    else:
        llm = res["llm"].client()
    print(f"search index {index.uri}; LLM {getattr(llm, 'base_url', llm) if llm else 'none (extractive answers)'}")
    print(f"serving on http://{args.host}:{args.port}/ (review page: /review; its token: video-assets review-token)")
    token = _review_token()
    from video_assets.defs.reports import report_write

    app = create_app(
        searcher, tables=res["tables"], volume=res["volume"], llm=llm, review_token=token, on_write=report_write
    )
    serve(app, args.host, args.port)
    return 0


RUN_LIMIT = re.compile(r"^(\s*max_concurrent_runs:[ \t]*)(\d+)([ \t]*(?:#.*)?)$", re.MULTILINE)


def set_run_limit(home: Path, runs: int) -> str:
    """``concurrency.runs.max_concurrent_runs`` in the instance's dagster.yaml, set to ``runs`` (the run queue reads
    it from there only; the daemon and ``dagster dev`` read it when they start). Returns what was done, or
    raises ValueError naming the line to write when the file has no such integer line."""
    config = home / "dagster.yaml"
    text = config.read_text() if config.exists() else ""
    found = RUN_LIMIT.findall(text)
    if len(found) != 1:
        raise ValueError(f"{config} has no single `max_concurrent_runs: <n>` line: set it to {runs} by hand")
    if int(found[0][1]) != runs:
        tmp = config.with_suffix(".yaml.tmp")
        tmp.write_text(RUN_LIMIT.sub(lambda m: f"{m.group(1)}{runs}{m.group(3)}", text))
        os.replace(tmp, config)  # whole or not at all: a daemon starting now reads one or the other
    return f"runs: at most {runs} at once ({config}; restart the daemon or `make ui` to apply)"


def pools_command(args) -> int:
    """The accelerator pool's limit (dagster.yaml's ``default_limit`` is 1 and cannot come from the
    environment): several model steps at once only on a shared cluster with the GPUs for them. With an
    embedded Ray every step starts its own Ray that sees every local GPU, so it stays 1 there. The run
    limit follows (``run_limit``: one run more than the slots)."""
    from video_assets.core.throughput import accelerator_slots, cluster_gpus, run_limit
    from video_assets.defs.common import ACCELERATOR_POOL

    slots = args.slots
    if args.from_cluster:
        import ray

        from resources.ray_cluster import init_ray
        from resources.ray_service import cluster_address

        if not cluster_address():
            print("video-assets pools --from-cluster: RAY_ADDRESS is not set (embedded Ray: 1 slot)", file=sys.stderr)
            return 2

        vlm = _resources()["vlm"]
        engine = vlm.vllm_settings(vlm.model_source)  # the fields (VLM_* variables) and the `vllm` mapping
        # Engines pinned to one GPU type (vLLM's accelerator_type) can use only those GPUs.
        kind = args.accelerator_type or engine.accelerator_type
        init_ray(None, {})  # only to read the nodes: no code shipped
        try:
            gpus = cluster_gpus(ray.nodes(), kind)
        finally:
            ray.shutdown()
        per_step = vlm.concurrency * engine.tensor_parallel_size
        slots = accelerator_slots(gpus, per_step)
        print(f"cluster GPUs {gpus:g}{f' of type {kind}' if kind else ''}, {per_step} per model step")
    if slots is None or slots < 1:
        print("video-assets pools: --slots must be at least 1", file=sys.stderr)
        return 2
    with DagsterInstance.get() as instance:
        instance.event_log_storage.set_concurrency_slots(ACCELERATOR_POOL, slots)
        home = Path(instance.root_directory)
    print(f"pool {ACCELERATOR_POOL}: {slots} slot(s)")
    try:
        print(set_run_limit(home, run_limit(slots)))
    except ValueError as exc:
        print(f"video-assets pools: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="video-assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("register", help="register every unseen file in the volume as batches")
    reg.add_argument("--batch-size", type=int, default=None)
    dem = sub.add_parser("demo", help="register the volume and run every batch not yet materialised")
    dem.add_argument("--batch-size", type=int, default=None)
    dem.add_argument("--all", action="store_true", help="rerun every batch, not only new ones")
    sub.add_parser("init", help="create the Dagster instance in DAGSTER_HOME (safe to run concurrently)")
    sub.add_parser("recover", help="mark failed the runs whose process was killed, freeing their slots")
    ray_cmd = sub.add_parser(
        "ray",
        help="this instance's long-lived local Ray (up, down, status); serve-config: the caption model's Serve config",
    )
    ray_cmd.add_argument("action", choices=("up", "down", "status", "serve-config"))
    ray_cmd.add_argument("--num-cpus", type=int, default=None, help="logical CPUs (default: all)")
    ray_cmd.add_argument("--output", "-o", default=None, help="serve-config: write the YAML here (default: stdout)")
    pred = sub.add_parser("predict", help="predict wall time for N hours of video from the last measured batch")
    pred.add_argument("--hours", type=float, required=True)
    pred.add_argument("--cpu-workers", type=int, default=2, help="parallel decode tasks")
    pred.add_argument("--engines", type=int, default=1)
    pred.add_argument(
        "--cluster-cpus",
        type=float,
        default=None,
        help="CPUs of the Ray cluster: caps decode workers at what engines leave",
    )
    pools = sub.add_parser(
        "pools",
        help="set the accelerator pool (model steps that may run at once across runs, default 1) and the run limit "
        "(one run more than that, default 2)",
    )
    how = pools.add_mutually_exclusive_group(required=True)
    how.add_argument("--slots", type=int, help="this many")
    how.add_argument(
        "--from-cluster",
        action="store_true",
        help="one per engine group the cluster's GPUs hold (RAY_ADDRESS; vlm concurrency x tensor_parallel_size GPUs each)",
    )
    pools.add_argument(
        "--accelerator-type",
        default=None,
        help="with --from-cluster: count only GPUs of this type (e.g. H100; default: the vlm resource's vllm setting)",
    )
    sub.add_parser("review-token", help="print this instance's reviewer token (the review page's writes need it)")
    rec = sub.add_parser("record", help="record live cameras (a TOML of [[camera]] tables) into the volume")
    rec.add_argument("--config", help="camera config file (docs/streams.md)")
    rec.add_argument(
        "--seconds", type=float, default=None, help="stop after this many seconds (default: until stopped)"
    )
    how_rec = rec.add_mutually_exclusive_group()
    how_rec.add_argument("--detach", action="store_true", help="record in the background (pid file, log)")
    how_rec.add_argument("--stop", action="store_true", help="stop this instance's recorder")
    how_rec.add_argument("--status", action="store_true", help="whether this instance's recorder runs")
    ret = sub.add_parser("retention", help="delete stream segments older than --days, keeping alert/label evidence")
    ret.add_argument("--days", type=float, help="keep segments that ended less than this long ago")
    ret.add_argument("--release", nargs="+", metavar="URI", help="release these segments from the evidence hold")
    ret.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    rep = sub.add_parser(
        "reprocess", help="run again the batches whose rows are not from the production model, prompt or structuring"
    )
    rep.add_argument("--dry-run", action="store_true", help="list the stale batches and the runs, start nothing")
    srv = sub.add_parser("serve", help="the search service and web page (run `make demo` first)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    srv.add_argument("--port", type=int, default=8300)
    args = parser.parse_args(argv)
    if args.command == "ray":
        return ray_service_command(args)
    if args.command in ("demo", "register", "reprocess"):
        from resources.lifetime import watch_stop_signals

        watch_stop_signals()  # SIGTERM / SIGINT: nothing new starts, the process ends within its grace
    try:
        return _command(args)
    except (KeyboardInterrupt, Stopped) as exc:
        from resources.lifetime import stop_exit_code

        note = f": {exc}" if str(exc) else ""
        print(f"video-assets {args.command}: stopped by a signal{note}; run it again to complete", file=sys.stderr)
        return stop_exit_code()


def _command(args) -> int:
    home = init_instance()  # before anything else touches the instance
    if args.command == "init":
        print(f"Dagster instance ready: {home}")
        return 0
    failed = recover(DagsterInstance.get())  # runs whose process is gone: failed, their slots freed
    if args.command == "recover":
        print(f"{len(failed)} orphaned run(s) marked failed")
        return 0
    if args.command == "predict":
        return predict_command(args)
    if args.command == "pools":
        return pools_command(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "record":
        return record_command(args)
    if args.command == "retention":
        return retention_command(args)
    if args.command == "reprocess":
        return reprocess_command(args)
    if args.command == "review-token":
        print(_review_token())  # to the person at the terminal; never to a log
        return 0
    if args.command in ("register", "demo") and (problems := preflight()):
        for problem in problems:
            print(f"video-assets {args.command}: {problem}", file=sys.stderr)
        return 2
    if args.command == "register":
        new = register_archive(DagsterInstance.get(), args.batch_size)
        print(f"{len(new)} new batch(es)")
        return 0
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
