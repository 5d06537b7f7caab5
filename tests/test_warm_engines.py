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
from video_assets.core.captioning.job import WARM_NAMESPACE, caption_rows, warm_engine_names
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.media.sampling import SamplingConfig
from video_assets.defs.captioning.runner import job_spec

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
    vlm = VlmSettings(cache_dir="/tmp", engine="transformers", max_new_tokens=4, vlm_batch_size=4)
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

    vlm = VlmSettings(cache_dir="/tmp", engine="transformers", max_new_tokens=4, vlm_batch_size=4)
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
