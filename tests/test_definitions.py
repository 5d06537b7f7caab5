"""Load the whole code location first: a broken import or resource config fails here."""

from dagster import AssetKey, Definitions

from video_assets.core.tables import KEYS, SCHEMAS
from video_assets.definitions import defs
from video_assets.defs.partitions import video_batches


def test_definitions_load_and_resolve():
    Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    keys = set(graph.get_all_asset_keys())
    # Every job's selection resolves to something it can run; asset jobs select assets that exist.
    for job in defs.jobs:
        resolved = defs.resolve_job_def(job.name)
        assert resolved.graph.node_defs, job.name
        assert resolved.asset_layer.executable_asset_keys <= keys, job.name
    # Every schedule and sensor with a target runs a job that resolves.
    targets = [(s.name, s.job_name) for s in defs.schedules]
    targets += [(s.name, t.job_name) for s in defs.sensors for t in s.targets]  # automation sensors: none
    for name, job_name in targets:
        assert defs.resolve_job_def(job_name), name


def test_batch_pipeline_runs_exactly_the_per_batch_assets():
    graph = defs.resolve_asset_graph()
    job = defs.resolve_job_def("batch_pipeline")
    assert job.partitions_def == video_batches
    assert defs.resolve_sensor_def("upload_sensor").job_name == job.name
    # A batch's run covers every asset partitioned by batch, and nothing that reads all batches.
    per_batch = {
        k
        for k in graph.get_all_asset_keys()
        if graph.get(k).partitions_def == video_batches and graph.get(k).is_executable
    }
    assert per_batch, "no asset is partitioned by video_batches"
    assert set(job.asset_layer.executable_asset_keys) == per_batch
    # Its runs have a maximum runtime the daemon's run monitoring enforces, with the blocking captions check.
    assert job.tags["dagster/max_runtime"] == "21600"
    checks = {k.name for k in job.asset_layer.asset_graph.asset_check_keys}
    assert "captions_mostly_captioned" in checks


def test_tables_written_outside_runs_are_assets_of_the_graph_with_their_readers():
    """Issue 41, item 1: the four tables written by something other than their own step are asset specs (not
    run by any job) with the edges of who reads them; each writer reports its writes as materialisations."""
    graph = defs.resolve_asset_graph()

    def parents(name: str) -> set[str]:
        return {k.to_user_string() for k in graph.get(AssetKey(name)).parent_keys}

    written_outside = {"review_labels", "stream_segments", "alert_deliveries", "sampled_frames"}
    for name in written_outside:
        assert not graph.get(AssetKey(name)).is_executable, name  # no job materialises it: its writer reports
    assert "review_labels" in parents("golden_set")
    assert {"stream_segments", "structured_events"} <= parents("alerts") & parents("review_queue")
    assert parents("alert_deliveries") == {"alerts"}
    assert parents("sampled_frames") == {"captions"}
    assert "sampled_frames" in parents("frames") & parents("frame_embeddings")
    assert graph.get(AssetKey("sampled_frames")).partitions_def == video_batches


def test_the_batch_max_runtime_is_a_setting(monkeypatch):
    import pytest

    from resources.settings import batch_max_runtime_s

    monkeypatch.setenv("VIDEO_BATCH_MAX_RUNTIME_S", "600")
    assert batch_max_runtime_s() == 600
    for bad in ("6h", "-1"):
        monkeypatch.setenv("VIDEO_BATCH_MAX_RUNTIME_S", bad)
        with pytest.raises(ValueError, match="VIDEO_BATCH_MAX_RUNTIME_S"):
            batch_max_runtime_s()


def test_every_table_asset_declares_its_column_schema():
    graph = defs.resolve_asset_graph()
    tables = [k for k in graph.get_all_asset_keys() if "delta" in graph.get(k).kinds]
    assert tables
    for key in tables:
        name = key.to_user_string()
        assert name in SCHEMAS, f"{name} is a delta asset without a declared schema"
        declared = [(c.name, c.type) for c in graph.get(key).metadata["dagster/column_schema"].columns]
        assert declared == [(f.name, str(f.type)) for f in SCHEMAS[name]], name
        assert set(KEYS[name]) <= {n for n, _ in declared}, f"{name}: key columns missing from the schema"


def test_resources_default_to_the_embedded_setup(monkeypatch, tmp_path):
    from video_assets.definitions import build_resources

    monkeypatch.delenv("VIDEO_VOLUME_URI", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    res = build_resources()
    assert res["volume"].uri.endswith("samples")
    assert res["tables"].root_uri == str(tmp_path / "tables")
    monkeypatch.setenv("VIDEO_TABLES_URI", "s3://bucket/tables")
    resolved = build_resources()["tables"].process_config_and_initialize()
    assert resolved.root_uri == "s3://bucket/tables"


def test_evaluation_automation_rescores_after_new_events(instance):
    import dagster as dg

    assert defs.resolve_sensor_def("evaluation_automation").default_status == dg.DefaultSensorStatus.STOPPED
    evaluation = dg.AssetSelection.groups("evaluation")
    instance.add_dynamic_partitions(video_batches.name, ["b1"])
    first = dg.evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=evaluation)
    assert first.get_num_requested(AssetKey("eval_scores")) == 0  # nothing new since the first look
    instance.report_runless_asset_event(dg.AssetMaterialization("golden_set"))
    instance.report_runless_asset_event(dg.AssetMaterialization("structured_events", partition="b1"))
    second = dg.evaluate_automation_conditions(
        defs=defs, instance=instance, asset_selection=evaluation, cursor=first.cursor
    )
    assert second.get_num_requested(AssetKey("eval_scores")) == 1
    third = dg.evaluate_automation_conditions(
        defs=defs, instance=instance, asset_selection=evaluation, cursor=second.cursor
    )
    assert third.get_num_requested(AssetKey("eval_scores")) == 0  # requested once, not on every tick


def test_engine_steps_share_one_pool_limited_by_the_instance(instance):
    from video_assets.defs.common import ACCELERATOR_POOL

    graph = defs.resolve_asset_graph()
    pooled = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).pools == {ACCELERATOR_POOL}}
    assert pooled == {
        "captions",
        "structured_events",
        # promotion: a challenger captions, structures and is scored in one step
        "candidate_captions",
        "candidate_events",
        "candidate_scores",
        "promotion_decisions",
        "promotion_diffs",
        "transcripts",
        "frame_embeddings",
        "text_embeddings",
        "frames",  # the VLM describes kept frames when describe is on
    }
    # The checked-in instance config (the fixture's) caps the pool at one step at a time.
    assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
