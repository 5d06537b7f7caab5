"""Reprocess only what changed: after production moves, the batches whose rows came from the old model are
listed (from the tables) and run again through exactly the assets downstream of captions they had, in one
run for consecutive batches; nothing else is touched and a second reprocess finds nothing."""

from datetime import UTC, datetime

import polars as pl
import pyarrow as pa
import pytest
from dagster import materialize

from tests.fixtures.samples import copy_samples
from tests.fixtures.tiny_models import build_tiny_vlm
from tests.test_events_and_evaluation import _batch, _resources
from video_assets.core.staleness import stale_batches
from video_assets.core.tables import CAPTIONS, SCHEMAS, STRUCTURED_EVENTS


def _rows(name, rows):
    return pl.from_arrow(pa.Table.from_pylist(rows, schema=SCHEMAS[name]))


def test_stale_batches_are_read_from_the_rows_versions():
    now = datetime.now(UTC)
    cap = {"uri": "u", "segment": 0, "model_name": "m", "engine": "e", "status": "ok", "captioned_at": now}
    captions = _rows(
        CAPTIONS,
        [
            cap | {"video_id": "a", "batch_key": "b1", "model_version": "1", "prompt_version": 1},  # old model
            cap | {"video_id": "b", "batch_key": "b2", "model_version": "2", "prompt_version": 1},  # current
            cap | {"video_id": "c", "batch_key": "b3", "model_version": "1", "prompt_version": 1},
            cap | {"video_id": "c", "batch_key": "b3", "model_version": "2", "prompt_version": 1},  # redone
            cap | {"video_id": "d", "batch_key": "b4", "model_version": "2", "prompt_version": 1},
        ],
    )
    ev = {"segment": 0, "uri": "u", "status": "parsed", "n_events": 0, "attempts": 1, "structured_at": now}
    ev |= {"model_version": "2", "prompt_version": 1, "use_case": "oh", "structurer": "s"}
    structured = _rows(
        STRUCTURED_EVENTS,
        [
            ev | {"video_id": "b", "batch_key": "b2", "use_case_version": "new"},
            ev | {"video_id": "d", "batch_key": "b4", "use_case_version": "old"},  # the use case changed since
        ],
    )
    stale = stale_batches(captions, structured, "2", 1, [("oh", "new", "s")])
    assert {b: s["root"] for b, s in stale.items()} == {"b1": "captions", "b4": "structured_events"}
    assert "model v1 prompt v1" in stale["b1"]["reason"] and stale["b4"]["videos"] == 1
    assert stale_batches(captions, structured, "1", 1, [("oh", "new", "s")]).keys() == {"b2", "b4"}
    assert stale_batches(captions.head(0), structured, "2", 1, []) == {}


@pytest.mark.slow
def test_after_production_moves_only_the_old_batches_assets_run_again(
    instance, resources, session_ray, volume_dir, tmp_path
):
    from video_assets.cli import execute_reprocess
    from video_assets.definitions import defs
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.maintenance.reprocess import reprocess_plan, runs
    from video_assets.defs.models.assets import caption_prompt, vlm_model
    from video_assets.defs.partitions import video_batches
    from video_assets.defs.routing.assets import routed_events
    from video_assets.defs.structuring.assets import structured_events

    cache = tmp_path / "cache"
    first = build_tiny_vlm(tmp_path / "models" / "first", prefer="none")
    res = _resources({**resources, **session_ray}, tmp_path, model_source=str(first), cache=cache)
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    run_config = {"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2}}}}
    keys = []
    for clip in ["asl_eat.mkv", "realshort.mp4", "tree.avi"]:  # three upload batches, one clip each
        copy_samples(volume_dir, [clip])
        keys.append(_batch(res, instance))
        assert materialize(
            [raw_videos, video_metadata], partition_key=keys[-1], instance=instance, resources=res
        ).success
        per_batch = [captions, structured_events, routed_events]
        assert materialize(
            per_batch, partition_key=keys[-1], instance=instance, resources=res, run_config=run_config
        ).success
    graph, tables, registry = defs.resolve_asset_graph(), res["tables"], res["mlflow_registry"]
    assert reprocess_plan(instance, graph, tables, registry, res["vlm"], res["structurer"]) == []

    # A second model, registered (challenger) and then behind production, as a promotion leaves it.
    second = build_tiny_vlm(tmp_path / "models" / "second", prefer="confirmed")
    res2 = _resources({**resources, **session_ray}, tmp_path, model_source=str(second), cache=cache)
    assert materialize([vlm_model], instance=instance, resources=res2).success
    from dagster import AssetKey
    from dagster._core.definitions.data_version import StaleStatus
    from dagster._utils.test.data_versions import get_stale_status_resolver

    from video_assets.defs.promotion.assets import report_production

    def stale() -> list[StaleStatus]:
        graph = [raw_videos, video_metadata, vlm_model, caption_prompt, captions, structured_events]
        resolver = get_stale_status_resolver(instance, graph)
        return [resolver.get_status(AssetKey("captions"), k) for k in keys]

    assert stale() == [StaleStatus.FRESH] * 3  # a challenger registered changes nothing downstream
    registry.set_alias("model", res2["vlm"].registered_model, "production", "2")  # what a promotion does...
    report_production(instance, "production", "test-decision", model_version="2")  # ...and reports
    assert stale() == [StaleStatus.STALE] * 3  # Dagster's own staleness view agrees with the plan below

    plan = reprocess_plan(instance, graph, tables, registry, res2["vlm"], res2["structurer"])
    assert [p["batch"] for p in plan] == keys and {p["root"] for p in plan} == {"captions"}
    expected = ["alerts", "captions", "review_queue", "structured_events"]
    assert all(p["assets"] == expected for p in plan)  # what the batches had downstream of captions
    todo = runs(instance.get_dynamic_partitions(video_batches.name), plan)
    assert todo == [{"first": keys[0], "last": keys[-1], "assets": expected}]  # one run for the range
    [result] = execute_reprocess(instance, todo, [captions, structured_events, routed_events], res2)
    assert result.success
    touched = {
        (m.asset_key.to_user_string(), m.partition)
        for m in (e.event_specific_data.materialization for e in result.get_asset_materialization_events())
    }
    assert touched == {(a, k) for a in expected for k in keys}  # raw_videos, video_metadata, transcripts: none
    caps = pl.read_delta(tables.table_uri("captions"))
    # Every video now has the production model's captions (the old model's stay beside them, keyed apart).
    assert caps.filter(pl.col("model_version") == "2")["video_id"].n_unique() == caps["video_id"].n_unique() == 3
    # Nothing is stale any more.
    assert reprocess_plan(instance, graph, tables, registry, res2["vlm"], res2["structurer"]) == []
