"""A video's captions, speech and events merged into one timeline of ``[mm:ss]`` lines, and summaries of
it: extractive (representative lines spread over the video, plus every event line) or by an LLM
(map-reduce: each chunk of lines summarised, then the chunk summaries summarised)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from video_assets.core.vocabulary import ANSWERED, CAPTION_OK, TRANSCRIPT_SPEECH

# Markers the prompts carry (an OpenAI-compatible test server answers by them).
MAP_MARKER = "[video-assets:summarise-chunk]"
REDUCE_MARKER = "[video-assets:summarise-summaries]"
CAPTION, SPEECH, EVENT = "caption", "speech", "event"
_KIND_ORDER = {EVENT: 0, CAPTION: 1, SPEECH: 2}
LINE_CHARS = 400  # a line's text is cut to this in summaries


@dataclass(frozen=True)
class Line:
    start_s: float
    end_s: float
    kind: str  # CAPTION | SPEECH | EVENT
    text: str

    def render(self, max_chars: int | None = None) -> str:
        text = self.text if max_chars is None or len(self.text) <= max_chars else self.text[: max_chars - 1] + "…"
        return f"[{clock(self.start_s)}] {text}"


def clock(seconds: float | None) -> str:
    s = max(0, int(seconds or 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def _clean(text: Any) -> str:
    return re.sub(r"\s+", " ", str(text or "")).strip()


def timeline(captions: list[dict], transcripts: list[dict], events: list[dict]) -> list[Line]:
    """One video's rows as lines in time order (at equal times: events, then captions, then speech).

    ``captions``: rows of the captions table (ok rows with prose are used); ``transcripts``: rows of the
    transcripts table (speech rows); ``events``: rows of structured_events (answered rows): one line per
    event, or one verdict line for a flagged segment that names no event."""
    lines: list[Line] = []
    for r in captions:
        if r.get("status", CAPTION_OK) == CAPTION_OK and _clean(r.get("prose")):
            start = float(r.get("segment_start_s") or 0.0)
            lines.append(Line(start, float(r.get("segment_end_s") or start), CAPTION, _clean(r["prose"])))
    for r in transcripts:
        if r.get("status", TRANSCRIPT_SPEECH) == TRANSCRIPT_SPEECH and _clean(r.get("text")):
            start = float(r.get("start_s") or 0.0)
            lines.append(Line(start, float(r.get("end_s") or start), SPEECH, f"said: “{_clean(r['text'])}”"))
    for r in events:
        if r.get("status", ANSWERED[0]) not in ANSWERED:
            continue
        verdict = r.get("verdict") or "unknown"
        conf = r.get("confidence")
        label = f"{r.get('use_case', 'event')} {verdict}" + (f" {conf:.2f}" if conf is not None else "")
        evs = r.get("events") or []
        for e in evs:
            what = " ".join(_clean(e.get(k)) for k in ("actor", "action", "object") if _clean(e.get(k)))
            start = float(e.get("start_s") or 0.0)
            lines.append(Line(start, float(e.get("end_s") or start), EVENT, f"event ({label}): {what}"))
        if not evs and verdict not in ("none", "unknown"):
            start = float(r.get("segment_start_s") or 0.0)
            why = _clean(r.get("rationale"))
            lines.append(
                Line(
                    start,
                    float(r.get("segment_end_s") or start),
                    EVENT,
                    f"verdict ({label})" + (f": {why}" if why else ""),
                )
            )
    return sorted(lines, key=lambda x: (x.start_s, _KIND_ORDER[x.kind], x.end_s, x.text))


def chunks(lines: list[Line], max_chars: int) -> list[list[Line]]:
    """Consecutive lines packed into chunks of at most ``max_chars`` rendered characters (a longer line
    is a chunk of its own, cut to ``max_chars``)."""
    out: list[list[Line]] = []
    size = 0
    for line in lines:
        n = len(line.render(LINE_CHARS)) + 1
        if not out or size + n > max_chars:
            out.append([])
            size = 0
        out[-1].append(line)
        size += n
    return out


def extractive_summary(lines: list[Line], max_lines: int = 12) -> str:
    """Every event line, plus captions and speech picked evenly across the video up to ``max_lines``
    lines in all, in time order, each with its ``[mm:ss]``."""
    if not lines:
        return "Nothing was captioned, said or detected in this video."
    events = [i for i, x in enumerate(lines) if x.kind == EVENT]
    others = [i for i, x in enumerate(lines) if x.kind != EVENT]
    room = max(0, max_lines - len(events))
    if room >= len(others):
        picked = others
    elif room == 1:
        picked = [others[0]]
    else:  # evenly spaced, first and last included
        picked = sorted({others[round(j * (len(others) - 1) / (room - 1))] for j in range(room)}) if room else []
    return "\n".join(lines[i].render(LINE_CHARS) for i in sorted({*events, *picked}))


def _map_messages(text: str, part: int, parts: int) -> list[dict[str, str]]:
    return [
        {
            "role": "system",
            "content": f"{MAP_MARKER} You summarise part of a video's timeline (captions of what is seen, "
            "what is said, detected events). Write 2-5 sentences of what happens, keeping the [mm:ss] times "
            "of the moments you mention. Invent nothing.",
        },
        {"role": "user", "content": f"Timeline, part {part} of {parts}:\n{text}"},
    ]


def _reduce_messages(summaries: list[str]) -> list[dict[str, str]]:
    joined = "\n\n".join(f"Part {i}: {s}" for i, s in enumerate(summaries, 1))
    return [
        {
            "role": "system",
            "content": f"{REDUCE_MARKER} You merge summaries of consecutive parts of one video into one "
            "summary of 3-8 sentences, in time order, keeping the [mm:ss] times. Invent nothing.",
        },
        {"role": "user", "content": joined},
    ]


def llm_summary(lines: list[Line], llm, max_chars: int = 6000) -> tuple[str, int]:
    """(summary, chunks): each chunk summarised by ``llm`` (an ``LlmClient``), then, for more than one
    chunk, the chunk summaries summarised into one."""
    if not lines:
        return extractive_summary(lines), 0
    parts = chunks(lines, max_chars)
    texts = ["\n".join(x.render(LINE_CHARS) for x in part) for part in parts]
    partial = [llm.chat(_map_messages(t, i, len(texts))) for i, t in enumerate(texts, 1)]
    if len(partial) == 1:
        return partial[0], 1
    return llm.chat(_reduce_messages(partial)), len(parts)


def inputs_version(captions: list[dict], transcripts: list[dict], events: list[dict], method: str = "") -> str:
    """A hash of the rows a summary is made of (and how it is made): unchanged inputs, unchanged summary."""
    cap_cols = ("segment", "segment_start_s", "segment_end_s", "prose", "status", "model_version", "prompt_version")
    tr_cols = ("segment", "start_s", "end_s", "text", "status", "model_version")
    ev_cols = ("segment", "use_case", "use_case_version", "structurer", "verdict", "confidence", "events", "rationale")

    def rows(rs: list[dict], cols: tuple[str, ...]) -> list[list]:
        return sorted(([r.get(c) for c in cols] for r in rs), key=lambda x: json.dumps(x, default=str))

    payload = [method, rows(captions, cap_cols), rows(transcripts, tr_cols), rows(events, ev_cols)]
    return hashlib.sha256(json.dumps(payload, default=str, sort_keys=True).encode()).hexdigest()[:16]
