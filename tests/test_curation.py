"""Frame curation: each filter on generated frames with known answers, the real samples' known defects
(no_duration.webm is almost black, chaplin.mp4 is pillarboxed), the frames asset for a small batch
(read back, idempotent) and the training export round trip."""

import io
import json

import numpy as np
import polars as pl
import pytest
from PIL import Image, ImageFilter

from tests.fixtures.samples import BUNDLED
from video_assets.core.curation.quality import (
    CurationConfig,
    border_box,
    curate,
    frame_scores,
    hamming,
    luma,
    phash,
)
from video_assets.core.media.sampling import SamplingConfig, sample_video

H, W = 240, 320


def scene(seed: int = 0, h: int = H, w: int = W) -> np.ndarray:
    """A textured picture: coloured blocks of random sizes (edges for sharpness, layout for pHash)."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 128, np.uint8)
    for _ in range(30):
        y, x = rng.integers(0, h - 8), rng.integers(0, w - 8)
        img[y : y + rng.integers(8, h // 2), x : x + rng.integers(8, w // 2)] = rng.integers(0, 256, 3)
    return img


def blurred(img: np.ndarray, radius: float = 6) -> np.ndarray:
    return np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(radius)))


def reasons(frames, config=CurationConfig()):
    return [v.reason for v in curate(np.stack(frames), [0.5 * i for i in range(len(frames))], config)]


def test_sharp_frame_is_kept_and_its_blurred_copy_dropped():
    sharp, soft = scene(1), blurred(scene(1))
    cfg = CurationConfig()
    assert frame_scores(sharp).sharpness > 10 * cfg.min_sharpness
    assert frame_scores(soft).sharpness < cfg.min_sharpness
    assert reasons([soft]) == ["blurry"]
    assert reasons([sharp]) == ["kept"]


def test_black_washed_out_and_flat_frames_are_dropped():
    black = np.zeros((H, W, 3), np.uint8)
    white = np.full((H, W, 3), 250, np.uint8)
    grey = np.full((H, W, 3), 128, np.uint8)
    cfg = CurationConfig(min_motion=0, duplicate_max_distance=-1)
    assert reasons([black, white, grey], cfg) == ["dark", "washed_out", "flat"]
    assert frame_scores(black).crop == (0, 0, W, H)  # dark all over: no crop


def test_letterbox_and_pillarbox_are_found_and_cropped():
    letter = np.zeros((H, W, 3), np.uint8)
    letter[30 : H - 30] = scene(2, H - 60, W)
    pillar = np.zeros((H, W, 3), np.uint8)
    pillar[:, 40 : W - 40] = scene(3, H, W - 80)
    assert border_box(luma(letter)) == (0, 30, W, H - 30)
    assert border_box(luma(pillar)) == (40, 0, W - 40, H)
    [v] = curate(pillar[None], [0.0])
    assert v.crop == (40, 0, W - 40, H) and v.kept
    # A dark scene with one bright patch is not a border: never cropped below half a side.
    spot = np.zeros((H, W, 3), np.uint8)
    spot[100:110, 150:160] = 200
    assert border_box(luma(spot)) == (0, 0, W, H)


def test_phash_near_duplicates_and_different_frames():
    a = scene(4)
    rng = np.random.default_rng(0)
    noisy = np.clip(a.astype(int) + rng.integers(-6, 7, a.shape) + 10, 0, 255).astype(np.uint8)
    other = scene(5)
    ha = phash(luma(a))
    assert hamming(ha, phash(luma(a.copy()))) == 0
    assert hamming(ha, phash(luma(noisy))) <= CurationConfig().duplicate_max_distance
    assert hamming(ha, phash(luma(other))) > 12
    assert hamming(f"{ha:016x}", f"{ha ^ 0b101:016x}") == 2
    cfg = CurationConfig(min_motion=0)  # static off: the near copy must be caught as a duplicate
    assert reasons([a, noisy, other], cfg) == ["kept", "duplicate", "kept"]


def test_motion_separates_a_moving_sequence_from_a_static_one():
    base = scene(6)
    moving = [np.roll(base, 24 * i, axis=1) for i in range(4)]
    static = [base] * 4
    vm = curate(np.stack(moving), [0, 1, 2, 3], CurationConfig(duplicate_max_distance=-1))
    vs = curate(np.stack(static), [0, 1, 2, 3], CurationConfig(duplicate_max_distance=-1))
    assert vm[0].motion is None and all(v.motion > 5 for v in vm[1:])
    assert [v.reason for v in vm] == ["kept"] * 4
    assert [v.motion for v in vs[1:]] == [0.0] * 3
    assert [v.reason for v in vs] == ["kept", "static", "static", "static"]


def test_verdicts_follow_time_order_and_config_is_checked():
    a, b = scene(7), scene(8)
    out = curate(np.stack([b, a]), [1.0, 0.0])  # given out of order: a (t=0) is first
    assert [v.timestamp_s for v in out] == [1.0, 0.0] and out[1].motion is None
    with pytest.raises(ValueError):
        CurationConfig.from_dict({"min_sharpnes": 3})
    with pytest.raises(ValueError):
        CurationConfig(dark_max_brightness=200, washed_out_min_brightness=100)
    assert CurationConfig().version() == CurationConfig().version()
    assert CurationConfig(min_sharpness=1).version() != CurationConfig().version()


def test_use_case_curation_table(tmp_path):
    from video_assets.core.structuring.usecase import load

    src = BUNDLED.parent / "video_assets" / "usecases" / "object_handling"
    folder = tmp_path / "hands"
    folder.mkdir()
    (folder / "prompt.txt").write_text((src / "prompt.txt").read_text())
    toml = (src / "usecase.toml").read_text()
    (folder / "usecase.toml").write_text(toml + '\n[curation]\nmin_sharpness = 30.0\ndescribe_prompt = "Hands?"\n')
    assert load("hands", tmp_path).curation == {"min_sharpness": 30.0, "describe_prompt": "Hands?"}
    (folder / "usecase.toml").write_text(toml + "\n[curation]\nmin_sharpnes = 30.0\n")
    load.cache_clear()
    with pytest.raises(ValueError, match="min_sharpnes"):
        load("hands", tmp_path)
    load.cache_clear()


def _sampled(name: str, frames: int = 4):
    sv = sample_video(str(BUNDLED / name), SamplingConfig(min_frames=frames, max_frames=frames, motion_densify=False))
    return [t for s in sv.segments for t in s.timestamps], np.concatenate([s.frames for s in sv.segments])


def test_no_duration_webm_is_dropped_as_dark():
    times, frames = _sampled("no_duration.webm")
    verdicts = curate(frames, times)
    assert [v.reason for v in verdicts] == ["dark"] * len(times)
    assert max(v.brightness for v in verdicts) < 10  # measured 2.8-3.5 (README, Frame curation)


def test_chaplin_pillarbox_is_detected_and_cropped():
    times, frames = _sampled("chaplin.mp4")
    verdicts = curate(frames, times)
    h, w = frames.shape[1:3]
    for v in verdicts:
        x0, y0, x1, y1 = v.crop
        assert (y0, y1) == (0, h) and x0 > 0.05 * w and x1 < 0.95 * w, v.crop  # bars left and right
    assert sum(v.kept for v in verdicts) >= 2


# ------------------------------------------------------------------------------ the asset and the export

CLIPS = ["chaplin.mp4", "no_duration.webm", "realshort.mp4"]
RUN_CONFIG = {"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 3}}}}


@pytest.mark.slow
def test_frames_asset_for_a_batch_and_the_training_export(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path
):
    from dagster import materialize

    from resources.curation import CurationStore
    from resources.mlflow_registry import MlflowRegistry
    from resources.vlm import VlmSettings
    from tests.fixtures.samples import copy_samples
    from video_assets.core.curation.export import export_frames, read_export
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.curation import curation_checks
    from video_assets.defs.curation.assets import frames, training_export
    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.ingest.registration import register_new_files
    from video_assets.defs.models.assets import caption_prompt, vlm_model
    from video_assets.defs.partitions import video_batches

    copy_samples(volume_dir, CLIPS)
    store = CurationStore(frames_dir=str(tmp_path / "frames"), exports_dir=str(tmp_path / "exports"))
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=8, batch_size=4),
        "curation": store,
        **session_ray,  # the session's Ray, joined
    }
    plan = register_new_files(res["volume"], res["tables"])
    [key] = plan.batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success
    assert materialize([captions], partition_key=key, instance=instance, resources=res, run_config=RUN_CONFIG).success
    tables = res["tables"]

    def run(**config):
        result = materialize(
            [frames, *curation_checks],
            partition_key=key,
            instance=instance,
            resources=res,
            run_config={"ops": {"frames": {"config": config}}},
            raise_on_error=False,
        )
        assert result.success
        assert not [e.check_name for e in result.get_asset_check_evaluations() if not e.passed]
        return result.asset_materializations_for_node("frames")[0].metadata

    first = run(describe=True)
    table = pl.read_delta(tables.table_uri("frames")).with_columns(name=pl.col("uri").str.split("/").list.last())
    caps = pl.read_delta(tables.table_uri("captions")).filter(pl.col("status") == "ok")
    assert table.height == caps["frame_timestamps"].list.len().sum()  # one row per caption frame
    meta = pl.read_delta(tables.table_uri("video_metadata"))
    durations = dict(zip(meta["uri"].str.split("/").list.last(), meta["duration_s"]))
    for name, ts in table.group_by("name").agg("timestamp_s").iter_rows():
        assert all(0 <= t <= durations[name] + 0.1 for t in ts), name
    dark = table.filter(pl.col("name") == "no_duration.webm")
    assert dark.height and set(dark["reason"]) == {"dark"} and not dark["kept"].any()
    chaplin = table.filter(pl.col("name") == "chaplin.mp4")
    assert (chaplin["crop_x1"] - chaplin["crop_x0"] < chaplin["width"]).all()  # the pillarbox cropped
    kept = table.filter(pl.col("kept"))
    assert kept.height >= 2 and kept["image"].null_count() == 0
    for row in kept.iter_rows(named=True):
        im = Image.open(io.BytesIO(row["image"]))
        assert im.size == (row["crop_x1"] - row["crop_x0"], row["crop_y1"] - row["crop_y0"])
        assert row["description"]  # nonsense from the tiny model, but produced and stored
    assert table.filter(~pl.col("kept"))["image"].null_count() == table.filter(~pl.col("kept")).height
    assert first["rows_by_reason"].value["dark"] == dark.height
    assert first["contact_sheet"].value.startswith("![")

    # Materialised again: nothing to curate, no commit.
    version = tables.version("frames")
    again = run(describe=True)
    assert tables.version("frames") == version and again["videos_curated"].value == 0

    # The export from that table version: shards and manifest, matching the table.
    result = materialize(
        [training_export],
        instance=instance,
        resources={"tables": tables, "curation": store},
        run_config={"ops": {"training_export": {"config": {"shard_rows": 2}}}},
    )
    assert result.success
    [export] = result.asset_materializations_for_node("training_export")
    assert export.metadata["table_version"].value == version and export.metadata["rows"].value == kept.height

    out = tmp_path / "exports" / f"frames-v{version}"
    manifest, shards = read_export(out)
    assert manifest["table_version"] == version and manifest["rows"] == kept.height
    assert len(manifest["shards"]) == -(-kept.height // 2)
    back = pl.from_arrow(shards).sort("video_id", "segment", "frame")
    want = kept.sort("video_id", "segment", "frame")
    for col in ("video_id", "segment", "frame", "timestamp_s", "image", "description"):
        assert back[col].to_list() == want[col].to_list(), col

    # Files instead of blobs: a new curation_version beside the first, images readable from image_uri.
    files = run(image_store="files")
    assert files["curation_version"].value != first["curation_version"].value
    as_files = pl.read_delta(tables.table_uri("frames")).filter(
        pl.col("curation_version") == files["curation_version"].value
    )
    with_files = as_files.filter(pl.col("kept"))
    assert with_files.height and with_files["image"].null_count() == with_files.height
    for uri in with_files["image_uri"]:
        Image.open(uri).verify()
    # Reproducible: exporting the first version again, after the table moved on, gives the same shards.
    assert tables.version("frames") > version
    again_manifest = export_frames(tables.table_uri("frames"), tmp_path / "again", version=version, shard_rows=2)
    assert [s["sha256"] for s in again_manifest["shards"]] == [s["sha256"] for s in manifest["shards"]]
    assert json.loads((out / "manifest.json").read_text())["rows"] == kept.height
