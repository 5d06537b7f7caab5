"""Answer a question about the archive: plan searches (an LLM's JSON plan, or deterministic rules), run
them through the ``Searcher``, number the hits as evidence, and answer citing them as ``[n]``: in words by
the LLM (citations that name no evidence are dropped), or extractively (the most relevant passages,
said to be so) when no LLM is configured or it fails."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from video_assets.core.qa.llm import LlmClient
from video_assets.core.qa.summaries import clock
from video_assets.core.search.api import CAPTION, EVENT, FRAME, SUMMARY, TRANSCRIPT, Hit, Searcher
from video_assets.core.validation import reasons
from video_assets.core.vocabulary import VERDICTS

PLAN_MARKER = "[video-assets:plan]"
ANSWER_MARKER = "[video-assets:answer]"
NO_LLM = "No language model is configured; the most relevant passages are:"
LLM_FAILED = "The language model could not be used (see notes); the most relevant passages are:"
WINDOW_PAD_S = 10.0  # a time in a question is searched within ± this
HIT_PAD_S = 5.0  # transcripts around a hit: its range ± this
MAX_EVIDENCE = 24
EXTRACT_PASSAGES = 5
_VIDEO_FILE = re.compile(r"[\w][\w\-.]*\.(?:mp4|mkv|avi|mov|webm|mpg|mpeg|m4v|ts|wmv|flv)\b", re.I)
_SHA = re.compile(r"\b[0-9a-f]{64}\b")
_STOP = set(
    "a an and are as at be by did do does for from had has have how i in is it its me of on or show tell that the "
    "their them then there these this those to was were what when where which who why with you video videos clip "
    "clips happen happens happened any all".split()
)


# -- plans -------------------------------------------------------------------------------------------
class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SearchArgs(_Args):
    query: str = Field(min_length=1)
    k: int = Field(default=8, ge=1, le=50)


class WindowArgs(_Args):
    video: str = Field(min_length=1, description="video_id or file name")
    start_s: float = Field(ge=0)
    end_s: float = Field(ge=0)


class FramesArgs(_Args):
    video: str = Field(min_length=1)
    t: float = Field(ge=0)
    k: int = Field(default=8, ge=1, le=50)


class AroundHitsArgs(_Args):
    top: int = Field(default=3, ge=1, le=10, description="windows around the top hits found so far")
    pad_s: float = Field(default=HIT_PAD_S, ge=0, le=120)


class VideoArgs(_Args):
    video: str = Field(min_length=1)


class EventArgs(_Args):
    use_case: str | None = None
    verdict: Literal[VERDICTS] | None = None  # type: ignore[valid-type]
    min_confidence: float | None = Field(default=None, ge=0, le=1)
    after_s: float | None = Field(default=None, ge=0)
    before_s: float | None = Field(default=None, ge=0)
    k: int = Field(default=20, ge=1, le=200)


TOOLS: dict[str, tuple[type[_Args], str]] = {
    "search_transcripts": (SearchArgs, "what was said: hybrid lexical + semantic search of speech segments"),
    "search_captions": (SearchArgs, "what was seen: hybrid search of the captions"),
    "search_text": (SearchArgs, "transcripts and captions together"),
    "similar_frames": (FramesArgs, "frames that look like the frame of a video at time t"),
    "search_window": (WindowArgs, "everything said and seen in a video between start_s and end_s"),
    "transcripts_at_hits": (AroundHitsArgs, "what was said around the top hits of the previous steps"),
    "video": (VideoArgs, "every row of one video (captions, speech, events, summary): 'what happens in X'"),
    "events": (EventArgs, "structured events by use case, verdict, confidence and time"),
}


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool: Literal[tuple(TOOLS)]  # type: ignore[valid-type]
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid_args(self) -> Step:
        self.args = TOOLS[self.tool][0].model_validate(self.args).model_dump(exclude_none=True)
        return self


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: list[Step] = Field(min_length=1, max_length=6)


PLAN_SCHEMA = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "minItems": 1,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {"tool": {"type": "string", "enum": list(TOOLS)}, "args": {"type": "object"}},
                "required": ["tool", "args"],
            },
        }
    },
    "required": ["steps"],
}


# -- the answer --------------------------------------------------------------------------------------
@dataclass
class Answer:
    text: str
    citations: list[dict]  # cited hits (Hit.to_dict() + "n", the number the text cites)
    plan: list[dict]  # steps run: tool, args, hits (and error when one failed)
    mode: str  # "llm" | "fallback"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "citations": self.citations,
            "plan": self.plan,
            "mode": self.mode,
            "notes": self.notes,
        }


def ask(question: str, searcher: Searcher, llm: LlmClient | None, k: int = 8) -> Answer:
    """Plan, search, answer with citations (see the module's docstring)."""
    question = question.strip()
    if not question:
        raise ValueError("empty question")
    notes: list[str] = []
    steps: list[dict] | None = None
    failed = False
    if llm is None:
        notes.append("no language model configured (LLM_BASE_URL unset): deterministic plan, extractive answer")
    else:
        try:
            steps = _llm_plan(question, llm, k, notes)
        except Exception as exc:  # unreachable, HTTP errors: answer without it
            notes.append(f"language model unavailable, deterministic plan used: {exc}")
            llm, failed = None, True
    if steps is None:
        steps = deterministic_plan(question, k)
    run, evidence = execute(steps, searcher, k)
    if not evidence and any(s["tool"] != "search_text" for s in steps):
        more, evidence = execute([{"tool": "search_text", "args": {"query": question, "k": k}}], searcher, k)
        run += more
        notes.append("the plan found nothing; searched the question's words instead")
    mode = "fallback"
    if llm is not None and evidence:
        try:
            text, cited, dropped = _llm_answer(question, evidence, llm)
            if dropped:
                notes.append(f"dropped citations that name no evidence: {', '.join(f'[{n}]' for n in dropped)}")
            mode = "llm"
        except Exception as exc:
            notes.append(f"language model failed while answering, extractive answer instead: {exc}")
            text, cited = extractive_answer(question, evidence, run, LLM_FAILED)
    else:
        lead = LLM_FAILED if failed else NO_LLM if llm is None else "Nothing in the index matched the question."
        text, cited = extractive_answer(question, evidence, run, lead)
    citations = [{**evidence[n - 1].to_dict(), "n": n} for n in cited]
    return Answer(text=text, citations=citations, plan=run, mode=mode, notes=notes)


# -- planning ----------------------------------------------------------------------------------------
def _llm_plan(question: str, llm: LlmClient, k: int, notes: list[str]) -> list[dict] | None:
    tools = "\n".join(f"- {name}({', '.join(m.model_fields)}): {what}" for name, (m, what) in TOOLS.items())
    messages = [
        {
            "role": "system",
            "content": f"{PLAN_MARKER} You plan searches over a video archive to answer a question. Tools:\n"
            f"{tools}\nA video is named by its file name (e.g. clip.mp4) or video_id; times are seconds. "
            'Reply with JSON only: {"steps": [{"tool": ..., "args": {...}}, ...]}, 1 to 6 steps.',
        },
        {"role": "user", "content": f"Question: {question}\nReturn at most {k} hits per search."},
    ]
    for attempt in (1, 2):
        raw = llm.chat(messages, json_schema=PLAN_SCHEMA)
        try:
            plan = Plan.model_validate_json(raw)
            return [s.model_dump() for s in plan.steps]
        except ValidationError as exc:
            error = reasons(exc, limit=5)
            if attempt == 2:
                notes.append(f"the language model's plan was invalid twice ({error}): deterministic plan used")
                return None
            messages += [
                {"role": "assistant", "content": raw},
                {"role": "user", "content": f"That plan is invalid: {error}. Reply with a corrected JSON plan."},
            ]
    return None


_TIME = re.compile(
    r"\b(?:(\d{1,2}):)?(\d{1,2}):(\d{2}(?:\.\d+)?)\b|\b(\d+(?:\.\d+)?)\s*(?:s|sec|secs|seconds?)\b", re.I
)


def _times(text: str) -> list[tuple[float, int, int]]:
    out = []
    for m in _TIME.finditer(text):
        if m.group(4) is not None:
            t = float(m.group(4))
        else:
            t = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        out.append((t, m.start(), m.end()))
    return out


def _video_refs(question: str) -> list[str]:
    return list(dict.fromkeys(_SHA.findall(question) + _VIDEO_FILE.findall(question)))


def deterministic_plan(question: str, k: int = 8) -> list[dict]:
    """The rule-based plan: a time + a video → the window around it; "what happens in <video>" → the
    video's rows; verdict words, confidence or "after/before N s" → event filters; otherwise hybrid
    text search over transcripts and captions, then what was said around the top hits."""
    q = question.lower()
    videos = _video_refs(question)
    times = _times(question)
    if (
        videos
        and not times
        and re.search(r"\b(what happens|what is happening|what's happening|summar\w*|describe)\b", q)
    ):
        return [{"tool": "video", "args": {"video": videos[0]}}]
    verdicts = [v for v in VERDICTS if v != "none" and re.search(rf"\b{v}\b", q)]
    if re.search(r"\bverdict (?:of )?none\b", q):
        verdicts.append("none")
    if re.search(r"\bflagged\b", q):
        verdicts += [v for v in ("confirmed", "suspected") if v not in verdicts]
    bounds: dict[str, float] = {}
    for t, start, _ in times:
        before = q[max(0, start - 12) : start]
        if re.search(r"\b(after|from|later than|past)\s*$", before):
            bounds["after_s"] = t
        elif re.search(r"\b(before|until|earlier than|by)\s*$", before):
            bounds["before_s"] = t
    conf = re.search(r"confiden\w*\s*(?:of\s*)?(?:above|over|>=?|at least|of at least)\s*(0?\.\d+|1(?:\.0+)?)", q)
    use_case = next((u for u in _use_cases() if u in q or u.replace("_", " ") in q), None)
    eventish = verdicts or conf or (bounds and re.search(r"\b(event|events|alert|alerts|verdict)\b", q))
    if eventish and not (videos and times and not bounds):
        args: dict[str, Any] = {"k": max(k, 20), **bounds}
        if conf:
            args["min_confidence"] = float(conf.group(1))
        if use_case:
            args["use_case"] = use_case
        return [{"tool": "events", "args": {**args, "verdict": v}} for v in verdicts] or [
            {"tool": "events", "args": args}
        ]
    if videos and times:
        t = times[0][0]
        return [
            {
                "tool": "search_window",
                "args": {"video": videos[0], "start_s": max(0.0, t - WINDOW_PAD_S), "end_s": t + WINDOW_PAD_S},
            }
        ]
    if videos:
        return [{"tool": "video", "args": {"video": videos[0]}}]
    return [
        {"tool": "search_text", "args": {"query": question, "k": k}},
        {"tool": "transcripts_at_hits", "args": {"top": 3, "pad_s": HIT_PAD_S}},
    ]


def _use_cases() -> list[str]:
    from video_assets.core.structuring.usecase import available

    try:
        return available()
    except Exception:
        return []


# -- running a plan ----------------------------------------------------------------------------------
def execute(steps: list[dict], searcher: Searcher, k: int = 8) -> tuple[list[dict], list[Hit]]:
    """Run the steps in order; (the steps as run, with their hit counts; the evidence, deduplicated)."""
    run: list[dict] = []
    evidence: list[Hit] = []
    seen: set[tuple] = set()
    for step in steps:
        tool, args = step["tool"], dict(step.get("args") or {})
        record: dict[str, Any] = {"tool": tool, "args": args, "hits": 0}
        try:
            hits = _run_step(tool, args, searcher, evidence)
        except Exception as exc:
            record["error"] = f"{exc.__class__.__name__}: {exc}"
            hits = []
        record["hits"] = len(hits)
        run.append(record)
        for h in hits:
            key = (h.video_id, h.source, h.segment, round(h.start_s, 3), round(h.end_s, 3), h.text)
            if key not in seen and len(evidence) < MAX_EVIDENCE:
                seen.add(key)
                evidence.append(h)
    return run, evidence


def _run_step(tool: str, args: dict, searcher: Searcher, found: list[Hit]) -> list[Hit]:
    if tool in ("search_transcripts", "search_captions", "search_text"):
        sources = {"search_transcripts": (TRANSCRIPT,), "search_captions": (CAPTION,)}.get(tool, (TRANSCRIPT, CAPTION))
        return searcher.search_text(args["query"], k=int(args.get("k", 8)), sources=sources)
    if tool == "similar_frames":
        vid = resolve_video(args["video"], searcher, found)
        return searcher.similar_frames(vid, float(args["t"]), k=int(args.get("k", 8)))
    if tool == "search_window":
        vid = resolve_video(args["video"], searcher, found)
        return searcher.search_window(vid, float(args["start_s"]), float(args["end_s"]))
    if tool == "transcripts_at_hits":
        pad = float(args.get("pad_s", HIT_PAD_S))
        out: list[Hit] = []
        anchors = [h for h in found if h.source in (CAPTION, FRAME, EVENT, TRANSCRIPT)][: int(args.get("top", 3))]
        for h in anchors:
            window = searcher.search_window(h.video_id, max(0.0, h.start_s - pad), h.end_s + pad)
            out += [w for w in window if w.source == TRANSCRIPT]
        return out
    if tool == "video":
        return searcher.video(resolve_video(args["video"], searcher, found))
    if tool == "events":
        filters = {
            key: args[key] for key in ("use_case", "verdict", "min_confidence", "after_s", "before_s") if key in args
        }
        return searcher.events(**filters, k=int(args.get("k", 20)))
    raise ValueError(f"unknown tool {tool!r}")


def resolve_video(ref: str, searcher: Searcher, found: list[Hit]) -> str:
    """A video_id from a video_id or a file name: the hits found so far, the searcher's own lookup
    (``find_video``, when it has one), then a search for the name."""
    ref = ref.strip()
    if _SHA.fullmatch(ref):
        return ref
    name = ref.rsplit("/", 1)[-1]

    def match(hits: list[Hit]) -> str | None:
        for h in hits:
            base = h.uri.rsplit("/", 1)[-1]
            if base == name or base.rsplit(".", 1)[0] == name:
                return h.video_id
        return None

    if vid := match(found):
        return vid
    lookup = getattr(searcher, "find_video", None)
    if callable(lookup) and (vid := lookup(name)):
        return vid
    stem = re.sub(r"[\W_]+", " ", name.rsplit(".", 1)[0]).strip() or name
    if vid := match(searcher.search_text(stem, k=50)):
        return vid
    raise LookupError(f"no video named {ref!r} in the index")


# -- answering ---------------------------------------------------------------------------------------
def _label(h: Hit) -> str:
    return f"{h.citation} ({h.source})"


def _llm_answer(question: str, evidence: list[Hit], llm: LlmClient) -> tuple[str, list[int], list[int]]:
    listing = "\n".join(f"[{n}] {_label(h)}: {_short(h.text or '(no text)', 500)}" for n, h in enumerate(evidence, 1))
    messages = [
        {
            "role": "system",
            "content": f"{ANSWER_MARKER} You answer questions about a video archive from numbered evidence "
            "only. Cite every claim with the evidence number in brackets, like [1] or [2][3]. If the evidence "
            "does not answer the question, say so. Be brief.",
        },
        {"role": "user", "content": f"Question: {question}\n\nEvidence:\n{listing}"},
    ]
    text = llm.chat(messages)
    if not text:
        raise ValueError("empty answer")
    cited, dropped = [], []
    for m in re.finditer(r"\[(\d+)\]", text):
        n = int(m.group(1))
        (cited if 1 <= n <= len(evidence) else dropped).append(n)
    if dropped:
        text = re.sub(r"\s*\[(\d+)\]", lambda m: m.group(0) if 1 <= int(m.group(1)) <= len(evidence) else "", text)
    return text.strip(), list(dict.fromkeys(cited)), list(dict.fromkeys(dropped))


def _terms(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOP and len(w) > 1}


def _short(text: str, n: int) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= n else text[: n - 1] + "…"


def extractive_answer(question: str, evidence: list[Hit], run: list[dict], lead: str) -> tuple[str, list[int]]:
    """(text, evidence numbers cited): the passages most relevant to the question, each with its
    citation. For a whole video ("what happens in X"): its summary if indexed, else passages spread
    over the video in time order."""
    if not evidence:
        return lead if lead.startswith("Nothing") else f"{lead}\n(nothing in the index matched the question)", []
    whole_video = any(s["tool"] == "video" for s in run)
    numbered = list(enumerate(evidence, 1))
    if whole_video:
        summary = [(n, h) for n, h in numbered if h.source == SUMMARY]
        rest = sorted(((n, h) for n, h in numbered if h.source != SUMMARY), key=lambda x: x[1].start_s)
        m = max(0, EXTRACT_PASSAGES - len(summary))
        spread = [rest[round(i * (len(rest) - 1) / (m - 1))] for i in range(m)] if m > 1 and len(rest) > m else rest[:m]
        chosen = list({n: (n, h) for n, h in summary + spread}.values())
        passages = [(n, h, h.text) for n, h in chosen]
    else:
        q = _terms(question)
        scored = []
        for rank, (n, h) in enumerate(numbered):
            sentences = [s for s in re.split(r"(?<=[.!?;])\s+", h.text or "") if s.strip()] or [h.text or ""]
            best = max(sentences, key=lambda s: len(q & _terms(s)))
            scored.append((-len(q & _terms(best)), rank, n, h, best))
        chosen_scored = sorted(scored)[:EXTRACT_PASSAGES]
        passages = [(n, h, best) for _, _, n, h, best in sorted(chosen_scored, key=lambda x: x[1])]
    lines = [f"- [{n}] {_label(h)}: {_short(text, 300) or _event_text(h)}" for n, h, text in passages]
    return lead + "\n" + "\n".join(lines), [n for n, _, _ in passages]


def _event_text(h: Hit) -> str:
    extra = h.extra or {}
    bits = [str(extra[k]) for k in ("use_case", "verdict", "confidence") if extra.get(k) is not None]
    return f"{' '.join(bits) or h.source} at {clock(h.start_s)}"
