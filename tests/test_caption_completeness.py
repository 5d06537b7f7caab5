"""Captions are complete or redone: a crash between merges, a lost Ray worker, a failed segment or a new
split never leaves a video counted as captioned with segments missing. Real local Ray, real Delta
tables, real MLflow store, the tiny real model."""

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from dagster import materialize

import video_assets.defs.caption_job as runner
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.settings import embedded_ray_auth
from resources.vlm import VlmSettings
from tests.fixtures.batches import materialize_slice
from tests.fixtures.samples import copy_samples
from video_assets.core.captioning.versions import captioned_ok, split_key, video_completeness
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.tables import CAPTIONS, SCHEMAS, to_arrow
from video_assets.defs.captioning.assets import captions
from video_assets.defs.engines import job_spec
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.partitions import video_batches

# 5, 2, 1 and 1 segments of 2 s.
CLIPS = ["sam2_04_coffee.mp4", "carphone_distorted.mp4", "fire2.mp4", "asl_eat.mkv"]
SPLIT_2S = {"ops": {"captions": {"config": {"max_frames": 3, "min_frames": 2, "segment_s": 2.0}}}}
WHOLE = {"ops": {"captions": {"config": {"max_frames": 3, "min_frames": 2}}}}


class CrashOnSecondCaptionMerge(DeltaTables):
    """The real tables, with a crash injected where the process would die: the second captions write."""

    def replace_where(self, name, rows, selection):
        if name == CAPTIONS:
            marker = Path(self.root_uri) / ".caption-merges"
            done = int(marker.read_text()) if marker.exists() else 0
            marker.write_text(str(done + 1))
            if done == 1:
                raise RuntimeError("injected crash between two caption merges")
        return super().replace_where(name, rows, selection)


def _per_video(tables: DeltaTables) -> dict[str, tuple[int, int, int]]:
    """name -> (rows, distinct segments, planned segments)."""
    df = pl.read_delta(tables.table_uri(CAPTIONS)).with_columns(name=pl.col("uri").str.split("/").list.last())
    agg = df.group_by("name").agg(pl.len(), pl.col("segment").n_unique(), pl.col("segments").max())
    return {n: (rows, distinct, planned) for n, rows, distinct, planned in agg.iter_rows()}


@pytest.mark.slow
def test_a_crash_between_merges_then_a_rerun_leaves_every_video_whole(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path, monkeypatch
):
    monkeypatch.setattr(runner, "WRITE_EVERY", 2)  # several merges in one small batch
    copy_samples(volume_dir, CLIPS)
    tables = resources["tables"]
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=4, batch_size=4),
        **session_ray,  # the session's Ray, joined
    }
    [key] = register_new_files(res["volume"], tables).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success

    def caption(run_config, tables_resource):
        return materialize_slice(
            [captions], key, instance=instance, resources={**res, "tables": tables_resource}, run_config=run_config
        )

    crashed = caption(SPLIT_2S, CrashOnSecondCaptionMerge(root_uri=tables.root_uri))
    assert not crashed.success
    first = _per_video(tables)
    assert first, "the first merge should have landed before the crash"
    # Only whole videos were written: every video present has all its planned segments.
    assert all(rows == distinct == planned for rows, distinct, planned in first.values()), first
    assert len(first) < len(CLIPS)

    again = caption(SPLIT_2S, tables)
    assert again.success
    assert {e.check_name: e.passed for e in again.get_asset_check_evaluations()}["captions_videos_complete"]
    meta = again.asset_materializations_for_node("captions")[0].metadata
    assert meta["videos_cached"].value == len(first)  # the whole videos were reused, the rest captioned
    after = _per_video(tables)
    assert after == {"sam2_04_coffee.mp4": (5, 5, 5), "carphone_distorted.mp4": (2, 2, 2), **_ones(after)}
    assert set(after) == set(CLIPS)

    # Another split: the videos are captioned again and their old segments replaced, none left stale.
    whole = caption(WHOLE, tables)
    assert whole.success
    assert whole.asset_materializations_for_node("captions")[0].metadata["videos_cached"].value == 0
    assert _per_video(tables) == dict.fromkeys(CLIPS, (1, 1, 1))
    splits = set(pl.read_delta(tables.table_uri(CAPTIONS))["split"])
    assert splits == {"segment_s=none;scene_split=false"}


def _ones(found: dict) -> dict:
    return {n: (1, 1, 1) for n in ("fire2.mp4", "asl_eat.mkv") if n in found}


@pytest.mark.slow
def test_a_killed_decode_worker_is_retried_with_one_row_per_segment(tiny_model, tmp_path, dagster_home):
    """Fault injection: the first decode task kills its Ray worker (as an OOM kill would) after handing on
    its video's first segment. Ray runs the task again; the written table has exactly one row per (video,
    segment), every video whole. The
    fault is put into each Ray worker by a setup hook (the product has no hook of its own)."""
    import ray

    marker = str(tmp_path / "killed")

    def kill_the_first_decode():  # runs in every Ray worker at start (pickled by value)
        import os

        from video_assets.core.captioning import job

        class DiesAfterTheFirstSegmentOnce(job.SegmentStream):
            def __iter__(self):
                for segment in super().__iter__():
                    yield segment  # handed on: the task dies with part of its video out
                    try:
                        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        continue  # Ray's retry (and every later task) goes on
                    os._exit(1)

        job.SegmentStream = DiesAfterTheFirstSegmentOnce

    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    vlm = VlmSettings(cache_dir=str(tmp_path), engine="transformers", max_new_tokens=4, batch_size=4)
    sampling = SamplingConfig(min_frames=2, max_frames=3, segment_s=2.0)
    spec = job_spec(sampling, vlm, "transformers", ModelFiles(str(tiny_model)), "Describe.")
    spec = replace(spec, cpu_concurrency=1)
    samples = Path(__file__).resolve().parents[1] / "samples"
    todo = pl.DataFrame(
        [
            {"video_id": f"v{i}", "batch_key": "b", "uri": str(samples / n), "duration_s": None, "rotation": 0}
            for i, n in enumerate(CLIPS[:3])
        ],
        schema={
            "video_id": pl.String,
            "batch_key": pl.String,
            "uri": pl.String,
            "duration_s": pl.Float64,
            "rotation": pl.Int64,
        },
    )
    stamp = {"model_name": "tiny", "model_version": "1", "prompt_version": 1, "engine": "transformers"}
    with embedded_ray_auth():  # the product's embedded Ray: token authentication on
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"worker_process_setup_hook": kill_the_first_decode})
        try:
            runner.run_captioning(_Log(), tables, todo, spec, stamp)
        finally:
            ray.shutdown()
    assert Path(marker).exists(), "the fault was not injected"
    df = pl.read_delta(tables.table_uri(CAPTIONS))
    assert df.group_by("video_id", "segment").len()["len"].max() == 1
    assert (df["status"] == "ok").all()
    assert sorted(captioned_ok(df, "1", 1, split_key(sampling))) == ["v0", "v1", "v2"]
    assert df.height == 5 + 2 + 1


@pytest.mark.slow
def test_an_engine_that_dies_on_one_video_every_time_costs_only_that_video(tiny_model, tmp_path, dagster_home):
    """Fault injection: the engine kills its own process on every batch holding one video (as a fatal
    engine error does: vLLM's stage calls os._exit). Ray starts the engine again each time, tries that
    batch a bounded number of times, then drops it; the job finishes, the other videos are captioned, and
    the poison video gets an error row saying why (it used to be retried forever, or to stall the pool)."""
    import ray

    from video_assets.core.inference.retries import NO_RESULT, VLM_BATCH_RETRIES

    tries = tmp_path / "tries"
    tries.mkdir()

    def die_on_v1():  # runs in every Ray worker at start (pickled by value)
        import os
        import uuid

        from video_assets.core.captioning.transformers_engine import TransformersEngine

        real = TransformersEngine.generate

        def generate(self, requests):
            if any(r.request_id.startswith("v1:") for r in requests):
                (tries / uuid.uuid4().hex).touch()
                os._exit(1)
            return real(self, requests)

        TransformersEngine.generate = generate

    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    vlm = VlmSettings(cache_dir=str(tmp_path), engine="transformers", max_new_tokens=4, batch_size=1)
    spec = job_spec(
        SamplingConfig(min_frames=2, max_frames=3), vlm, "transformers", ModelFiles(str(tiny_model)), "Describe."
    )
    samples = Path(__file__).resolve().parents[1] / "samples"
    todo = pl.DataFrame(
        [
            {"video_id": f"v{i}", "batch_key": "b", "uri": str(samples / n), "duration_s": None, "rotation": 0}
            for i, n in enumerate(CLIPS[:3])
        ],
        schema={"video_id": pl.String, "batch_key": pl.String, "uri": pl.String, "duration_s": pl.Float64}
        | {"rotation": pl.Int64},
    )
    stamp = {"model_name": "tiny", "model_version": "1", "prompt_version": 1, "engine": "transformers"}
    log = _Log()
    with embedded_ray_auth():
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"worker_process_setup_hook": die_on_v1})
        try:
            runner.run_captioning(log, tables, todo, spec, stamp)
        finally:
            ray.shutdown()
    assert len(list(tries.iterdir())) == 1 + VLM_BATCH_RETRIES  # bounded: the first try and its retries
    df = pl.read_delta(tables.table_uri(CAPTIONS)).sort("video_id")
    assert df.select("video_id", "status").rows() == [("v0", "ok"), ("v1", "error"), ("v2", "ok")]
    assert df.filter(pl.col("video_id") == "v1")["error"].to_list() == [NO_RESULT]
    assert any("no result" in line and CLIPS[1] in line for line in log.lines)


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)

    warning = info


def _rows(video: str, statuses: list[str], planned: int | None, split: str | None = "s") -> list[dict]:
    return [
        {
            "video_id": video,
            "batch_key": "b",
            "uri": f"/v/{video}.mp4",
            "segment": i,
            "frame_timestamps": [],
            "prose": "x",
            "model_name": "m",
            "model_version": "1",
            "prompt_version": 1,
            "engine": "transformers",
            "status": status,
            "segments": planned,
            "split": split,
            "captioned_at": datetime.now(UTC),
        }
        for i, status in enumerate(statuses)
    ]


def test_a_video_counts_as_captioned_only_when_every_planned_segment_is_ok():
    df = pl.from_arrow(
        to_arrow(
            CAPTIONS,
            _rows("whole", ["ok", "ok", "ok"], 3)
            + _rows("one_failed", ["ok", "error", "ok"], 3)
            + _rows("one_missing", ["ok", "ok"], 3)
            + _rows("other_split", ["ok"], 1, split="t")
            + _rows("legacy", ["ok", "ok"], None, split=None),
        )
    )
    assert sorted(captioned_ok(df, "1", 1)) == ["legacy", "other_split", "whole"]
    assert sorted(captioned_ok(df, "1", 1, split="s")) == ["legacy", "whole"]
    assert captioned_ok(df, "2", 1) == [] and captioned_ok(df, "1", 2) == []
    table = video_completeness(df, "1", 1).sort("video_id")
    assert table.filter(pl.col("video_id") == "one_missing").row(0, named=True) | {} == {
        "video_id": "one_missing",
        "rows": 2,
        "ok_segments": 2,
        "planned": 3,
        "split": "s",
        "complete": False,
    }
    # A table written before the completeness columns existed reads the same way.
    legacy = df.drop("segments", "split")
    assert sorted(captioned_ok(legacy, "1", 1, split="s")) == ["legacy", "one_missing", "other_split", "whole"]
    # The planned count each video's rows carry is read back exactly (``segments``); a legacy row has none.
    planned = dict(video_completeness(df, "1", 1).select("video_id", "planned").iter_rows())
    assert planned == {"whole": 3, "one_failed": 3, "one_missing": 3, "other_split": 1, "legacy": None}
    assert set(video_completeness(legacy, "1", 1)["planned"].to_list()) == {None}
    assert SCHEMAS[CAPTIONS].field("segments").type == pa.int32()


def test_a_table_from_before_the_completeness_columns_takes_new_rows(tmp_path):
    """Captions tables written before ``segments``/``split`` existed get the columns, then the rows."""
    from deltalake import write_deltalake

    tables = DeltaTables(root_uri=str(tmp_path))
    old_schema = pa.schema([f for f in SCHEMAS[CAPTIONS] if f.name not in ("segments", "split")])
    old = _rows("kept", ["ok"], None, None)
    write_deltalake(
        tables.table_uri(CAPTIONS),
        pa.Table.from_pylist([{k: r.get(k) for k in old_schema.names} for r in old], schema=old_schema),
    )
    new = _rows("v1", ["ok", "ok"], 2)
    runner._write(
        tables,
        new,
        {k: new[0][k] for k in ("model_name", "model_version", "prompt_version", "engine")},
        "s",
        "captions",
    )
    df = pl.read_delta(tables.table_uri(CAPTIONS)).sort("video_id", "segment")
    assert df["video_id"].to_list() == ["kept", "v1", "v1"]
    assert df["segments"].to_list() == [None, 2, 2] and df["split"].to_list() == [None, "s", "s"]
    assert sorted(captioned_ok(df, "1", 1, split="s")) == ["kept", "v1"]
