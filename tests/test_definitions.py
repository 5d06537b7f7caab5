"""Load the whole code location first: a broken import or resource config fails here."""

from dagster import AssetKey, Definitions

from video_assets.definitions import defs


def test_definitions_load_and_resolve():
    Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {"raw_videos", "video_metadata"} <= keys
    job = defs.resolve_job_def("batch_pipeline")
    assert job.partitions_def is not None and job.partitions_def.name == "video_batches"
    assert defs.resolve_sensor_def("upload_sensor").job_name == "batch_pipeline"
    # A batch's run covers every per-batch asset and nothing that reads all batches.
    in_job = {k.to_user_string() for k in job.asset_layer.executable_asset_keys}
    assert in_job == {"raw_videos", "video_metadata", "captions", "structured_events", "alerts", "review_queue"}
    assert {"golden_set", "eval_scores"} <= keys
    assert {j for j in ("register_model", "evaluate", "promote_challenger", "table_maintenance")
            if defs.resolve_job_def(j)} == {"register_model", "evaluate", "promote_challenger", "table_maintenance"}
    assert {s.name for s in defs.schedules} == {"table_maintenance_schedule", "evaluation_schedule"}


def test_every_table_asset_declares_its_column_schema():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        if key.to_user_string() in ("vlm_model", "caption_prompt"):  # MLflow entries, not tables
            continue
        schema = graph.get(key).metadata["dagster/column_schema"]
        assert {c.name for c in schema.columns} & {"video_id", "eval_id"}, key


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

    from video_assets.partitions import video_batches

    assert defs.resolve_sensor_def("evaluation_automation").default_status == dg.DefaultSensorStatus.STOPPED
    evaluation = dg.AssetSelection.groups("evaluation")
    instance.add_dynamic_partitions(video_batches.name, ["b1"])
    first = dg.evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=evaluation)
    assert first.get_num_requested(AssetKey("eval_scores")) == 0  # nothing new since the first look
    instance.report_runless_asset_event(dg.AssetMaterialization("golden_set"))
    instance.report_runless_asset_event(dg.AssetMaterialization("structured_events", partition="b1"))
    second = dg.evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=evaluation, cursor=first.cursor)
    assert second.get_num_requested(AssetKey("eval_scores")) == 1
    third = dg.evaluate_automation_conditions(defs=defs, instance=instance, asset_selection=evaluation, cursor=second.cursor)
    assert third.get_num_requested(AssetKey("eval_scores")) == 0  # requested once, not on every tick
