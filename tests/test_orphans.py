"""A concurrency slot claimed by a run that has ended (a step stopped while it set up) is freed by the next
command's recover; a slot of a run not yet ended is kept."""

from dagster import asset, job, materialize, op

from video_assets.defs.orphans import free_slots_of_finished_runs

POOL = "accelerator"


@asset
def tiny() -> int:
    return 1


@op
def noop() -> None:
    pass


@job
def queued() -> None:
    noop()


def test_slots_of_ended_runs_are_freed_and_others_kept(instance):
    ended = materialize([tiny], instance=instance).run_id
    waiting = instance.create_run_for_job(queued).run_id  # not started: not ended either
    storage = instance.event_log_storage
    storage.set_concurrency_slots(POOL, 2)
    storage.claim_concurrency_slot(POOL, ended, "captions")
    storage.claim_concurrency_slot(POOL, waiting, "captions")
    assert free_slots_of_finished_runs(instance) == [ended]
    assert {s.run_id for s in storage.get_concurrency_info(POOL).claimed_slots} == {waiting}
    assert free_slots_of_finished_runs(instance) == []
