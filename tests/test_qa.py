"""The question-answering agent and the summaries' pure logic, with the real openai SDK against an
OpenAI-compatible stub server in a subprocess (no real LLM runs on a CPU test machine).

The searcher is the real one (``LanceSearcher``) over an index of the golden set's reference captions
and labelled events (``tests/fixtures/golden_index.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from resources.archive import TEXT, assemble_packaged
from tests.fixtures.golden_index import build_golden_index
from tests.fixtures.openai_stub import stub_server
from tests.fixtures.processes import free_port
from video_assets.core.embeddings.text import TextEncoder
from video_assets.core.qa import summaries as summ
from video_assets.core.qa.agent import ANSWER_MARKER, LLM_FAILED, NO_LLM, PLAN_MARKER, ask
from video_assets.core.qa.llm import LlmClient, LlmUnavailable
from video_assets.core.search.api import EVENT
from video_assets.core.search.index import LanceSearcher

GOLDEN = Path(__file__).resolve().parents[1] / "video_assets" / "usecases" / "object_handling" / "golden.jsonl"
_MMSS = re.compile(r"(\d{2}):(\d{2})")


@pytest.fixture(scope="module")
def searcher(tmp_path_factory):
    """The real index (LanceDB + MiniLM) over the golden set's captions, sentence by sentence, and events."""
    encoder = TextEncoder(assemble_packaged(TEXT, tmp_path_factory.mktemp("models") / "minilm"))
    uri = str(tmp_path_factory.mktemp("index") / "search_index")
    build_golden_index(uri, encoder)
    return LanceSearcher(uri, encoder)


def _names(answer) -> set[str]:
    return {c["uri"].rsplit("/", 1)[-1] for c in answer.citations}


# -- without an LLM ---------------------------------------------------------------------------------
def test_fallback_answers_with_citations_of_the_right_clip(searcher):
    answer = ask("Who throws a small orange ball for the dog?", searcher, None)
    assert answer.mode == "fallback"
    assert answer.text.startswith(NO_LLM)
    assert [s["tool"] for s in answer.plan] == ["search_text", "transcripts_at_hits"]
    assert answer.citations and answer.citations[0]["uri"].endswith("sam2_01_dog.mp4")
    first = answer.citations[0]
    assert f"[{first['n']}] {first['citation']}" in answer.text and "orange ball" in answer.text
    assert any("LLM_BASE_URL" in n for n in answer.notes)


def test_fallback_plan_for_a_time_in_a_clip_is_a_window_search(searcher):
    answer = ask("What is seen at 00:09 in sam2_01_dog.mp4?", searcher, None)
    assert answer.plan == [
        {"tool": "search_window", "args": {"video": "sam2_01_dog.mp4", "start_s": 0.0, "end_s": 19.0}, "hits": 4}
    ]
    assert _names(answer) == {"sam2_01_dog.mp4"} and "leash" in answer.text


def test_fallback_plan_for_verdicts_is_event_filters(searcher):
    answer = ask("Which confirmed events happen after 10 s?", searcher, None)
    assert [(s["tool"], s["args"]) for s in answer.plan] == [
        ("events", {"k": 20, "after_s": 10.0, "verdict": "confirmed"})
    ]
    assert answer.citations and all(c["source"] == EVENT and c["start_s"] >= 10 for c in answer.citations)
    assert _names(answer) == {"bottle-detection.mp4"}  # the juggling clip's event starts at 0 s


def test_fallback_plan_for_what_happens_in_a_clip_reads_the_video(searcher):
    answer = ask("What happens in sam2_04_coffee.mp4?", searcher, None)
    assert [s["tool"] for s in answer.plan] == ["video"] and answer.plan[0]["hits"] > 0
    assert _names(answer) == {"sam2_04_coffee.mp4"}
    assert "kettle" in answer.text and answer.text.startswith(NO_LLM)


def test_ask_router_answers_and_rejects_an_empty_question(searcher):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from video_assets.service.ask import router

    app = FastAPI()
    app.state.searcher, app.state.llm = searcher, None
    app.include_router(router)
    client = TestClient(app)
    assert client.post("/api/ask", json={"question": "   "}).status_code == 422
    assert client.post("/api/ask", json={}).status_code == 422
    got = client.post("/api/ask", json={"question": "Who pours coffee into a blue mug?", "k": 4})
    assert got.status_code == 200
    body = got.json()
    assert body["mode"] == "fallback" and body["citations"][0]["uri"].endswith("sam2_04_coffee.mp4")
    assert set(body) == {"text", "citations", "plan", "mode", "notes"}
    assert body["citations"][0]["thumbnail_url"].startswith("/api/videos/")


# -- through an OpenAI-compatible endpoint ---------------------------------------------------------------
STUB_PLAN = {
    "steps": [
        {"tool": "search_captions", "args": {"query": "kettle coffee blue mug", "k": 3}},
        {"tool": "events", "args": {"verdict": "confirmed", "k": 2}},
    ]
}
STUB_ANSWER = "A person pours coffee from a metal kettle into a blue mug [1]. It also juggles [99]."


def test_llm_plan_is_executed_and_citations_resolved(searcher, tmp_path):
    replies = {"model": "qa-stub", "routes": {PLAN_MARKER: STUB_PLAN, ANSWER_MARKER: STUB_ANSWER}}
    with stub_server(replies, tmp_path) as stub:
        answer = ask("Who pours coffee?", searcher, LlmClient(stub.base_url, "qa-stub"))
        seen = stub.requests()
    assert answer.mode == "llm"
    assert [(s["tool"], s["args"]) for s in answer.plan] == [
        ("search_captions", {"query": "kettle coffee blue mug", "k": 3}),
        ("events", {"verdict": "confirmed", "k": 2}),
    ]
    planning, answering = seen
    assert (
        PLAN_MARKER in planning["messages"][0]["content"] and "Who pours coffee?" in planning["messages"][1]["content"]
    )
    assert planning["response_format"]["type"] == "json_schema" and planning["model"] == "qa-stub"
    assert (
        ANSWER_MARKER in answering["messages"][0]["content"]
        and "[1] sam2_04_coffee.mp4" in answering["messages"][1]["content"]
    )
    assert answer.text == "A person pours coffee from a metal kettle into a blue mug [1]. It also juggles."
    assert [c["n"] for c in answer.citations] == [1] and answer.citations[0]["uri"].endswith("sam2_04_coffee.mp4")
    assert answer.citations[0]["citation"].startswith("sam2_04_coffee.mp4 ")
    assert any("[99]" in n for n in answer.notes)


def test_an_invalid_plan_is_retried_once_then_the_deterministic_planner_runs(searcher, tmp_path):
    bad = ["this is not a plan", {"steps": [{"tool": "delete_everything", "args": {}}]}]
    replies = {"routes": {PLAN_MARKER: bad, ANSWER_MARKER: "Coffee is poured into a blue mug [1]."}}
    with stub_server(replies, tmp_path) as stub:
        answer = ask("Who pours coffee into a mug?", searcher, LlmClient(stub.base_url, "m"))
        seen = stub.requests()
    plans = [r for r in seen if PLAN_MARKER in r["messages"][0]["content"]]
    assert len(plans) == 2 and "invalid" in plans[1]["messages"][-1]["content"]
    assert [s["tool"] for s in answer.plan] == ["search_text", "transcripts_at_hits"]  # the deterministic plan
    assert any("invalid twice" in n for n in answer.notes)
    assert answer.mode == "llm" and answer.citations[0]["uri"].endswith("sam2_04_coffee.mp4")


def test_a_server_without_response_format_gets_the_plan_in_words(searcher, tmp_path):
    prose = f"Sure! Here is the plan:\n```json\n{json.dumps(STUB_PLAN)}\n```\nGood luck."
    replies = {"reject_response_format": True, "routes": {PLAN_MARKER: prose, ANSWER_MARKER: "Poured [1]."}}
    with stub_server(replies, tmp_path) as stub:
        answer = ask("Who pours coffee?", searcher, LlmClient(stub.base_url))  # model from /v1/models
        seen = stub.requests()
    assert [s["tool"] for s in answer.plan] == ["search_captions", "events"]
    assert "response_format" in seen[0] and "response_format" not in seen[1]
    assert "JSON schema" in seen[1]["messages"][-1]["content"] and seen[1]["model"] == "stub-model"


def test_an_unreachable_endpoint_falls_back_fast_naming_the_setting(searcher):
    port = free_port()  # nothing listens there
    answer = ask("Who pours coffee?", searcher, LlmClient(f"http://127.0.0.1:{port}/v1", "m", timeout_s=5))
    assert answer.mode == "fallback" and answer.text.startswith(LLM_FAILED)
    # Fast, shown by the path taken rather than a clock: the refusal itself ends the planning (a connection
    # error, not the 5 s timeout waited out), and the failed endpoint is not asked again for the answer.
    [note] = [n for n in answer.notes if "language model" in n]
    assert note.startswith("language model unavailable, deterministic plan used")
    assert "APIConnectionError" in note and "Timeout" not in note and "LLM_BASE_URL" in note, note
    assert answer.citations[0]["uri"].endswith("sam2_04_coffee.mp4")
    with pytest.raises(LlmUnavailable, match="LLM_BASE_URL"):
        LlmClient(f"http://127.0.0.1:{port}/v1", "m", timeout_s=5).check()


# -- summaries ------------------------------------------------------------------------------------
def test_timeline_merges_captions_speech_and_events_in_time_order():
    caps = [
        {
            "segment": 1,
            "segment_start_s": 10.0,
            "segment_end_s": 20.0,
            "prose": "A hand  lifts a bottle.",
            "status": "ok",
        },
        {
            "segment": 0,
            "segment_start_s": 0.0,
            "segment_end_s": 10.0,
            "prose": "Three bottles on a shelf.",
            "status": "ok",
        },
        {"segment": 2, "segment_start_s": 20.0, "segment_end_s": 30.0, "prose": None, "status": "error"},
    ]
    said = [{"segment": 0, "start_s": 12.5, "end_s": 14.0, "text": " put it back ", "status": "speech"}]
    events = [
        {
            "use_case": "object_handling",
            "status": "parsed",
            "verdict": "confirmed",
            "confidence": 0.9,
            "segment_start_s": 10.0,
            "events": [{"start_s": 11.0, "end_s": 13.0, "actor": "hand", "action": "pick up", "object": "bottle"}],
        },
        {"use_case": "object_handling", "status": "unparsed", "verdict": None, "events": []},
    ]
    lines = summ.timeline(caps, said, events)
    assert [x.render() for x in lines] == [
        "[00:00] Three bottles on a shelf.",
        "[00:10] A hand lifts a bottle.",
        "[00:11] event (object_handling confirmed 0.90): hand pick up bottle",
        "[00:12] said: “put it back”",
    ]


def _long_timeline(n: int = 120) -> list[summ.Line]:
    caps = [
        {
            "segment": i,
            "segment_start_s": 5.0 * i,
            "segment_end_s": 5.0 * i + 5,
            "prose": f"Scene {i}: people walk past the counter.",
        }
        for i in range(n)
    ]
    events = [
        {
            "use_case": "object_handling",
            "status": "parsed",
            "verdict": "suspected",
            "confidence": 0.7,
            "events": [{"start_s": 301.0, "end_s": 303.0, "actor": "man", "action": "pocket", "object": "phone"}],
        }
    ]
    return summ.timeline(caps, [], events)


def test_extractive_summary_keeps_timestamps_and_every_event_line():
    lines = _long_timeline()
    text = summ.extractive_summary(lines, max_lines=6).splitlines()
    assert len(text) == 6 and all(re.match(r"\[\d{2}:\d{2}\] ", t) for t in text)
    assert text[0].startswith("[00:00] Scene 0:") and text[-1].startswith("[09:55] Scene 119:")  # spread over the video
    assert "[05:01] event (object_handling suspected 0.70): man pocket phone" in text
    assert summ.extractive_summary([], 5).startswith("Nothing")


def test_llm_summary_is_map_reduce_over_chunks(tmp_path):
    lines = _long_timeline()
    parts = summ.chunks(lines, 1500)
    assert len(parts) > 2 and [x for p in parts for x in p] == lines
    assert all(sum(len(x.render(summ.LINE_CHARS)) + 1 for x in p) <= 1500 for p in parts)
    replies = {
        "model": "sum-stub",
        "routes": {
            summ.MAP_MARKER: "[00:00] part {n}: people walk past.",
            summ.REDUCE_MARKER: "[00:00] People walk past; [05:01] a man pockets a phone.",
        },
    }
    with stub_server(replies, tmp_path) as stub:
        text, n = summ.llm_summary(lines, LlmClient(stub.base_url, "sum-stub"), max_chars=1500)
        seen = stub.requests()
    assert n == len(parts) and text.startswith("[00:00] People walk past")
    maps = [r for r in seen if summ.MAP_MARKER in r["messages"][0]["content"]]
    reduces = [r for r in seen if summ.REDUCE_MARKER in r["messages"][0]["content"]]
    assert len(maps) == len(parts) and len(reduces) == 1 and len(seen) == len(parts) + 1
    assert "[05:01] event" in "".join(r["messages"][1]["content"] for r in maps)
    assert f"Part {len(parts)}: [00:00] part {len(parts)}:" in reduces[0]["messages"][1]["content"]
