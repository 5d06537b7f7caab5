"""A contact sheet of curated frames for materialisation metadata (Pillow only): one row per video,
each frame labelled with its time and reason, kept frames framed green and dropped ones red."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

KEPT_COLOUR, DROPPED_COLOUR = (40, 160, 60), (200, 40, 40)


def contact_sheet(rows: list[tuple[str, list[tuple[np.ndarray, float, str, bool]]]], height: int = 64) -> bytes:
    """``rows``: (title, [(frame RGB, time, reason, kept), ...]) per video -> a JPEG."""
    if not rows:
        raise ValueError("no rows")
    pad, label = 3, 12
    lines = []
    for title, frames in rows:
        thumbs = []
        for frame, t, reason, kept in frames:
            im = Image.fromarray(np.ascontiguousarray(frame))
            w = max(1, round(im.width * height / max(1, im.height)))
            thumbs.append((im.resize((w, height)), f"{t:.1f}s {reason}", kept))
        lines.append((title, thumbs))
    width = max(sum(t.width + 2 * pad for t, _, _ in thumbs) for _, thumbs in lines) + pad
    row_h = label + height + 2 * pad + label
    sheet = Image.new("RGB", (max(width, 200), row_h * len(lines)), "white")
    d = ImageDraw.Draw(sheet)
    for r, (title, thumbs) in enumerate(lines):
        y = r * row_h
        d.text((pad, y), title, fill="black")
        x = pad
        for im, text, kept in thumbs:
            colour = KEPT_COLOUR if kept else DROPPED_COLOUR
            d.rectangle([x - 2, y + label - 2, x + im.width + 1, y + label + height + 1], fill=colour)
            sheet.paste(im, (x, y + label))
            d.text((x, y + label + height + 2), text[: max(4, im.width // 6)], fill=colour)
            x += im.width + 2 * pad
    buf = io.BytesIO()
    sheet.save(buf, format="JPEG", quality=75)
    return buf.getvalue()
