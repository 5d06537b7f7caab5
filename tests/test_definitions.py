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


def test_every_table_asset_declares_its_column_schema():
    graph = defs.resolve_asset_graph()
    for key in [AssetKey("raw_videos"), AssetKey("video_metadata")]:
        schema = graph.get(key).metadata["dagster/column_schema"]
        assert "video_id" in {c.name for c in schema.columns}


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
