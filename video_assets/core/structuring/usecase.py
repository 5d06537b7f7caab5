"""Use cases as configuration: ``video_assets/usecases/<name>/`` holds ``usecase.toml`` (question,
verdict meanings, routing threshold, bounds; validated by ``UseCaseFile``, unknown keys rejected),
``prompt.txt`` (the structuring prompt) and ``golden.jsonl`` (labels). The pydantic output model of a
use case is built from its bounds, and the decoder's JSON schema is generated from that model, so the
bounds are stated once and adding a use case is adding a folder. Pure: no Dagster, no model."""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from video_assets.core.validation import reasons
from video_assets.core.vocabulary import VERDICTS, Verdict

USE_CASES_DIR = Path(__file__).resolve().parents[2] / "usecases"
# Plain printable ASCII without quote or backslash: no escapes to loop in, every byte a token.
TEXT_CHARS = r"[A-Za-z0-9 ,.;:()'/+&-]"


@dataclass(frozen=True, eq=False)  # hashed by identity (load() caches one per name)
class UseCase:
    name: str
    title: str
    question: str
    verdicts: dict[str, str]
    prompt: str
    alert_threshold: float = 0.7
    max_events: int = 4
    max_text: int = 24
    max_rationale: int = 80
    max_seconds: int = 86400
    folder: Path = field(default=USE_CASES_DIR)
    # [curation]: frame-curation thresholds (core.curation.quality.CurationConfig) and describe_prompt.
    curation: dict[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> str:
        """Hash of the prompt and the config: a changed prompt or bound is a new structuring version."""
        data = (self.folder / "usecase.toml").read_bytes() + b"\0" + self.prompt.encode()
        return hashlib.sha256(data).hexdigest()[:12]

    @property
    def golden_path(self) -> Path:
        return self.folder / "golden.jsonl"


def available(root: Path = USE_CASES_DIR) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/usecase.toml"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# One required description per verdict of the vocabulary, nothing else.
_Verdicts = create_model("_Verdicts", __base__=_Strict, **{v: (str, ...) for v in VERDICTS})


class _Routing(_Strict):
    alert_threshold: float = Field(default=0.7, ge=0, le=1)


class _Limits(_Strict):
    max_events: int = Field(default=4, ge=0, le=64)
    max_text: int = Field(default=24, ge=1, le=512)
    max_rationale: int = Field(default=80, ge=0, le=2048)
    max_seconds: int = Field(default=86400, ge=1)


class UseCaseFile(_Strict):
    """``usecase.toml``: a misspelt key is an error, not a silently ignored default."""

    title: str | None = None
    question: str = Field(min_length=1)
    verdicts: _Verdicts
    routing: _Routing = _Routing()
    limits: _Limits = _Limits()
    curation: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def curation_known(self):
        from video_assets.core.curation.quality import CurationConfig

        values = dict(self.curation)
        prompt = values.pop("describe_prompt", "x")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("curation.describe_prompt must be a non-empty string")
        CurationConfig.from_dict(values)  # an unknown key or a bad threshold fails here
        return self


@lru_cache(maxsize=32)
def load(name: str, root: Path = USE_CASES_DIR) -> UseCase:
    folder = root / name
    if not (folder / "usecase.toml").is_file():
        raise ValueError(f"unknown use case {name!r}: no {folder}/usecase.toml (have: {', '.join(available(root))})")
    try:
        cfg = UseCaseFile.model_validate(tomllib.loads((folder / "usecase.toml").read_text()))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{folder}/usecase.toml: not TOML: {exc}") from exc
    except ValidationError as exc:
        why = reasons(exc)
        raise ValueError(f"{folder}/usecase.toml is invalid: {why}") from exc
    return UseCase(
        name=name,
        title=cfg.title or name,
        question=cfg.question,
        verdicts=cfg.verdicts.model_dump(),
        prompt=(folder / "prompt.txt").read_text().strip(),
        alert_threshold=cfg.routing.alert_threshold,
        folder=folder,
        curation=dict(cfg.curation),
        **cfg.limits.model_dump(),
    )


def parse_names(spec: str) -> list[UseCase]:
    """``"object_handling,loss_prevention"`` -> use cases; an unknown name is a clear error."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError("no use case configured")
    return [load(n) for n in names]


# -- the output schema -----------------------------------------------------------------------------


class EventOut(BaseModel):
    model_config = ConfigDict(extra="forbid")
    start_s: float = Field(ge=0)
    end_s: float = Field(ge=0)
    actor: str
    action: str
    object: str

    @model_validator(mode="after")
    def ordered(self):
        if self.end_s < self.start_s:
            raise ValueError(f"event ends ({self.end_s}) before it starts ({self.start_s})")
        return self


class Structured(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verdict: Verdict
    confidence: float = Field(ge=0, le=1)
    events: list[EventOut]
    rationale: str

    @model_validator(mode="after")
    def consistent(self):
        if self.verdict == "none" and self.events:
            raise ValueError("verdict none with events")
        return self


@lru_cache(maxsize=32)
def output_model(uc: UseCase) -> type[Structured]:
    """The validation model of a use case: ``Structured`` with its bounds on every string and list."""
    text = (str, Field(min_length=1, max_length=uc.max_text))
    event = create_model(
        f"{uc.name}_event",
        __base__=EventOut,
        start_s=(float, Field(ge=0, le=uc.max_seconds)),
        end_s=(float, Field(ge=0, le=uc.max_seconds)),
        actor=text,
        action=text,
        object=text,
    )
    return create_model(
        f"{uc.name}_output",
        __base__=Structured,
        events=(list[event], Field(max_length=uc.max_events)),
        rationale=(str, Field(max_length=uc.max_rationale)),
    )


# Event times may stray this far outside their clip's window and be kept (the decoder's bounds are the
# window rounded outwards to it; a frame time and a caption's own rounding can fall on the edge).
WINDOW_TOLERANCE_S = 0.1


def window(uc: UseCase, start_s: float | None, end_s: float | None) -> tuple[float, float]:
    """The seconds a caption's events may fall in: its segment, rounded outwards to the tolerance, within
    [0, max_seconds]; the use case's whole range when the segment is unknown."""
    step = WINDOW_TOLERANCE_S
    lo = max(0.0, math.floor((start_s or 0.0) / step) * step)
    hi = uc.max_seconds if end_s is None or not math.isfinite(end_s) else math.ceil(end_s / step) * step
    hi = min(float(uc.max_seconds), hi)
    return round(lo, 3), round(max(lo, hi), 3)


def decode_schema(uc: UseCase, start_s: float | None = None, end_s: float | None = None) -> dict[str, Any]:
    """The JSON schema the decoder is constrained to: ``output_model(uc)``'s schema made finite (every
    free string a bounded ASCII pattern, every number bounded, every array capped) so that even a model
    with random weights ends, with event times bounded by the caption's own segment (``window``): the
    decoder cannot place an event outside the clip. Validate the result with ``output_model`` (ordering
    rules live there) and ``within_window``."""
    schema = output_model(uc).model_json_schema()
    out = _finite(schema, schema.get("$defs", {}))
    lo, hi = window(uc, start_s, end_s)
    for name in ("start_s", "end_s"):
        out["properties"]["events"]["items"]["properties"][name].update(minimum=lo, maximum=hi)
    return out


def within_window(
    uc: UseCase, record: Structured, start_s: float | None, end_s: float | None
) -> tuple[Structured, list[EventOut]]:
    """``record`` with only the events inside the caption's segment (``window``), and those it dropped:
    an engine that ignored the schema's bounds, or a model pinned to answer, cannot put an event at
    223 s into a 9.6 s clip."""
    lo, hi = window(uc, start_s, end_s)
    inside = [e for e in record.events if lo - 1e-9 <= e.start_s and e.end_s <= hi + 1e-9]
    outside = [e for e in record.events if e not in inside]
    return (record.model_copy(update={"events": inside}) if outside else record), outside


def _finite(node: Any, defs: dict[str, Any]) -> Any:
    """Inline ``$ref``s, drop annotations, and turn every string without an enum into a pattern of
    ``TEXT_CHARS`` with its length bounds; an unbounded string or number is a programming error."""
    if isinstance(node, list):
        return [_finite(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _finite(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    out = {k: _finite(v, defs) for k, v in node.items() if k not in ("title", "description", "default", "$defs")}
    if out.get("type") == "string" and "enum" not in out:
        if "maxLength" not in out:
            raise ValueError(f"unbounded string in the output model: {node}")
        lo, hi = out.pop("minLength", 0), out.pop("maxLength")
        out["pattern"] = f"^{TEXT_CHARS}{{{lo},{hi}}}$"
    if out.get("type") == "number" and not ("minimum" in out and "maximum" in out):
        raise ValueError(f"unbounded number in the output model: {node}")
    if out.get("type") == "array" and "maxItems" not in out:
        raise ValueError(f"unbounded array in the output model: {node}")
    return out


def classify_schema() -> dict[str, Any]:
    """The retry's schema: one verdict, nothing else."""
    return {"type": "string", "enum": list(VERDICTS)}


def max_output_chars(uc: UseCase) -> int:
    """Length of the longest output ``decode_schema`` admits (a floor for max_new_tokens on a
    byte-level tokenizer, where a token is at least one character)."""
    num = 13  # "86400.123456"-style bounded number
    event = (
        2 + sum(len(k) + 6 for k in ("start_s", "end_s", "actor", "action", "object")) + 2 * num + 3 * (uc.max_text + 2)
    )
    return 80 + uc.max_events * (event + 2) + uc.max_rationale + len(max(VERDICTS, key=len))


# -- prompts and parsing -----------------------------------------------------------------------------


def messages(uc: UseCase, caption: str, start_s: float | None, end_s: float | None) -> list[dict[str, str]]:
    verdicts = "; ".join(f"{k} = {v}" for k, v in uc.verdicts.items())
    text = uc.prompt.format(
        question=uc.question,
        verdicts=verdicts,
        caption=caption.strip() or "(empty)",
        start_s=_fmt(start_s, 0.0),
        end_s=_fmt(end_s, None),
    )
    return [
        {"role": "system", "content": "You answer with one JSON object and nothing else."},
        {"role": "user", "content": text},
    ]


def classify_messages(uc: UseCase, caption: str) -> list[dict[str, str]]:
    options = ", ".join(uc.verdicts)
    return [
        {"role": "system", "content": "You answer with one word in double quotes."},
        {
            "role": "user",
            "content": f"{uc.question}\nAnswer one of: {options}.\n"
            + "\n".join(f"{k}: {v}" for k, v in uc.verdicts.items())
            + f"\n\nCaption:\n{caption.strip() or '(empty)'}",
        },
    ]


def _fmt(x: float | None, default: float | None) -> str:
    x = default if x is None else x
    return "the end" if x is None else f"{x:g}"


def parse(uc: UseCase, text: str) -> tuple[Structured | None, str | None]:
    """(record, None) when ``text`` is a JSON object valid for the use case, else (None, reason)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} at char {exc.pos}"
    try:
        return output_model(uc).model_validate(data), None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "record"
        return None, f"schema: {where}: {first.get('msg')} ({exc.error_count()} errors)"


def parse_verdict(text: str) -> tuple[str | None, str | None]:
    """The retry's answer: a JSON string (or bare word) naming one verdict."""
    word = text.strip()
    try:
        word = json.loads(word) if word.startswith('"') else word
    except json.JSONDecodeError:
        return None, f"not a JSON string: {text[:40]!r}"
    if isinstance(word, str) and word.strip().lower() in VERDICTS:
        return word.strip().lower(), None
    return None, f"not a verdict: {text[:40]!r}"
