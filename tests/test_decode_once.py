"""Decode once: the captions job's decode stage encodes each sampled frame as JPEG once; the frames travel
compressed, are kept in sampled_frames, and frame embeddings and curation read those instead of decoding
the video again (real clips, real Ray, real Delta tables, the tiny captioning model)."""

import numpy as np
import polars as pl
import pytest
from dagster import materialize

from resources.archive import ArchiveSettings
from resources.curation import CurationStore
from resources.mlflow_registry import MlflowRegistry
from resources.vlm import VlmSettings
from tests.fixtures.generated_clips import write_clip_with_black_frames, write_gop_clip
from tests.fixtures.samples import BUNDLED, copy_samples
from video_assets.core.media import frames
from video_assets.core.media.sampling import SamplingConfig, SegmentStream, sample_times, sample_video
from video_assets.core.tables import SAMPLED_FRAMES
from video_assets.defs.captioning.assets import captions
from video_assets.defs.curation.assets import frames as curated_frames
from video_assets.defs.embeddings.assets import frame_embeddings
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, frame_encoder, vlm_model
from video_assets.defs.partitions import video_batches

CLIP = BUNDLED / "realshort.mp4"
SAMPLING = SamplingConfig(min_frames=4, max_frames=4)


def test_frames_travel_as_jpegs_a_fraction_of_the_raw_frames():
    raw = sample_video(str(CLIP), SAMPLING).segments[0]
    jpegs = frames.encode(raw.frames)  # what the decode stage sends (decode_and_sample)
    assert frames.is_encoded(jpegs) and not frames.is_encoded(raw.frames) and len(jpegs) == 4
    assert raw.frames.nbytes >= 5 * sum(len(j) for j in jpegs)  # what crosses the object store
    back = frames.decode(jpegs)
    assert back.shape == raw.frames.shape and back.dtype == np.uint8
    # What the model sees: the frames up to JPEG's loss at QUALITY, not other frames.
    assert np.abs(back.astype(int) - raw.frames.astype(int)).mean() < 3
    with pytest.raises(ValueError, match="not a readable image"):
        frames.decode([jpegs[0], b"not a jpeg"])
    with pytest.raises(ValueError, match="no frames"):
        frames.decode([])


def test_a_later_stage_takes_the_stored_frames_and_decodes_only_without_them():
    raw = sample_video(str(CLIP), SAMPLING).segments[0]
    times = [float(t) for t in raw.timestamps]
    jpegs = frames.encode(raw.frames)
    row = {"uri": "/nowhere/gone.mp4", "stored_times": np.array(times), "stored_images": np.array(jpegs, dtype=object)}
    found, pixels, source = frames.caption_frames_at(row, times[::-1])
    assert source == "stored" and found == times and np.array_equal(pixels, frames.decode(jpegs))
    # A time the table lacks (captions older than it): the video is decoded again, the same frames as ever.
    row = {"uri": str(CLIP), "stored_times": times[:2], "stored_images": jpegs[:2]}
    found, pixels, source = frames.caption_frames_at(row, times)
    want = sample_times(str(CLIP), times)
    assert source == "decoded" and found == want[0] and np.array_equal(pixels, want[1])


@pytest.mark.slow
def test_embeddings_and_curation_read_the_captions_frames_not_the_video(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path
):
    copy_samples(volume_dir, ["realshort.mp4", "fire2.mp4"])
    # A black frame (frame 6 of 10 fps) where the 5-frame plan of a 6 s clip has its first target (0.6 s).
    write_clip_with_black_frames(volume_dir / "flash.mp4", black={6}, frames=60)
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=4, batch_size=2),
        "archive": ArchiveSettings(cache_dir=str(tmp_path / "models"), device="cpu"),
        "curation": CurationStore(frames_dir=str(tmp_path / "frames"), exports_dir=str(tmp_path / "exports")),
        **session_ray,
    }
    [key] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt, frame_encoder], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success

    def caption(**config):
        run_config = {"ops": {"captions": {"config": {"min_frames": 3, "max_frames": 5, **config}}}}
        result = materialize([captions], partition_key=key, instance=instance, resources=res, run_config=run_config)
        assert result.success
        meta = result.asset_materializations_for_node("captions")[0].metadata
        # What a segment put through the object store: JPEGs, a fraction of the raw frames (~0.6 MB each).
        assert 0 < meta["frame_mb_per_segment"].value < 0.6
        screened.append(meta["frames_screened"].value)
        return pl.read_delta(tables.table_uri("captions")).filter(pl.col("status") == "ok")

    tables, screened = res["tables"], []
    caps = caption()
    stored = pl.read_delta(tables.table_uri(SAMPLED_FRAMES))
    # The black frame went to the engine as the next useful one, and the table says so; nothing else moved.
    assert screened == [1]
    assert stored.filter(pl.col("screened").is_not_null()).select("uri", "screened", "screened_from_s").rows() == [
        (str(volume_dir / "flash.mp4"), "dark", 0.6)
    ]
    # One row per frame each caption saw, at the caption's times, under the caption's versions.
    want = caps.select("video_id", "segment", "model_version", "prompt_version", "frame_timestamps").explode(
        "frame_timestamps"
    )
    got = stored.sort("video_id", "segment", "frame").select(
        "video_id", "segment", "model_version", "prompt_version", pl.col("timestamp_s").alias("frame_timestamps")
    )
    assert got.to_dicts() == want.sort("video_id", "segment", "frame_timestamps").to_dicts()
    assert all(frames.decode([im]).shape[-1] == 3 for im in stored["image"])

    # The videos are gone: the later stages still have every frame (they never open the video).
    for clip in volume_dir.iterdir():
        clip.unlink()
    result = materialize([frame_embeddings, curated_frames], partition_key=key, instance=instance, resources=res)
    assert result.success
    for node in ("frame_embeddings", "frames"):
        meta = result.asset_materializations_for_node(node)[0].metadata
        assert meta["frame_sources"].value == {"sampled_frames": 3, "decoded_again": 0}, node
    embedded = pl.read_delta(tables.table_uri("frame_embeddings"))
    curated = pl.read_delta(tables.table_uri("frames"))
    assert (embedded["status"] == "ok").all() and embedded.height == stored.height
    assert curated["error"].is_null().all() and curated.height == stored.height

    # Captions made again over another plan: the video's stored frames are those of the new captions only.
    copy_samples(volume_dir, ["realshort.mp4", "fire2.mp4"])
    write_clip_with_black_frames(volume_dir / "flash.mp4", black={6}, frames=60)
    caps = caption(recaption=True, min_frames=2, max_frames=2)
    stored = pl.read_delta(tables.table_uri(SAMPLED_FRAMES))
    assert stored.height == caps["frame_timestamps"].list.len().sum() == 2 * caps.height


def _peak_bytes(iterate) -> int:
    """Peak Python-tracked memory (numpy arrays included) while ``iterate()`` runs."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        iterate()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_a_long_video_streams_segment_by_segment_in_bounded_memory(tmp_path):
    # Clips of 1 minute, 30 minutes and 2 hours (2 fps, a keyframe every 10 s, B-frames), at a resolution
    # whose segments (16 frames) outweigh the plan's bookkeeping, as any real camera's do.
    clips = {
        minutes: write_gop_clip(tmp_path / f"{minutes}min.mp4", "mpeg4", minutes * 120, 20, rate=2, size=(256, 144))
        for minutes in (1, 30, 120)
    }
    cfg = SamplingConfig(segment_s=30.0, max_frames=16)
    list(SegmentStream(clips[30], cfg))  # imports and caches warmed: not counted against the first clip

    def streamed(path):
        segments = []

        def run():
            for seg in SegmentStream(path, cfg):
                segments.append(len(seg.timestamps))
                del seg  # dropped before the next one is decoded, as the job's decode stage does

        return _peak_bytes(run), segments

    peaks = {}
    for minutes, path in clips.items():
        peaks[minutes], counts = streamed(path)
        assert len(counts) == 2 * minutes and all(n == 16 for n in counts), (minutes, counts)
    assert peaks[30] <= 1.5 * peaks[1] and peaks[120] <= 1.5 * peaks[1], peaks
    # All at once (sample_video) holds every segment: the 2-hour clip's frames are many times the minute's.
    whole = _peak_bytes(lambda: sample_video(clips[120], cfg))
    assert whole > 20 * peaks[1], (whole, peaks)
    # And streaming gives exactly the segments sample_video gives.
    by_stream = list(SegmentStream(clips[30], cfg))
    at_once = sample_video(clips[30], cfg).segments
    assert [s.timestamps for s in by_stream] == [s.timestamps for s in at_once]
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(by_stream, at_once))


@pytest.mark.slow
def test_a_long_videos_segments_leave_the_decode_task_a_few_at_a_time(ray_head, dagster_home, tmp_path, monkeypatch):
    # Ray Data passes a task's output on in blocks (128 MiB by default): one block would hold every segment
    # of a long video until its last one was decoded. The captions job's blocks are SEGMENT_BLOCK_BYTES.
    import ray

    from resources.settings import embedded_ray_auth
    from video_assets.core.captioning import job
    from video_assets.core.captioning.batch import EngineSpec, JobSpec
    from video_assets.core.inference.model_cache import ModelFiles

    path = write_gop_clip(tmp_path / "long.mp4", "mpeg4", 2400, 50, rate=10, size=(256, 144))  # 4 minutes
    spec = JobSpec(
        SamplingConfig(segment_s=10.0, min_frames=8, max_frames=8),
        EngineSpec("transformers", ModelFiles(path=str(tmp_path))),
        "unused",
    )
    rows = [{"video_id": "v", "batch_key": "b", "uri": path, "duration_s": None, "rotation": 0}]
    ray_head.admit(dagster_home)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with embedded_ray_auth():
        ray.init(address=ray_head.address)
        try:
            monkeypatch.setattr(job, "SEGMENT_BLOCK_BYTES", 256 << 10)  # these segments are small (~80 KB)
            few = job.decoded_segments(rows, spec).materialize()
            monkeypatch.setattr(job, "SEGMENT_BLOCK_BYTES", 128 << 20)  # Ray's default
            whole = job.decoded_segments(rows, spec).materialize()
        finally:
            ray.shutdown()
    assert few.count() == whole.count() == 24
    assert whole.num_blocks() == 1  # the video's 24 segments left the task together
    assert few.num_blocks() >= 6, few.num_blocks()  # a few segments at a time
    assert ray.data.DataContext.get_current().target_max_block_size == 128 << 20  # the process's own is untouched
