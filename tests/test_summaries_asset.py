"""video_summaries for a batch as the pipeline runs it: real Delta tables (captions, transcripts and
structured_events rows written by the test), a real MLflow SQLite store holding the production caption
model and prompt and the speech model (registered as plain files: the asset only resolves their
versions), Dagster's materialize. Extractive without an LLM; 'llm:<model>' through an OpenAI-compatible
stub server (the real openai SDK talks to it)."""

from datetime import UTC, datetime

import polars as pl
import pytest
import ray
from dagster import AssetMaterialization, materialize
from dagster_ray.configs import Lifecycle

from resources.archive import SPEECH, ArchiveSettings
from resources.llm import LlmSettings
from resources.mlflow_registry import MlflowRegistry
from resources.ray_cluster import EmbeddedRay
from resources.vlm import VlmSettings
from tests.fixtures.openai_stub import stub_server
from tests.fixtures.processes import free_port
from video_assets.core.qa.summaries import MAP_MARKER
from video_assets.core.tables import CAPTIONS, STRUCTURED_EVENTS, TRANSCRIPTS, VIDEO_SUMMARIES, to_arrow
from video_assets.defs.models.assets import CAPTION_PROMPT_NAME
from video_assets.defs.partitions import video_batches
from video_assets.defs.summaries import defs as summaries_defs
from video_assets.defs.summaries.assets import video_summaries

BATCH = "b-0001"
NOW = datetime(2025, 1, 1, tzinfo=UTC)
VIDEOS = {"a" * 64: "shop.mp4", "b" * 64: "kitchen.mp4", "c" * 64: "street.mp4"}


def _caption(vid: str, seg: int, prose: str) -> dict:
    return dict(
        video_id=vid, batch_key=BATCH, uri=f"/vol/{VIDEOS[vid]}", segment=seg, segment_start_s=10.0 * seg,
        segment_end_s=10.0 * seg + 10, frame_timestamps=[10.0 * seg], prose=prose, model_name="video-captioner",
        model_version="1", prompt_version=1, engine="transformers", status="ok", segments=3, captioned_at=NOW,
    )  # fmt: skip


def _captions(changed: str = "") -> list[dict]:
    rows = []
    for vid, name in VIDEOS.items():
        for seg in range(3):
            rows.append(_caption(vid, seg, f"In {name}, scene {seg}: a person stands near the shelf.{changed}"))
    rows.append(
        {**_caption("a" * 64, 0, "an older caption"), "prompt_version": 7}
    )  # not the pair the captions step recorded
    return rows


def _transcripts() -> list[dict]:
    said = dict(batch_key=BATCH, model_name="whisper", model_version="1", transcribed_at=NOW)
    return [
        {**said, "video_id": "a" * 64, "uri": "/vol/shop.mp4", "segment": 0, "start_s": 12.0, "end_s": 14.5,
         "text": "Can I help you?", "status": "speech"},
        {**said, "video_id": "b" * 64, "uri": "/vol/kitchen.mp4", "segment": -1, "status": "no_speech", "text": ""},
        {**said, "video_id": "a" * 64, "uri": "/vol/shop.mp4", "segment": 0, "start_s": 1.0, "end_s": 2.0,
         "text": "old model words", "status": "speech", "model_version": "0"},
    ]  # fmt: skip


def _events() -> list[dict]:
    key = dict(
        batch_key=BATCH, model_version="1", prompt_version=1, use_case="object_handling", use_case_version="u1",
        structurer="captioner", structured_at=NOW, attempts=1,
    )  # fmt: skip
    pick = {"start_s": 21.0, "end_s": 23.0, "actor": "man", "action": "pocket", "object": "phone"}
    return [
        {**key, "video_id": "a" * 64, "uri": "/vol/shop.mp4", "segment": 2, "segment_start_s": 20.0,
         "segment_end_s": 30.0, "status": "parsed", "verdict": "suspected", "confidence": 0.8, "events": [pick],
         "n_events": 1},
        {**key, "video_id": "c" * 64, "uri": "/vol/street.mp4", "segment": 0, "status": "unparsed", "n_events": 0},
    ]  # fmt: skip


@pytest.fixture
def setup(instance, resources, tmp_path):
    registry = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    vlm = VlmSettings(cache_dir=str(tmp_path / "models"))
    archive = ArchiveSettings(cache_dir=str(tmp_path / "models"))
    files = tmp_path / "model-files"
    files.mkdir()
    (files / "weights.txt").write_text("only the version is resolved by this asset\n")
    (files / "config.json").write_text("{}")  # a model folder (LLM_BASE_URL=captioner opens its files)
    for name in (vlm.registered_model, archive.registered_model(SPEECH)):
        registry.register_model_folder(files, name, "production", "test", name, flavor="files")
    registry.register_prompt(CAPTION_PROMPT_NAME, "Describe the clip.", alias="production")
    tables = resources["tables"]
    tables.merge(CAPTIONS, to_arrow(CAPTIONS, _captions()), ["video_id", "segment", "model_version", "prompt_version"])
    tables.merge(TRANSCRIPTS, to_arrow(TRANSCRIPTS, _transcripts()), ["video_id", "segment", "model_version"])
    tables.merge(STRUCTURED_EVENTS, to_arrow(STRUCTURED_EVENTS, _events()), ["video_id", "segment", "use_case"])
    instance.add_dynamic_partitions(video_batches.name, [BATCH])
    # What the upstream steps record when they write those rows: the versions summaries follow (lineage).
    pair = {"model_version": "1", "prompt_version": 1}
    for asset, meta in (("captions", pair), ("transcripts", {"model_version": "1"}), ("structured_events", pair)):
        instance.report_runless_asset_event(AssetMaterialization(asset, partition=BATCH, metadata=meta))
    # Ray only if the caption model's served application is asked for (LLM_BASE_URL=captioner).
    ray_on_demand = EmbeddedRay(lifecycle=Lifecycle(connect=False))
    return {
        **resources,
        "mlflow_registry": registry,
        "vlm": vlm,
        "archive": archive,
        "llm": LlmSettings(),
        "ray_on_demand": ray_on_demand,
    }


def _run(instance, res, ok: bool = True):
    result = materialize(
        [video_summaries, *summaries_defs.asset_checks],
        partition_key=BATCH,
        instance=instance,
        resources=res,
        raise_on_error=False,
    )
    assert result.success is ok
    if not ok:
        return result
    assert all(e.passed for e in result.get_asset_check_evaluations())
    return result.asset_materializations_for_node("video_summaries")[0].metadata


def _summaries(res) -> pl.DataFrame:
    return pl.read_delta(res["tables"].table_uri(VIDEO_SUMMARIES)).sort("summarizer", "uri")


def test_video_summaries_extractive_idempotent_then_by_an_llm(instance, setup, tmp_path, monkeypatch):
    res, tables = setup, setup["tables"]
    first = _run(instance, res)
    out = _summaries(res)
    assert out.height == 3 and set(out["summarizer"]) == {"extractive"}
    shop = out.filter(pl.col("uri") == "/vol/shop.mp4").row(0, named=True)
    assert shop["summary"].splitlines() == [
        "[00:00] In shop.mp4, scene 0: a person stands near the shelf.",
        "[00:10] In shop.mp4, scene 1: a person stands near the shelf.",
        "[00:12] said: “Can I help you?”",
        "[00:20] In shop.mp4, scene 2: a person stands near the shelf.",
        "[00:21] event (object_handling suspected 0.80): man pocket phone",
    ]  # the recorded pair's captions, the recorded speech model's words, the parsed event; in time order
    assert (shop["start_s"], shop["end_s"], shop["chunks"]) == (0.0, 30.0, 1)
    assert "event" not in out.filter(pl.col("uri") == "/vol/street.mp4")["summary"][0]  # unparsed: no event line
    assert first["videos_summarized"].value == 3 and first["summarizer"].value == "extractive"
    assert "[00:" in first["example_summary"].value

    # Unchanged inputs: nothing written (no Delta commit).
    version = tables.version(VIDEO_SUMMARIES)
    again = _run(instance, res)
    assert tables.version(VIDEO_SUMMARIES) == version
    assert (again["videos_summarized"].value, again["videos_unchanged"].value) == (0, 3)

    # One video's captions change: only that video is summarised again.
    shop_rows = [
        r for r in _captions(" Now with a red bag.") if r["uri"] == "/vol/shop.mp4" and r["prompt_version"] == 1
    ]
    tables.merge(CAPTIONS, to_arrow(CAPTIONS, shop_rows), ["video_id", "segment", "model_version", "prompt_version"])
    third = _run(instance, res)
    assert (third["videos_summarized"].value, third["videos_unchanged"].value) == (1, 2)
    after = _summaries(res)
    changed = after.join(out, on="video_id", suffix="_before").filter(pl.col("summary") != pl.col("summary_before"))
    assert changed["uri"].to_list() == ["/vol/shop.mp4"] and "red bag" in changed["summary"][0]

    # With an LLM endpoint: an LLM summary per video, next to the extractive ones.
    replies = {"model": "sum-stub", "routes": {MAP_MARKER: "[00:00] A person stands near a shelf."}}
    with stub_server(replies, tmp_path) as stub:
        llm_meta = _run(instance, {**res, "llm": LlmSettings(base_url=stub.base_url)})
        seen = stub.requests()
    assert llm_meta["summarizer"].value == "llm:sum-stub"
    llm_rows = _summaries(res).filter(pl.col("summarizer") == "llm:sum-stub")
    assert llm_rows.height == 3 and set(llm_rows["summary"]) == {"[00:00] A person stands near a shelf."}
    assert len(seen) == 3 and all(MAP_MARKER in r["messages"][0]["content"] for r in seen)
    assert "[00:21] event (object_handling suspected 0.80)" in next(
        r["messages"][1]["content"] for r in seen if "shop.mp4" in r["messages"][1]["content"]
    )

    # An endpoint that cannot be reached fails the step at once, naming LLM_BASE_URL.
    dead = LlmSettings(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_s=5)
    failed = _run(instance, {**res, "llm": dead}, ok=False)
    failures = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failures and "LLM_BASE_URL" in failures[0].event_specific_data.error.message

    # The caption model as the LLM needs its served application, so a Ray that outlives the steps: without
    # one the step fails at once, saying what to start, and starts no Ray of its own.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    failed = _run(instance, {**res, "llm": LlmSettings(base_url="captioner")}, ok=False)
    failures = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failures[0].event_specific_data.error.message
    assert "LLM_BASE_URL=captioner" in message and "video-assets ray up" in message and not ray.is_initialized()


def test_the_llm_resource_reads_llm_settings_from_the_environment(monkeypatch):
    from video_assets.definitions import build_resources

    for var in ("LLM_BASE_URL", "LLM_MODEL", "LLM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert build_resources()["llm"].process_config_and_initialize().client() is None  # unset: no LLM
    monkeypatch.setenv("LLM_BASE_URL", "http://vllm:8000/v1")
    monkeypatch.setenv("LLM_MODEL", "Qwen/Qwen2.5-7B-Instruct")
    monkeypatch.setenv("LLM_API_KEY", "s3cret-key")
    client = build_resources()["llm"].process_config_and_initialize().client()
    assert (client.base_url, client.model) == ("http://vllm:8000/v1", "Qwen/Qwen2.5-7B-Instruct")
    assert "s3cret" not in repr(client)
