"""Warm engines: on a Ray cluster that outlives the job, the caption engine is a detached actor that the
next batch reuses (no second actor start or model load), that a new model or setting does not reuse,
and that exits by itself when idle. Real local Ray, the tiny real model, bundled clips."""

import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from resources.settings import embedded_ray_auth
from resources.vlm import VlmSettings
from video_assets.core.captioning.job import WARM_NAMESPACE, caption_rows, ensure_warm_engines, warm_engine_names
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.media.sampling import SamplingConfig
from video_assets.defs.engines import job_spec

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def _videos(names):
    return [
        {"video_id": n, "batch_key": "b", "uri": str(SAMPLES / n), "duration_s": None, "rotation": 0} for n in names
    ]


@pytest.fixture
def local_ray(dagster_home):
    with embedded_ray_auth():  # the product's embedded Ray: token authentication on
        ray.init(num_cpus=2, include_dashboard=False)
        yield
        ray.shutdown()


def _engine(name):
    return ray.get_actor(name, namespace=WARM_NAMESPACE)


@pytest.mark.slow
def test_the_next_batch_reuses_the_loaded_engine_and_idle_engines_exit(local_ray, tiny_model):
    vlm = VlmSettings(cache_dir="/tmp", engine="transformers", max_new_tokens=4, batch_size=4)
    spec = job_spec(
        SamplingConfig(min_frames=2, max_frames=3), vlm, "transformers", ModelFiles(str(tiny_model)), "Describe."
    )
    spec = replace(spec, warm_idle_s=6.0)
    [name] = warm_engine_names(spec)

    first = list(caption_rows(_videos(["realshort.mp4", "asl_eat.mkv"]), spec))
    assert [r["status"] for r in first] == ["ok", "ok"] and all(r["prose"] for r in first)
    engine = ray.get(_engine(name).info.remote())
    assert {r["engine_node"] for r in first} == {engine["node"]}

    second = list(caption_rows(_videos(["fire2.mp4"]), spec))
    assert [r["status"] for r in second] == ["ok"]
    assert ray.get(_engine(name).info.remote())["pid"] == engine["pid"]  # the same loaded engine

    # Another model (or any setting that changes what an engine computes) gets its own engine.
    other = replace(spec, engine=replace(spec.engine, max_new_tokens=5))
    assert warm_engine_names(other) != [name]

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            _engine(name)
        except ValueError:
            break
        time.sleep(1)
    else:
        pytest.fail("the idle warm engine did not exit")


@pytest.mark.slow
def test_a_new_model_stops_an_idle_engine_that_would_leave_no_cpu_for_decoding(local_ray, tiny_model):
    """On 2 CPUs an idle engine of the previous model holds one and the new engine the other: without
    eviction no decode task could start until the old engine expired (10 minutes here)."""
    import threading

    vlm = VlmSettings(cache_dir="/tmp", engine="transformers", max_new_tokens=4, batch_size=4)
    spec = job_spec(
        SamplingConfig(min_frames=2, max_frames=3), vlm, "transformers", ModelFiles(str(tiny_model)), "Describe."
    )
    old = replace(spec, warm_idle_s=600.0)
    new = replace(old, engine=replace(old.engine, max_new_tokens=5))  # another engine: another name
    [old_name], [new_name] = warm_engine_names(old), warm_engine_names(new)
    assert [r["status"] for r in caption_rows(_videos(["realshort.mp4"]), old)] == ["ok"]
    assert ray.get(_engine(old_name).info.remote())["busy"] == 0

    done: list = []
    worker = threading.Thread(target=lambda: done.extend(caption_rows(_videos(["fire2.mp4"]), new)), daemon=True)
    worker.start()
    worker.join(timeout=180)
    assert not worker.is_alive(), "the job stalled behind the idle engine of the other model"
    assert [r["status"] for r in done] == ["ok"]
    with pytest.raises(ValueError):
        _engine(old_name)  # stopped to make room
    assert ray.get(_engine(new_name).info.remote())["busy"] == 0


@pytest.mark.slow
def test_an_engine_that_dies_under_a_batch_is_started_again_and_nothing_is_lost(local_ray, tiny_model):
    """The job's driver hands batches to the warm engine (two queued): killing the engine mid-job
    fails the batches it held; they go to a new engine, and every segment comes back once, ok."""
    # Long generations: the batch queued behind the first one is still at the engine when it is killed.
    vlm = VlmSettings(cache_dir="/tmp", engine="transformers", max_new_tokens=64, batch_size=1)
    spec = job_spec(
        SamplingConfig(min_frames=2, max_frames=3), vlm, "transformers", ModelFiles(str(tiny_model)), "Describe."
    )
    spec = replace(spec, warm_idle_s=60.0)
    [name] = warm_engine_names(spec)
    names = ["realshort.mp4", "asl_eat.mkv", "fire2.mp4", "tree.avi", "carphone_distorted.mp4"]
    ensure_warm_engines(spec)
    before = ray.get(_engine(name).info.remote())["pid"]  # asked now: later it would queue behind batches
    rows = caption_rows(_videos(names), spec)
    first = next(rows)
    ray.kill(_engine(name), no_restart=True)  # the next batch is at it: the driver keeps two queued
    rest = list(rows)
    got = [first, *rest]
    assert sorted(r["video_id"] for r in got) == sorted(names)  # each once
    assert all(r["status"] == "ok" and r["prose"] for r in got), [
        (r["video_id"], r["status"], r["error"], r["prose"]) for r in got
    ]
    assert ray.get(_engine(name).info.remote())["pid"] != before  # served by a new engine


class _Encoder:
    """A model stage of an archive job: one actor, one CPU."""

    def __call__(self, batch):
        return {"n": [int(x) * 2 for x in batch["n"]]}


def _split(row):
    return [{"n": row["n"]}]


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: before, the job waited for the engine's idle delay (an hour here)
def test_an_idle_caption_engine_does_not_make_the_next_stage_wait_for_its_expiry(local_ray, tiny_model):
    """An archive stage after captions on the long-lived Ray, on 2 CPUs: the idle warm caption engine holds
    one, the stage needs an encoder actor and a decode task. The engine is stopped to make room (the next
    captions batch starts it again) instead of the stage waiting for its idle delay."""
    from video_assets.core.inference.stages import StageSpec, stream

    vlm = VlmSettings(cache_dir="/tmp", engine="transformers", max_new_tokens=4, batch_size=4)
    spec = job_spec(SamplingConfig(), vlm, "transformers", ModelFiles(str(tiny_model)), "Describe.")
    spec = replace(spec, warm_idle_s=3600.0)
    [name] = ensure_warm_engines(spec)
    assert ray.get(_engine(name).info.remote())["busy"] == 0  # up and idle

    rows = list(stream([{"n": i} for i in range(4)], _split, {}, _Encoder, {}, StageSpec(1, 1, 0.0, 2)))
    assert sorted(r["n"] for r in rows) == [0, 2, 4, 6]
    with pytest.raises(ValueError):
        _engine(name)  # stopped to make room
