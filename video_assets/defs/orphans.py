"""Runs whose process died without a word (SIGKILL, OOM, power loss) stay STARTED in the instance, and
the concurrency slots their steps held (the "accelerator" pool) stay taken, so the batch's next run
waits forever. The default run launcher cannot check a run worker's health, so Dagster's run
monitoring does not catch this, and a run started from a CLI has no daemon watching it at all."""

from __future__ import annotations

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from video_assets.core.processes import still_running


def sqlite_runs(instance: DagsterInstance) -> bool:
    """Whether ``instance`` keeps its runs in SQLite (a file of this machine). Dagster has no public way to
    tell its run storage (the class, ``SqliteRunStorage``, is exported only from ``dagster._core``; the
    ``storage`` section of dagster.yaml is read into the instance by private code); hence the private
    module (docs/reliability.md, "Private Ray/Dagster APIs still used")."""
    from dagster._core.storage.runs.sqlite import SqliteRunStorage

    return isinstance(instance.run_storage, SqliteRunStorage)


def fail_orphaned_runs(instance: DagsterInstance) -> list[str]:
    """Mark failed every STARTED run whose run process is gone, and free its concurrency slots;
    returns their run ids. Only for this machine's SQLite instance: a pid means nothing on a shared
    run storage, where the runs may live on other machines."""
    if not sqlite_runs(instance):
        return []
    failed = []
    for record in instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
        run = record.dagster_run
        starts = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_START)
        if not starts or starts[-1].dagster_event is None or starts[-1].dagster_event.pid is None:
            continue  # not started by a process we can see (yet)
        start = starts[-1]
        if still_running(start.dagster_event.pid, start.timestamp):
            continue
        instance.report_run_failed(
            run,
            f"The run process (pid {start.dagster_event.pid}) is gone without finishing the run: "
            "marked failed by video-assets; rerun the batch to complete it.",
        )
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        failed.append(run.run_id)
    return failed


def free_slots_of_finished_runs(instance: DagsterInstance) -> list[str]:
    """Free the concurrency slots still claimed by runs that have ended: a step interrupted while it set up
    (a stop signal to `dagster job execute` mid-start) can leave its slot claimed after its run failed, and
    with no daemon to free it the pool's next step waits forever. Returns the runs whose slots were freed."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    held = {
        slot.run_id
        for pool in storage.get_concurrency_keys()
        for slot in storage.get_concurrency_info(pool).claimed_slots
    }
    freed = []
    for run_id in sorted(held):
        run = instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            storage.free_concurrency_slots_for_run(run_id)
            freed.append(run_id)
    return freed
