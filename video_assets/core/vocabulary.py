"""The words every stage shares: verdicts, statuses, routing destinations. Defined once here;
schemas, prompts, routing, scoring and table docs all read them from this module."""

from __future__ import annotations

from typing import Literal, get_args

# What a use case answers about a segment, most severe first.
Verdict = Literal["confirmed", "suspected", "possible", "none"]
VERDICTS: tuple[str, ...] = get_args(Verdict)
# The binary decision a dashboard acts on: these verdicts raise an alert (above the threshold).
FLAGGED: frozenset[str] = frozenset({"confirmed", "suspected"})
SEVERITY: dict[str, int] = {v: len(VERDICTS) - 1 - i for i, v in enumerate(VERDICTS)}

# captions.status
CAPTION_OK, CAPTION_ERROR = "ok", "error"
CAPTION_STATUSES = (CAPTION_OK, CAPTION_ERROR)

# structured_events.status: decoded under the schema / verdict-only retry / still failed / no input
PARSED, RETRIED, UNPARSED, NO_CAPTION = "parsed", "retried", "unparsed", "no_caption"
STRUCTURE_STATUSES = (PARSED, RETRIED, UNPARSED, NO_CAPTION)
ANSWERED = (PARSED, RETRIED)

# Where a structured row is routed.
ALERTS, REVIEW_QUEUE = "alerts", "review_queue"


def doc(words) -> str:
    """``"a | b | c"``: the allowed values as written in table column docs."""
    return " | ".join(words)
