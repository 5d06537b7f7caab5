"""Prose -> rows with the real tiny Qwen2.5-VL under xgrammar: valid rows, the retry, unparsed rows."""

import contextlib
import json
import re

import pytest
from pydantic import ValidationError

from tests.fixtures.tiny_models import build_tiny_vlm
from video_assets.core.inference.vllm import VllmSettings, processor_config
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.engines import TransformersStructurer, from_vllm_row, to_vllm_row
from video_assets.core.structuring.policy import StructureRequest, structure_captions
from video_assets.core.vocabulary import FLAGGED
from video_assets.core.vocabulary import STRUCTURE_STATUSES as STATUSES

CAPTIONS = [
    {
        "status": "ok",
        "prose": "At 2 s a man picks up a red cup; at 5 s he puts it down.",
        "segment_start_s": 0.0,
        "segment_end_s": 10.0,
    },
    {"status": "ok", "prose": "A woman walks across an empty office.", "segment_start_s": 0.0, "segment_end_s": 8.0},
    {
        "status": "ok",
        "prose": "Cars pass a railing with parked bicycles.",
        "segment_start_s": 10.0,
        "segment_end_s": 20.0,
    },
    {"status": "error", "prose": "", "error": "decode failed: invalid data"},
]


@pytest.fixture(scope="module")
def pinned_models(tmp_path_factory):
    """Tiny VLMs that always answer one verdict (the plain tiny model is the session's ``tiny_model``)."""
    root = tmp_path_factory.mktemp("structurers")
    return {p: build_tiny_vlm(root / f"tiny-{p}", prefer=p) for p in ("none", "confirmed")}


@pytest.fixture(scope="module")
def engines(tiny_model, pinned_models):
    folders = {None: tiny_model, **pinned_models}
    return {p: TransformersStructurer(str(folder), device="cpu", batch_size=2) for p, folder in folders.items()}


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
        assert [(r["status"], r["verdict"], r["confidence"], r["events"]) for r in rows] == [
            ("parsed", prefer, conf, [])
        ] * 3


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


BOUNDED_PATTERN = re.compile(r"^\^(\[[^\]]+\])\{(\d+),(\d+)\}\$$")  # ^[chars]{lo,hi}$


def schema_nodes(node, path="$"):
    """Every sub-schema of a JSON schema, with where it sits."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from schema_nodes(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from schema_nodes(value, f"{path}[{i}]")


def largest_instance(node):
    """The biggest value a finite schema admits: longest strings, most items, numbers at their maximum."""
    kind = node.get("type")
    if "enum" in node:
        return node["enum"][0]
    if kind == "string":
        chars, _, hi = BOUNDED_PATTERN.match(node["pattern"]).groups()
        return "".join(c for c in "abcdefghijklmnopqrstuvwxyz" * 40 if re.fullmatch(chars, c))[: int(hi)]
    if kind == "number":
        return node["maximum"]
    if kind == "array":
        return [largest_instance(node["items"])] * node["maxItems"]
    if kind == "object":
        return {k: largest_instance(v) for k, v in node["properties"].items()}
    raise AssertionError(f"unexpected schema node {node}")


def test_decode_schema_is_finite(uc):
    s = uc_mod.decode_schema(uc)
    assert not any(k == "$ref" for _, node in schema_nodes(s) for k in node), "refs are inlined for the grammar"
    for where, node in schema_nodes(s):
        kind = node.get("type")
        if kind == "string" and "enum" not in node:
            assert BOUNDED_PATTERN.match(node.get("pattern", "")), f"{where}: string without a bounded pattern"
        if kind == "number":
            assert {"minimum", "maximum"} <= node.keys(), f"{where}: unbounded number"
        if kind == "array":
            assert "maxItems" in node, f"{where}: unbounded array"
        if kind == "object":
            assert node.get("additionalProperties") is False and set(node["required"]) == set(node["properties"]), where

    # The largest grammar-valid answer is one the use case accepts (so no decode is thrown away)...
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False)  # as the engine compiles it
    model = uc_mod.output_model(uc)
    biggest = largest_instance(s)
    biggest["verdict"] = next(v for v in uc.verdicts if v in FLAGGED)  # a verdict that may carry events
    assert xgr.testing._is_grammar_accept_string(grammar, json.dumps(biggest))
    assert model.model_validate(biggest).events and len(json.dumps(biggest)) <= uc_mod.max_output_chars(uc)

    # ...and one step past any bound is outside both the grammar and the use case's model.
    too_long_text = {**biggest, "events": [{**biggest["events"][0], "actor": biggest["events"][0]["actor"] + "a"}]}
    too_late = {**biggest, "events": [{**biggest["events"][0], "end_s": biggest["events"][0]["end_s"] + 1}]}
    too_many = {**biggest, "events": biggest["events"] + biggest["events"][:1]}
    too_sure = {**biggest, "confidence": 1.5}
    for bad in (too_long_text, too_late, too_many, too_sure, {**biggest, "extra": 1}):
        assert not xgr.testing._is_grammar_accept_string(grammar, json.dumps(bad))
        with pytest.raises(ValidationError):
            model.model_validate(bad)


@pytest.mark.parametrize(
    "text,why",
    [
        ('{"verdict": "none", "confidence": 0.4, "events": [], "rationale": "x"}', None),
        ('{"verdict": "maybe", "confidence": 0.4, "events": [], "rationale": ""}', "verdict"),
        ('{"verdict": "none", "confidence": 1.5, "events": [], "rationale": ""}', "confidence"),
        (
            '{"verdict": "none", "confidence": 0.5, "events": [{"start_s": 1, "end_s": 2, "actor": "a", "action": "b", "object": "c"}], "rationale": ""}',
            "verdict none with events",
        ),
        (
            '{"verdict": "confirmed", "confidence": 0.5, "events": [{"start_s": 3, "end_s": 2, "actor": "a", "action": "b", "object": "c"}], "rationale": ""}',
            "before it starts",
        ),
        ('{"verdict": "confirmed", "confidence": 0.5, "events": [], "rationale": "' + "x" * 200 + '"}', "rationale"),
        ('{"verdict": "confirm', "not JSON"),
    ],
)
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
    with pytest.raises(ValueError, match="verdicts.confirmed: Field required.*verdicts.yes: Extra inputs"):
        uc_mod.load("bad", root=tmp_path)
    # A new use case is only files: a changed prompt is a new version.
    good = tmp_path / "shelf_audit"
    good.mkdir()
    (good / "usecase.toml").write_text(
        'question = "Is a shelf emptied?"\n[verdicts]\n' + "".join(f'{v} = "{v}"\n' for v in uc_mod.VERDICTS)
    )
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
    cfg = processor_config(
        VllmSettings(model_source="Qwen/Qwen2.5-VL-7B-Instruct", tensor_parallel_size=2), multimodal=False
    )
    assert cfg.engine_kwargs["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert cfg.engine_kwargs["tensor_parallel_size"] == 2
    assert cfg.engine_kwargs["limit_mm_per_prompt"] == {"image": 0, "video": 0}


def test_a_separate_text_model_structures_too(tmp_path, uc, pinned_models):
    from tests.fixtures.tiny_models import build_tiny_text_model

    text_model = build_tiny_text_model(pinned_models["confirmed"], tmp_path / "text")
    engine = TransformersStructurer(str(text_model), device="cpu")
    assert type(engine.model).__name__ == "Qwen2ForCausalLM"
    rows = structure_captions(engine, uc, CAPTIONS, 1024, 16)
    # The same weights as the pinned VLM: the same answers, through the causal-LM path.
    assert [r["status"] for r in rows] == ["parsed"] * 3 + ["no_caption"]
    assert {r["verdict"] for r in rows[:3]} == {"confirmed"}


def _timeless(rows):
    return [{k: v for k, v in r.items() if k != "latency_s"} for r in rows]


@contextlib.contextmanager
def counted(engine):
    """The sizes of ``engine``'s generate calls, as they are made (the real engine answers); afterwards the
    engine is as it was (no speculative retry)."""
    calls = []
    real = engine.generate

    def counting(requests):
        calls.append(len(requests))
        return real(requests)

    engine.generate = counting
    try:
        yield calls
    finally:
        engine.speculative_retry = False
        del engine.generate


def test_speculative_retry_gives_the_same_rows_in_one_call(engines, uc):
    """An engine with one lifetime per call (vLLM through Ray Data) gets the retry requests with the
    first pass; the rows are the same as with a second call."""
    engine = engines["none"]
    with counted(engine) as calls:
        capped = _timeless(structure_captions(engine, uc, CAPTIONS, 6, 8))  # 6 tokens: every first pass fails
        engine.speculative_retry = True
        assert _timeless(structure_captions(engine, uc, CAPTIONS, 6, 8)) == capped
    ok = sum(c["status"] == "ok" for c in CAPTIONS)
    assert calls == [ok, ok, 2 * ok]  # two calls, then one with first pass + retries
    assert {r["status"] for r in capped} <= {"retried", "unparsed", "no_caption"}


def test_every_use_case_of_a_batch_shares_one_call_of_a_speculative_engine(engines, uc):
    """Issue 39, item 8: vLLM in the job is one engine lifetime per call, so a batch's use cases go in one call
    (it was one engine start per use case); the rows are those each use case gets on its own."""
    from resources.structurer import StructurerSettings
    from video_assets.defs.structured import structure_use_cases

    settings = StructurerSettings(max_new_tokens=6, retry_max_new_tokens=8)  # every first pass fails: retries used
    rows = [{**c, "video_id": f"v{i}", "segment": 0, "batch_key": "b", "uri": f"/v/{i}.mp4", "model_version": "1",
             "prompt_version": 1} for i, c in enumerate(CAPTIONS)]  # fmt: skip
    work = [(uc, rows), (uc_mod.load("loss_prevention"), rows[:2])]
    engine = engines["none"]

    def stable(out):
        return [{k: v for k, v in r.items() if k not in ("latency_s", "structured_at")} for r in out]

    with counted(engine) as calls:
        each = stable(structure_use_cases(engine, settings, work, "s"))  # a loaded engine: a call per use case
        assert len(calls) == 2 * 2  # first pass, then the retries, per use case
        calls.clear()
        engine.speculative_retry = True
        together = stable(structure_use_cases(engine, settings, work, "s"))
    ok = sum(c["status"] == "ok" for c in CAPTIONS)
    assert calls == [2 * ok + 2 * 2]  # one call: both use cases' first passes and retries
    assert together == each
    assert [r["use_case"] for r in together] == ["object_handling"] * 4 + ["loss_prevention"] * 2
    assert {r["status"] for r in together} <= {"retried", "unparsed", "no_caption"}


class _Pinned:
    """A model pinned to one answer, whatever it is asked (what an engine that ignores the schema's
    bounds, or a model fine-tuned on other clips, can return); the policy under test is the real one."""

    speculative_retry = False

    def __init__(self, text: str):
        self.text = text

    def generate(self, requests):
        from video_assets.core.structuring.policy import StructureResponse

        return [StructureResponse(r.request_id, self.text, 10, 0.01) for r in requests]


def _answer(*events: tuple[float, float]) -> str:
    return json.dumps(
        {
            "verdict": "confirmed",
            "confidence": 0.9,
            "events": [
                {"start_s": a, "end_s": b, "actor": "man", "action": "picks up", "object": "cup"} for a, b in events
            ],
            "rationale": "he takes it",
        }
    )


def test_an_event_outside_its_clip_is_dropped_and_the_row_says_why(uc):
    chaplin = {"status": "ok", "prose": "A man picks up a cup.", "segment_start_s": 0.0, "segment_end_s": 9.6}
    [row] = structure_captions(_Pinned(_answer((2.0, 3.0), (223.0, 224.0))), uc, [chaplin], 1024, 16)
    assert row["status"] == "parsed" and row["verdict"] == "confirmed"
    assert [(e["start_s"], e["end_s"]) for e in row["events"]] == [(2.0, 3.0)]
    assert row["events_outside"] == 1
    assert row["error"] == "dropped 1 event(s) outside the clip (0-9.6 s): 223-224 s"
    # A later clip of the same video: its window is its own segment, not the video's start.
    later = {**chaplin, "segment_start_s": 30.0, "segment_end_s": 40.0}
    [row] = structure_captions(_Pinned(_answer((2.0, 3.0), (31.0, 32.5))), uc, [later], 1024, 16)
    assert [(e["start_s"], e["end_s"]) for e in row["events"]] == [(31.0, 32.5)] and row["events_outside"] == 1
    [row] = structure_captions(_Pinned(_answer((1.0, 2.0))), uc, [chaplin], 1024, 16)
    assert row["events_outside"] == 0 and row["error"] is None


def test_the_decoder_cannot_place_an_event_outside_the_clip(uc):
    """The schema each request is decoded under bounds event times by the caption's own segment: the
    grammar xgrammar compiles from it (what the transformers engine and vLLM use) refuses 223 s on a
    9.6 s clip and accepts a time inside it."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = uc_mod.decode_schema(uc, 0.0, 9.6)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert accepts(grammar, _answer((2.0, 3.0))) and accepts(grammar, _answer((9.6, 9.6)))
    assert not accepts(grammar, _answer((223.0, 224.0))) and not accepts(grammar, _answer((2.0, 9.8)))
    later = xgr.Grammar.from_json_schema(json.dumps(uc_mod.decode_schema(uc, 30.0, 40.0)), any_whitespace=False)
    assert accepts(later, _answer((31.0, 32.5))) and not accepts(later, _answer((2.0, 3.0)))
    # Unknown end (a stream without duration): the use case's own range.
    assert uc_mod.window(uc, None, None) == (0.0, float(uc.max_seconds))
