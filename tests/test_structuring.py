"""Prose -> rows with the real tiny Qwen2.5-VL under xgrammar: valid rows, the retry, unparsed rows."""

import json

import pytest

from resources.tiny_qwen import build_tiny_qwen25_vl
from video_assets import usecase as uc_mod
from video_assets.structuring import (
    STATUSES,
    StructureRequest,
    TransformersStructurer,
    from_vllm_row,
    structure_captions,
    to_vllm_row,
    vllm_processor_config,
)

CAPTIONS = [
    {"status": "ok", "prose": "At 2 s a man picks up a red cup; at 5 s he puts it down.", "segment_start_s": 0.0, "segment_end_s": 10.0},
    {"status": "ok", "prose": "A woman walks across an empty office.", "segment_start_s": 0.0, "segment_end_s": 8.0},
    {"status": "ok", "prose": "Cars pass a railing with parked bicycles.", "segment_start_s": 10.0, "segment_end_s": 20.0},
    {"status": "error", "prose": "", "error": "decode failed: invalid data"},
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("structurers")
    return {p: TransformersStructurer(str(build_tiny_qwen25_vl(root / f"tiny-{p}", prefer=p)), device="cpu", batch_size=2)
            for p in (None, "none", "confirmed")}


@pytest.fixture(scope="module")
def uc():
    return uc_mod.load("object_handling")


def test_every_caption_gets_a_valid_row_or_an_unparsed_row(engines, uc):
    rows = structure_captions(engines[None], uc, CAPTIONS, max_new_tokens=1024, retry_max_new_tokens=16)
    assert len(rows) == len(CAPTIONS)
    assert {r["status"] for r in rows} <= set(STATUSES)
    assert rows[-1]["status"] == "no_caption" and "decode failed" in rows[-1]["error"]
    for r in rows[:-1]:
        assert r["status"] in ("parsed", "retried", "unparsed")
        assert r["raw_output"], "the first pass output is kept for audit"
        if r["status"] == "parsed":
            # Valid against the use case's own model, re-validated from the stored output.
            assert uc_mod.output_model(uc).model_validate_json(r["raw_output"]).verdict == r["verdict"]
        if r["status"] == "retried":
            assert r["verdict"] in uc.verdicts and r["confidence"] is None and r["attempts"] == 2
        if r["status"] == "unparsed":
            assert r["verdict"] is None and r["error"]


def test_a_pinned_model_answers_its_verdict(engines, uc):
    for prefer, conf in (("none", 0.0), ("confirmed", 1.0)):
        rows = structure_captions(engines[prefer], uc, CAPTIONS[:3], 1024, 8)
        assert [(r["status"], r["verdict"], r["confidence"], r["events"]) for r in rows] == [("parsed", prefer, conf, [])] * 3


def test_a_truncated_first_pass_is_retried_with_the_verdict_only(engines, uc):
    rows = structure_captions(engines["confirmed"], uc, CAPTIONS[:2], max_new_tokens=4, retry_max_new_tokens=16)
    for r in rows:
        assert r["status"] == "retried" and r["verdict"] == "confirmed" and r["attempts"] == 2
        assert r["error"].startswith("first pass: not JSON") and json.loads(r["retry_output"]) == "confirmed"
        assert r["raw_output"] and not r["raw_output"].endswith("}")


def test_what_the_retry_cannot_answer_is_unparsed_with_both_outputs(engines, uc):
    rows = structure_captions(engines[None], uc, CAPTIONS[:2], max_new_tokens=4, retry_max_new_tokens=1)
    for r in rows:
        assert r["status"] == "unparsed" and r["verdict"] is None
        assert r["raw_output"] and r["retry_output"] is not None
        assert "first pass:" in r["error"] and "retry:" in r["error"]


def test_decode_schema_is_finite(uc):
    s = uc_mod.decode_schema(uc)
    props = s["properties"]
    assert props["events"]["maxItems"] == uc.max_events
    assert props["confidence"] == {"type": "number", "minimum": 0, "maximum": 1}
    event = props["events"]["items"]["properties"]
    for name in ("actor", "action", "object"):
        assert event[name]["pattern"].endswith(f"{{1,{uc.max_text}}}$")
    assert event["start_s"]["maximum"] == uc.max_seconds
    assert s["additionalProperties"] is False


@pytest.mark.parametrize("text,why", [
    ('{"verdict": "none", "confidence": 0.4, "events": [], "rationale": "x"}', None),
    ('{"verdict": "maybe", "confidence": 0.4, "events": [], "rationale": ""}', "verdict"),
    ('{"verdict": "none", "confidence": 1.5, "events": [], "rationale": ""}', "confidence"),
    ('{"verdict": "none", "confidence": 0.5, "events": [{"start_s": 1, "end_s": 2, "actor": "a", "action": "b", "object": "c"}], "rationale": ""}', "verdict none with events"),
    ('{"verdict": "confirmed", "confidence": 0.5, "events": [{"start_s": 3, "end_s": 2, "actor": "a", "action": "b", "object": "c"}], "rationale": ""}', "before it starts"),
    ('{"verdict": "confirmed", "confidence": 0.5, "events": [], "rationale": "' + "x" * 200 + '"}', "rationale"),
    ('{"verdict": "confirm', "not JSON"),
])
def test_parse_validates_with_the_original_schema(uc, text, why):
    record, reason = uc_mod.parse(uc, text)
    if why is None:
        assert record is not None and reason is None
    else:
        assert record is None and why in reason


def test_parse_verdict():
    assert uc_mod.parse_verdict('"possible"') == ("possible", None)
    assert uc_mod.parse_verdict("none") == ("none", None)
    assert uc_mod.parse_verdict('"pos')[0] is None
    assert uc_mod.parse_verdict('"maybe"')[0] is None


def test_use_cases_are_folders(tmp_path):
    assert {"object_handling", "loss_prevention"} <= set(uc_mod.available())
    lp = uc_mod.load("loss_prevention")
    assert lp.alert_threshold == 0.8 and "merchandise" in lp.question and lp.golden_path.is_file()
    with pytest.raises(ValueError, match="unknown use case 'nope'"):
        uc_mod.parse_names("object_handling,nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "usecase.toml").write_text('question = "q"\n[verdicts]\nyes = "y"\nno = "n"\n')
    (bad / "prompt.txt").write_text("{caption}")
    with pytest.raises(ValueError, match="must define exactly"):
        uc_mod.load("bad", root=tmp_path)
    # A new use case is only files: a changed prompt is a new version.
    good = tmp_path / "shelf_audit"
    good.mkdir()
    (good / "usecase.toml").write_text('question = "Is a shelf emptied?"\n[verdicts]\n' + "".join(f'{v} = "{v}"\n' for v in uc_mod.VERDICTS))
    (good / "prompt.txt").write_text("Q: {question} {verdicts}\n{caption} {start_s}-{end_s}")
    first = uc_mod.load("shelf_audit", root=tmp_path).version
    uc_mod.load.cache_clear()
    (good / "prompt.txt").write_text("Q2: {question} {verdicts}\n{caption} {start_s}-{end_s}")
    assert uc_mod.load("shelf_audit", root=tmp_path).version != first
    uc_mod.load.cache_clear()


def test_vllm_rows_carry_the_schema_as_structured_outputs(uc):
    req = StructureRequest("7", uc_mod.messages(uc, "a cup", 0, 5), uc_mod.decode_schema(uc), 300)
    row = to_vllm_row(req)
    assert row["sampling_params"]["max_tokens"] == 300 and row["sampling_params"]["temperature"] == 0.0
    assert json.loads(row["sampling_params"]["structured_outputs"]["json"]) == uc_mod.decode_schema(uc)
    ok = from_vllm_row({"structure_request_id": "7", "generated_text": '"none"', "num_generated_tokens": 3})
    assert (ok.request_id, ok.text, ok.output_tokens, ok.error) == ("7", '"none"', 3, None)
    assert from_vllm_row({"structure_request_id": "7", "__inference_error__": "OOM"}).error == "OOM"
    cfg = vllm_processor_config("Qwen/Qwen2.5-VL-7B-Instruct", {"tensor_parallel_size": 2})
    assert cfg.engine_kwargs["structured_outputs_config"] == {"backend": "xgrammar"}
    assert cfg.engine_kwargs["tensor_parallel_size"] == 2


def test_a_separate_text_model_structures_too(tmp_path, uc):
    from resources.tiny_qwen import build_tiny_text_model

    text_model = build_tiny_text_model(build_tiny_qwen25_vl(tmp_path / "vlm", prefer="confirmed"), tmp_path / "text")
    engine = TransformersStructurer(str(text_model), device="cpu")
    assert type(engine.model).__name__ == "Qwen2ForCausalLM"
    rows = structure_captions(engine, uc, CAPTIONS, 1024, 16)
    # The same weights as the pinned VLM: the same answers, through the causal-LM path.
    assert [r["status"] for r in rows] == ["parsed"] * 3 + ["no_caption"]
    assert {r["verdict"] for r in rows[:3]} == {"confirmed"}
