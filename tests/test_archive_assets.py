"""transcripts, frame_embeddings and text_embeddings for a batch, as the pipeline runs them: real local Ray,
a real MLflow store holding the real bundled models, real Delta tables, real clips (one with generated
speech). A second materialisation writes nothing; a new encoder version re-embeds exactly its rows."""

import shutil

import numpy as np
import polars as pl
import pytest
from dagster import materialize

from resources.archive import FRAMES, TEXT, ArchiveSettings, assemble_packaged
from resources.llm import LlmSettings
from resources.mlflow_registry import MlflowRegistry
from resources.search import SearchIndex
from resources.vlm import VlmSettings
from tests.fixtures.samples import copy_samples
from tests.fixtures.speech import speech_clip
from tests.fixtures.tiny_clip import build_tiny_clip
from video_assets.core.embeddings.job import load_frame_encoder
from video_assets.core.embeddings.text import TextEncoder
from video_assets.core.media.sampling import SamplingConfig, sample_video
from video_assets.core.search.index import LanceSearcher
from video_assets.defs.captioning.assets import captions
from video_assets.defs.embeddings import embedding_checks
from video_assets.defs.embeddings.assets import frame_embeddings, text_embeddings
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import ARCHIVE_MODELS, caption_prompt, frame_encoder, text_encoder, vlm_model
from video_assets.defs.partitions import video_batches
from video_assets.defs.search.assets import search_index
from video_assets.defs.summaries.assets import video_summaries
from video_assets.defs.transcripts.assets import transcripts

CLIPS = ["realshort.mp4", "asl_eat.mkv", "fire2.mp4"]  # audio, no audio stream, audio
RUN_CONFIG = {"ops": {"captions": {"config": {"max_frames": 6, "min_frames": 3}}}}
ARCHIVE_TABLES = ("transcripts", "frame_embeddings", "text_embeddings", "video_summaries")


@pytest.mark.slow
def test_archive_assets_for_a_batch(instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path):
    copy_samples(volume_dir, CLIPS)
    speech_clip(volume_dir / "spoken.mp4")
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=12, batch_size=2),
        "archive": ArchiveSettings(cache_dir=str(tmp_path / "models"), device="cpu"),
        "search_index_store": SearchIndex(uri=str(tmp_path / "search_index")),
        "llm": LlmSettings(),  # none: extractive summaries
        **session_ray,  # the session's Ray, joined
    }
    plan = register_new_files(res["volume"], res["tables"])
    [key] = plan.batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt, *ARCHIVE_MODELS], instance=instance, resources=res).success
    ingest = materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res)
    assert ingest.success
    assert materialize([captions], partition_key=key, instance=instance, resources=res, run_config=RUN_CONFIG).success
    archive = [transcripts, frame_embeddings, text_embeddings]

    def run(extra=()):
        result = materialize(
            [*archive, *extra, *embedding_checks],
            partition_key=key,
            instance=instance,
            resources=res,
            raise_on_error=False,
        )
        assert result.success
        failed = [e.check_name for e in result.get_asset_check_evaluations() if not e.passed]
        assert not failed
        return {
            a.key.path[-1]: result.asset_materializations_for_node(a.key.path[-1])[0].metadata
            for a in (*archive, *extra)
        }

    tables = res["tables"]
    first = run(extra=(video_summaries, search_index))
    said = pl.read_delta(tables.table_uri("transcripts")).with_columns(name=pl.col("uri").str.split("/").list.last())
    assert set(said["name"]) == {*CLIPS, "spoken.mp4"}  # every video has rows
    assert said.filter(pl.col("name") == "asl_eat.mkv")["status"].to_list() == ["no_audio"]
    spoken = said.filter(pl.col("name") == "spoken.mp4")
    assert set(spoken["status"]) == {"speech"}
    text = " ".join(spoken.sort("segment")["text"]).lower()
    assert sum(w in text for w in ("bottle", "kitchen", "table", "fridge", "milk")) >= 3, text
    for name in ("realshort.mp4", "fire2.mp4"):  # a second of room noise, a dog: no invented speech
        assert said.filter(pl.col("name") == name)["status"].to_list() == ["no_speech"], name

    caps = pl.read_delta(tables.table_uri("captions")).filter(pl.col("status") == "ok")
    frames = pl.read_delta(tables.table_uri("frame_embeddings"))
    assert (frames["status"] == "ok").all() and set(frames["dim"]) == {1280}
    for vid, ts in (
        caps.explode("frame_timestamps").group_by("video_id").agg(pl.col("frame_timestamps").sort()).iter_rows()
    ):
        got = frames.filter(pl.col("video_id") == vid).sort("timestamp_s")["timestamp_s"].to_list()
        assert got == ts, vid  # the frames the captions saw, no others
    vectors = np.asarray(frames["embedding"].to_list(), dtype=np.float32)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    assert first["frame_embeddings"]["frame_map"].value.startswith("![")

    texts = pl.read_delta(tables.table_uri("text_embeddings"))
    by_source = dict(texts.group_by("source").len().iter_rows())
    assert by_source == {"caption": caps.height, "transcript": spoken.height}
    spoken_rows = texts.filter(pl.col("source") == "transcript").sort("segment")
    assert spoken_rows["start_s"].to_list() == spoken.sort("segment")["start_s"].to_list()
    assert set(texts["dim"]) == {384}

    # The pipeline's own output is searchable: the spoken words find the spoken clip's segment, and the
    # summary of a clip carries its times.
    summaries = pl.read_delta(tables.table_uri("video_summaries"))
    assert summaries.height == len(CLIPS) + 1 and summaries["summary"].str.contains(r"\[\d\d:\d\d").all()
    searcher = LanceSearcher(
        res["search_index_store"].uri,
        TextEncoder(assemble_packaged(TEXT, tmp_path / "minilm")),
        text_version=first["text_embeddings"]["encoder_version"].value,
    )
    [top, *_] = searcher.search_text("where is the milk kept", k=3)
    assert top.uri.endswith("spoken.mp4") and top.source == "transcript" and "fridge" in top.text.lower()
    assert top.start_s >= 1.0  # after the clip's silent lead
    assert first["search_index"]["dagster/uri"]
    # Frames like a frame: its own clip's frames first, by the stored vectors and by an uploaded image.
    frame_searcher = LanceSearcher(
        res["search_index_store"].uri,
        searcher.text_encoder,
        frame_encoder=load_frame_encoder(assemble_packaged(FRAMES, tmp_path / "effnet")),
        text_version=first["text_embeddings"]["encoder_version"].value,
        frame_version=first["frame_embeddings"]["encoder_version"].value,
    )
    fire = frames.filter(pl.col("uri").str.ends_with("fire2.mp4")).sort("timestamp_s")
    near = frame_searcher.similar_frames(fire["video_id"][0], fire["timestamp_s"][1], k=fire.height - 1)
    assert fire.height >= 3 and [h.uri.rsplit("/", 1)[-1] for h in near] == ["fire2.mp4"] * (fire.height - 1)
    upload = (
        sample_video(str(volume_dir / "realshort.mp4"), SamplingConfig(min_frames=3, max_frames=3))
        .segments[0]
        .frames[1]
    )
    [like, *_] = frame_searcher.similar_to_image(upload, k=3)
    assert like.uri.endswith("realshort.mp4")

    # Materialised again: nothing to do, no commit on any table.
    versions = {t: tables.version(t) for t in ARCHIVE_TABLES}
    again = run(extra=(video_summaries, search_index))
    assert {t: tables.version(t) for t in ARCHIVE_TABLES} == versions
    assert again["transcripts"]["videos_cached"].value == len(CLIPS) + 1
    assert again["frame_embeddings"]["videos_embedded"].value == 0
    assert again["text_embeddings"]["texts_embedded"].value == 0

    # New encoder versions: text_embeddings embeds every text again under the new text encoder (other
    # content, same architecture), frame_embeddings every frame under a CLIP-style encoder (the tiny
    # random CLIP: text queries could hit frames). transcripts, whose model did not change, writes nothing.
    changed = tmp_path / "minilm-changed"
    shutil.copytree(assemble_packaged(TEXT, tmp_path / "minilm"), changed)
    (changed / "NOTES.txt").write_text("a fine-tuned variant would differ in its weights; this only in a file\n")
    clip = build_tiny_clip(tmp_path / "tiny-clip")
    res["archive"] = ArchiveSettings(
        cache_dir=str(tmp_path / "models"),
        device="cpu",
        text_encoder_source=str(changed),
        frame_encoder_source=str(clip),
    )
    assert materialize([text_encoder, frame_encoder], instance=instance, resources=res).success
    third = run()
    assert third["text_embeddings"]["encoder_version"].value == "2"
    assert third["text_embeddings"]["texts_embedded"].value == texts.height
    assert third["frame_embeddings"]["encoder_version"].value == "2"
    assert third["frame_embeddings"]["videos_embedded"].value == len(CLIPS) + 1
    assert third["transcripts"]["videos_transcribed"].value == 0
    assert tables.version("transcripts") == versions["transcripts"]
    after = pl.read_delta(tables.table_uri("text_embeddings"))
    assert dict(after.group_by("encoder_version").len().iter_rows()) == {"1": texts.height, "2": texts.height}
    frames_after = pl.read_delta(tables.table_uri("frame_embeddings"))
    dims = dict(frames_after.group_by("encoder_version").agg(pl.col("dim").unique().first()).iter_rows())
    assert dims["1"] == 1280 and dims["2"] < 1280
    assert frames_after.filter(pl.col("encoder_version") == "2").height == frames.height


def test_packaged_archive_models_share_a_gpu_and_a_users_model_gets_one(tmp_path):
    """On a cluster with GPUs the small packaged models reserve a quarter of one each (four actors per
    GPU), a model from a user's source a whole one; no GPUs, or device=cpu, reserve none; num_gpus wins."""
    from resources.archive import PACKAGED_GPU_SHARE, SPEECH

    packaged = ArchiveSettings(cache_dir=str(tmp_path))
    assert packaged.actor_placement(8, SPEECH) == ("cuda", PACKAGED_GPU_SHARE) == ("cuda", 0.25)
    assert packaged.stage_spec(8, 4, TEXT)[0].model_num_gpus == 0.25
    assert packaged.actor_placement(0, FRAMES) == ("cpu", 0.0)
    assert ArchiveSettings(cache_dir=str(tmp_path), device="cpu").actor_placement(8, FRAMES) == ("cpu", 0.0)
    large = ArchiveSettings(cache_dir=str(tmp_path), speech_model_source="Systran/faster-whisper-large-v3")
    assert large.actor_placement(8, SPEECH) == ("cuda", 1.0) and large.actor_placement(8, TEXT)[1] == 0.25
    assert ArchiveSettings(cache_dir=str(tmp_path), num_gpus=0.5).actor_placement(8, SPEECH) == ("cuda", 0.5)
