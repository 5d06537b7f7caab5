"""Preflights: a misconfigured tables root, volume or model folder fails before any work, with a
message naming the setting to fix (real resources, a real Dagster instance)."""

import pytest
from dagster import build_sensor_context, materialize

from resources.delta import DeltaTables, TablesUnavailable
from resources.vlm import VlmSettings
from resources.volume import VideoVolume, VolumeUnavailable
from tests.fixtures.samples import copy_samples
from video_assets.defs.ingest.assets import raw_videos
from video_assets.defs.ingest.sensors import upload_sensor
from video_assets.defs.partitions import video_batches


def cause(err) -> str:
    """Dagster wraps a resource's setup error; the message the operator reads is its cause's."""
    exc, text = err.value, []
    while exc is not None:
        text.append(str(exc))
        exc = exc.__cause__
    return " | ".join(text)


def blocked_root(tmp_path):
    """A tables root that cannot be created or written, even by root: its parent is a file."""
    (tmp_path / "not_a_folder").write_text("x")
    return tmp_path / "not_a_folder" / "tables"


def test_an_unwritable_tables_root_fails_the_tick_before_any_file_is_hashed(instance, volume_dir, tmp_path):
    copy_samples(volume_dir, ["realshort.mp4"])
    hashed = []

    class CountingVolume(VideoVolume):  # a real volume; only records what it hashes
        def content_hash(self, uri):
            hashed.append(uri)
            return super().content_hash(uri)

    resources = {
        "volume": CountingVolume(uri=str(volume_dir)),
        "tables": DeltaTables(root_uri=str(blocked_root(tmp_path))),
    }
    with pytest.raises(Exception) as err:
        upload_sensor(build_sensor_context(instance=instance, resources=resources))
    assert "VIDEO_TABLES_URI" in cause(err) and "not writable" in cause(err)
    assert hashed == []


def test_an_unwritable_tables_root_fails_a_step_naming_the_setting(instance, volume_dir, tmp_path):
    instance.add_dynamic_partitions(video_batches.name, ["b1"])
    result = materialize(
        [raw_videos],
        partition_key="b1",
        instance=instance,
        resources={
            "volume": VideoVolume(uri=str(volume_dir)),
            "tables": DeltaTables(root_uri=str(blocked_root(tmp_path))),
        },
        raise_on_error=False,
    )
    assert not result.success
    errors = [getattr(e.event_specific_data, "error", None) for e in result.all_events if e.is_failure]
    text = " ".join(err.to_string() for err in errors if err is not None)
    assert "VIDEO_TABLES_URI" in text and "not writable" in text


def test_the_check_itself(tmp_path):
    with pytest.raises(TablesUnavailable, match="VIDEO_TABLES_URI"):
        DeltaTables(root_uri=str(blocked_root(tmp_path))).check_writable()
    DeltaTables(root_uri=str(tmp_path / "new" / "tables")).check_writable()  # created on first use
    assert (tmp_path / "new" / "tables").is_dir()


def test_a_missing_volume_is_named_as_such(instance, dagster_home, tmp_path):
    missing = tmp_path / "no_such_volume"
    resources = {"volume": VideoVolume(uri=str(missing)), "tables": DeltaTables(root_uri=str(dagster_home / "tables"))}
    with pytest.raises(Exception) as err:
        upload_sensor(build_sensor_context(instance=instance, resources=resources))
    assert "VIDEO_VOLUME_URI" in cause(err) and "does not exist" in cause(err)
    with pytest.raises(VolumeUnavailable, match="is not a readable folder"):
        (tmp_path / "file.mp4").write_bytes(b"")
        VideoVolume(uri=str(tmp_path / "file.mp4")).check_reachable()


@pytest.mark.parametrize("source", ["/no/such/model", "./no_such_model", "~/no_such_model_here"])
def test_a_missing_local_model_folder_is_not_reported_as_a_hub_id(tmp_path, source):
    vlm = VlmSettings(model_source=source, cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        vlm.materialize_source()
    message = str(err.value)
    assert "does not exist" in message and "VLM_MODEL_SOURCE" in message and "hub" not in message.split(";")[0]


def test_a_hub_id_still_goes_to_the_hub(tmp_path):
    vlm = VlmSettings(model_source="no-such-org/no-such-model", cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="from the hub"):
        vlm.materialize_source()


def test_a_misspelt_use_case_fails_the_captions_step_before_any_captioning(
    instance, resources, session_ray, volume_dir, tmp_path
):
    """An unknown name in VIDEO_USE_CASES used to fail only in structured_events, after the whole
    captions job, with a message that never named the setting: now the captions step fails as it starts
    (the structurer resource's start-up check), naming it, and nothing is captioned."""
    from resources.mlflow_registry import MlflowRegistry
    from resources.structurer import StructurerSettings
    from video_assets.defs.captioning.assets import captions

    instance.add_dynamic_partitions(video_batches.name, ["b1"])
    res = {
        **resources,
        **session_ray,
        "mlflow_registry": MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"),
        "vlm": VlmSettings(cache_dir=str(tmp_path / "models")),
        "structurer": StructurerSettings(use_cases="object_handling,objekt_handling"),
    }
    result = materialize([captions], partition_key="b1", instance=instance, resources=res, raise_on_error=False)
    assert not result.success
    errors = [getattr(e.event_specific_data, "error", None) for e in result.all_events if e.is_failure]
    text = " ".join(err.to_string() for err in errors if err is not None)
    assert "VIDEO_USE_CASES" in text and "unknown use case 'objekt_handling'" in text
    assert "have: loss_prevention, object_handling" in text
    assert not resources["tables"].exists("captions")


def test_video_assets_commands_check_the_settings_before_any_work(
    dagster_home, volume_dir, tmp_path, monkeypatch, capsys
):
    """`video-assets register` / `demo` check the use cases, the volume and the tables root first, and
    stop with every problem named by its setting, before anything is registered."""
    from video_assets.cli import main

    copy_samples(volume_dir, ["realshort.mp4"])
    monkeypatch.setenv("VIDEO_VOLUME_URI", str(tmp_path / "no_such_volume"))
    monkeypatch.setenv("VIDEO_TABLES_URI", str(dagster_home / "tables"))
    monkeypatch.setenv("VIDEO_USE_CASES", "nosuch")
    assert main(["register"]) == 2
    err = capsys.readouterr().err
    assert "VIDEO_USE_CASES" in err and "unknown use case 'nosuch'" in err
    assert "VIDEO_VOLUME_URI" in err and "does not exist" in err
    assert not (dagster_home / "tables" / "batch_manifest").exists()  # nothing registered
    monkeypatch.setenv("VIDEO_VOLUME_URI", str(volume_dir))
    monkeypatch.setenv("VIDEO_USE_CASES", "object_handling")
    assert main(["register"]) == 0 and (dagster_home / "tables" / "batch_manifest").exists()
