"""structured_events -> alerts/review_queue -> eval_scores, and eval-gated promotion, on real local
Ray, a real MLflow SQLite store, real Delta tables and tiny real Qwen2.5-VL models."""

import os

import polars as pl
import pytest
from dagster import SkipReason, build_sensor_context, materialize
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from resources.delivery import AlertDestinations
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from tests.fixtures.samples import copy_samples
from tests.fixtures.tiny_models import build_tiny_vlm
from video_assets.core.evaluation.gate import GATED
from video_assets.core.routing import route
from video_assets.core.structuring import usecase as uc_mod
from video_assets.definitions import defs
from video_assets.defs.captioning.assets import captions
from video_assets.defs.evaluation.assets import eval_scores, golden_set
from video_assets.defs.evaluation.checks import FloorsConfig, eval_scores_above_floors
from video_assets.defs.evaluation.checks import evaluation_checks as eval_checks
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.partitions import video_batches
from video_assets.defs.promotion.sensors import challenger_sensor
from video_assets.defs.routing.assets import routed_events
from video_assets.defs.routing.checks import routing_checks
from video_assets.defs.structuring.assets import structured_events
from video_assets.defs.structuring.checks import structuring_checks

CAPTION_CONFIG = {"max_frames": 4, "min_frames": 2}
ALL = [
    raw_videos,
    video_metadata,
    vlm_model,
    caption_prompt,
    captions,
    structured_events,
    routed_events,
    golden_set,
    eval_scores,
]


def _resources(base, tmp_path, model_source=None, cache=None, **structurer):
    """``base``: the volume and tables, and the session's Ray resources (``ray_cluster``, and
    ``ray_on_demand`` that the structuring step connects only when vLLM may run, as in definitions.py)."""
    return {
        **base,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(
            cache_dir=str(cache),
            max_new_tokens=8,
            batch_size=2,
            **({"model_source": model_source} if model_source else {}),
        ),
        "structurer": StructurerSettings(device="cpu", **structurer),
    }


def _batch(res, instance):
    plan = register_new_files(res["volume"], res["tables"])
    [key] = plan.batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    return key


def read(res, name):
    return pl.read_delta(res["tables"].table_uri(name))


@pytest.mark.slow
def test_every_caption_becomes_a_routed_scored_row(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path
):
    copy_samples(volume_dir, ["asl_eat.mkv", "realshort.mp4", "bottle-detection.mp4"])
    (volume_dir / "corrupt.mp4").write_bytes(os.urandom(30_000))
    res = _resources(
        {**resources, **session_ray}, tmp_path, cache=tiny_model_cache, use_cases="object_handling,loss_prevention"
    )
    key = _batch(res, instance)
    run_config = {"ops": {"captions": {"config": CAPTION_CONFIG}}}
    assert materialize([vlm_model, caption_prompt, golden_set], instance=instance, resources=res).success
    per_batch = [raw_videos, video_metadata, captions, structured_events, routed_events]
    batch_run = materialize(
        [*per_batch, *structuring_checks, *routing_checks],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config=run_config,
    )
    assert batch_run.success
    checks = {(e.asset_key.to_user_string(), e.check_name): e.passed for e in batch_run.get_asset_check_evaluations()}
    assert checks == {
        (t, c): True
        for t in ("structured_events", "alerts", "review_queue")
        for c in ("unique_key", "required_columns", f"{t}_follow_captions")
    }
    # Data versions name what a batch's rows derive from, so a new prompt or use case makes them stale.
    versions = {
        m.asset_key.to_user_string(): m.tags["dagster/data_version"]
        for m in (e.event_specific_data.materialization for e in batch_run.get_asset_materialization_events())
    }
    assert versions["captions"] == "model-v1-prompt-v1"
    ucs = [uc_mod.load(n) for n in ("object_handling", "loss_prevention")]
    assert all(f"{u.name}:{u.version}" in versions["structured_events"] for u in ucs)
    strips = batch_run.asset_materializations_for_node("captions")[0].metadata["sampled_frames"].value
    assert strips.count("](data:image/jpeg;base64,") == 3  # the three good clips, not the corrupt one

    caps, events = read(res, "captions"), read(res, "structured_events")
    # Nothing missing: one row per caption and use case, each a valid status.
    assert events.height == caps.height * 2 == 8
    assert set(events["use_case"]) == {"object_handling", "loss_prevention"}
    assert set(events["status"]) <= {"parsed", "retried", "unparsed", "no_caption"}
    errored = set(caps.filter(pl.col("status") == "error")["video_id"])
    assert errored and set(events.filter(pl.col("status") == "no_caption")["video_id"]) == errored
    answered = events.filter(pl.col("status").is_in(["parsed", "retried"]))
    assert answered["verdict"].is_in(["confirmed", "suspected", "possible", "none"]).all()
    assert (events.filter(pl.col("status") == "unparsed")["raw_output"].str.len_chars() > 0).all()
    assert (events["n_events"] == events["events"].list.len()).all()

    # Routing agrees with the rule row by row, with each use case's own threshold.
    alerts, review = read(res, "alerts"), read(res, "review_queue")
    thresholds = {"object_handling": 0.7, "loss_prevention": 0.8}
    for r in events.to_dicts():
        where, _ = route(r, thresholds[r["use_case"]])
        key_cols = (pl.col("video_id") == r["video_id"]) & (pl.col("use_case") == r["use_case"])
        assert alerts.filter(key_cols).height == (where == "alerts")
        assert review.filter(key_cols).height == (where == "review_queue")

    # A new threshold moves rows on rerun: at 0 every flagged row with a confidence is an alert.
    assert materialize(
        [routed_events],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config={"ops": {"routed_events": {"config": {"alert_threshold": 0.0}}}},
    ).success
    flagged = events.filter(pl.col("verdict").is_in(["confirmed", "suspected"]) & pl.col("confidence").is_not_null())
    assert read(res, "alerts").height == flagged.height
    assert set(read(res, "alerts")["threshold"]) <= {0.0}

    # Idempotent: structuring again writes nothing new.
    again = materialize([structured_events], partition_key=key, instance=instance, resources=res)
    meta = again.asset_materializations_for_node("structured_events")[0].metadata
    assert meta["rows_written"].value == 0 and read(res, "structured_events").height == 8

    result = materialize(
        [eval_scores, *eval_checks],
        instance=instance,
        resources=res,
        run_config={"ops": {"eval_scores": {"config": {"bootstrap": 50}}}},
    )
    assert result.success
    scores = read(res, "eval_scores")
    assert sorted(scores["use_case"]) == ["loss_prevention", "object_handling"]
    # Of the 24 labelled clips only the 3 registered good ones can be scored.
    assert set(scores["scored_videos"]) == {3} and set(scores["golden_videos"]) == {24}
    assert (scores["coverage"].is_between(0, 1)).all()
    client = MlflowClient(res["mlflow_registry"].tracking_uri)
    run = client.get_run(scores["mlflow_run_id"][0])
    assert run.data.tags["model_version"] == "1" and run.data.tags["prompt_version"] == "1"
    assert "flagged_f1" in run.data.metrics and "coverage" in run.data.metrics
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"confusion.png", "scores.json"}
    meta = result.asset_materializations_for_node("eval_scores")[0].metadata
    assert meta["object_handling/confusion"].value.startswith("![confusion matrix](data:image/png;base64,")
    checks = {
        e.check_name: e for e in result.get_asset_check_evaluations() if e.asset_key.to_user_string() == "eval_scores"
    }
    assert checks["unique_key"].passed and checks["required_columns"].passed
    # Random weights: the scores are whatever they are. The floor check ran in the run with its default floors;
    # its rule is shown against floors these rows must meet and floors they cannot all meet.
    ran = checks["eval_scores_above_floors"]
    assert ran.metadata["floors"].value == {"flagged_f1": 0.0, "coverage": 0.9, "event_f1": 0.0}
    assert ran.metadata["use_cases"].value == 2
    zero = eval_scores_above_floors(
        config=FloorsConfig(min_flagged_f1=0, min_coverage=0, min_event_f1=0), tables=res["tables"]
    )
    assert zero.passed and zero.metadata["below_floor"].value == {}
    metrics = ("flagged_f1", "coverage", "event_f1")
    short = {f"{r['use_case']}.{k}": round(r[k], 4) for r in scores.to_dicts() for k in metrics if r[k] < 1}
    assert short, "every score is 1.0 with random weights: no floor can fail"
    perfect = eval_scores_above_floors(
        config=FloorsConfig(min_flagged_f1=1, min_coverage=1, min_event_f1=1), tables=res["tables"]
    )
    assert not perfect.passed and perfect.metadata["below_floor"].value == short
    assert ran.passed == (ran.metadata["below_floor"].value == {})


def _decisions(result):
    return [
        m
        for m in result.asset_materializations_for_node("promotion")
        if m.asset_key.to_user_string() == "promotion_decisions"
    ]


def _decision(result):
    [mat] = _decisions(result)
    return mat.metadata


@pytest.mark.slow
def test_promotion_both_ways(instance, resources, session_ray, volume_dir, tmp_path):
    # Two labelled 'confirmed' clips and one 'none': a model that always answers confirmed beats one
    # that always answers none on flagged F1 (0.8 vs 0) and macro F1 (0.7 vs 0.625).
    copy_samples(volume_dir, ["bottle-detection.mp4", "sam2_04_coffee.mp4", "asl_eat.mkv"])
    says_none = build_tiny_vlm(tmp_path / "models" / "says-none", prefer="none")
    says_confirmed = build_tiny_vlm(tmp_path / "models" / "says-confirmed", prefer="confirmed")
    cache = tmp_path / "cache"
    base = _resources({**resources, **session_ray}, tmp_path, model_source=str(says_none), cache=cache)
    key = _batch(base, instance)
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=base).success
    assert materialize([vlm_model, caption_prompt, golden_set], instance=instance, resources=base).success
    client = MlflowClient(base["mlflow_registry"].tracking_uri)
    assert str(client.get_model_version_by_alias("video-captioner", "production").version) == "1"

    challenger = _resources({**resources, **session_ray}, tmp_path, model_source=str(says_confirmed), cache=cache)
    reg = materialize([vlm_model], instance=instance, resources=challenger)
    assert reg.asset_materializations_for_node("vlm_model")[0].metadata["alias"].value == "challenger"
    # Its data version is what is in production (v1): registering a challenger makes nothing downstream stale.
    assert reg.asset_materializations_for_node("vlm_model")[0].tags["dagster/data_version"] == "v1"
    assert str(client.get_model_version_by_alias("video-captioner", "challenger").version) == "2"
    assert str(client.get_model_version_by_alias("video-captioner", "production").version) == "1"  # untouched
    # The (opt-in) challenger sensor asks for one promotion run per challenger.
    sensor_res = {"vlm": challenger["vlm"], "mlflow_registry": challenger["mlflow_registry"]}
    request = challenger_sensor(build_sensor_context(instance=instance, resources=sensor_res))
    assert request.run_key == "model-2-prompt-None"

    # Three labelled clips are too few for the gate (min_videos 10 by default): it says so, promotes nothing,
    # and leaves the challenger in place for a decision with more labels (or force).
    small = {"bootstrap": 20, "max_frames": 4, "min_frames": 2}
    undecided = defs.resolve_job_def("promote_challenger").execute_in_process(
        instance=instance, resources=challenger, run_config={"ops": {"promotion": {"config": small}}}
    )
    out = _decision(undecided)
    assert undecided.success and out["promoted"].value is False and out["gate"].value == "undecided"
    assert "3 golden videos" in out["reason"].value and set(out["intervals"].value) == set(GATED)
    assert str(client.get_model_version_by_alias("video-captioner", "challenger").version) == "2"
    assert str(client.get_model_version_by_alias("video-captioner", "production").version) == "1"
    # Forced: promoted although undecided (and the row says so).
    forced = {"ops": {"promotion": {"config": {**small, "force": True}}}}
    # The flips' clip links point at the service's configured address (VIDEO_SERVICE_URL), as alerts' do.
    service = AlertDestinations(service_url="http://videos.example.internal:9300")
    better = defs.resolve_job_def("promote_challenger").execute_in_process(
        instance=instance, resources={**challenger, "alert_delivery": service}, run_config=forced
    )
    assert better.success and _decision(better)["promoted"].value is True
    assert "promoted anyway: force" in _decision(better)["reason"].value
    # The promotion reports the new production version as vlm_model's data version: Dagster now shows every
    # batch captioned before as stale (video-assets reprocess redoes them).
    from dagster import AssetKey

    moved = instance.get_latest_materialization_event(AssetKey("vlm_model")).asset_materialization
    assert moved.tags["dagster/data_version"] == "v2" and moved.metadata["promoted_by"].value
    # The paired intervals: flagged F1 0 -> 0.8 on these clips, but 3 clips resampled say anything from -1 to +1.
    flagged = _decision(better)["intervals"].value["flagged_f1"]
    assert (flagged["production"], flagged["challenger"]) == (0.0, pytest.approx(0.8))
    assert flagged["low"] < 0 < flagged["high"]
    # The job writes only tables of its own, each a materialisation: the pipeline's tables are untouched.
    written = {
        m.asset_key.to_user_string()
        for m in better.get_asset_materialization_events()
        for m in [m.event_specific_data.materialization]
    }
    assert written == {
        "candidate_captions",
        "candidate_events",
        "candidate_scores",
        "promotion_decisions",
        "promotion_diffs",
    }
    # The fact diff: the always-confirmed challenger flags all three clips production left alone (two are
    # labelled confirmed, one none), and the flips wait on the review page as items.
    promoted_id = _decision(better)["decision_id"].value
    diffs = read(base, "promotion_diffs").filter(pl.col("decision_id") == promoted_id)
    got = sorted(diffs.select("uri", "expected", "change", "production_verdict", "challenger_verdict").rows())
    assert [(u.rsplit("/", 1)[1], *rest) for u, *rest in got] == [
        ("asl_eat.mkv", "none", "flag_gained", "none", "confirmed"),
        ("bottle-detection.mp4", "confirmed", "flag_gained", "none", "confirmed"),
        ("sam2_04_coffee.mp4", "confirmed", "flag_gained", "none", "confirmed"),
    ]
    diff_meta = next(
        m.metadata
        for m in better.asset_materializations_for_node("promotion")
        if m.asset_key.to_user_string() == "promotion_diffs"
    )
    assert diff_meta["changes"].value["flag_gained"] == 3 and "/file#t=" in diff_meta["flips"].value
    assert diff_meta["flips"].value.count("(http://videos.example.internal:9300/api/videos/") == 3
    from video_assets.core.review.queue import ranked

    items = ranked(pl.DataFrame(), "object_handling", diffs=read(base, "promotion_diffs"))  # no queue: flips alone
    assert len(items) == 3 and {i["tier"] for i in items} == {"challenger disagrees"}
    assert not base["tables"].exists("captions") and not base["tables"].exists("eval_scores")
    assert str(client.get_model_version_by_alias("video-captioner", "production").version) == "2"
    decisions = read(base, "promotion_decisions").sort("decided_at")
    assert decisions["gate"].to_list() == ["undecided", "undecided"] and decisions["promoted"].to_list() == [
        False,
        True,
    ]
    assert decisions["forced"].to_list() == [False, True]
    decisions = decisions.filter(pl.col("promoted"))
    ids = [decisions["production_eval_id"][0], decisions["challenger_eval_id"][0]]
    scores = read(base, "candidate_scores").filter(pl.col("eval_id").is_in(ids))
    by_candidate = {r["candidate"]: r for r in scores.to_dicts()}
    assert by_candidate["production"]["flagged_f1"] == 0.0 and by_candidate["challenger"][
        "flagged_f1"
    ] == pytest.approx(0.8)
    assert {by_candidate["production"]["eval_id"], by_candidate["challenger"]["eval_id"]} == {
        decisions["production_eval_id"][0],
        decisions["challenger_eval_id"][0],
    }

    # The always-none model comes back as challenger (same bytes: version 1 again) and is rejected.
    # Allowed to decide on 3 clips, the gate rejects it: flagged F1 may drop by up to 1.
    reg = materialize([vlm_model], instance=instance, resources=base)
    assert reg.asset_materializations_for_node("vlm_model")[0].metadata["alias"].value == "challenger"
    run_config = {"ops": {"promotion": {"config": {**small, "min_videos": 3}}}}
    worse = defs.resolve_job_def("promote_challenger").execute_in_process(
        instance=instance, resources=base, run_config=run_config
    )
    out = _decision(worse)
    assert worse.success and out["promoted"].value is False and "flagged_f1" in out["reason"].value
    assert str(client.get_model_version_by_alias("video-captioner", "production").version) == "2"  # unchanged
    decisions = read(base, "promotion_decisions").sort("decided_at")
    assert decisions["promoted"].to_list() == [False, True, False]
    assert decisions["gate"].to_list() == ["undecided", "undecided", "reject"]
    assert read(base, "candidate_scores").height == 6  # both score sets of the three decisions
    with pytest.raises(MlflowException, match="challenger"):
        client.get_model_version_by_alias("video-captioner", "challenger")  # evaluated: alias cleared
    assert "rejected" in client.get_model_version("video-captioner", "1").tags["promotion"]

    # Nothing to evaluate now.
    idle = defs.resolve_job_def("promote_challenger").execute_in_process(
        instance=instance, resources=base, run_config=run_config
    )
    assert idle.success and _decisions(idle) == []
    assert isinstance(challenger_sensor(build_sensor_context(instance=instance, resources=sensor_res)), SkipReason)
