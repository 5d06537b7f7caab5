"""Small images for materialisation metadata and MLflow artifacts: charts drawn with matplotlib (Agg,
no display), frame strips with Pillow."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image, ImageDraw


def figure():
    """A matplotlib figure on the Agg canvas (no pyplot: no global state, no display needed)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(4.8, 3.6), dpi=100, layout="constrained")


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def confusion_png(rows: list[str], columns: list[str], matrix: list[list[int]], title: str = "") -> bytes:
    """A heat-mapped confusion matrix: rows expected, columns predicted, counts in the cells."""
    counts = np.asarray(matrix, dtype=np.int64).reshape(len(rows), len(columns))
    fig = figure()
    ax = fig.add_subplot()
    ax.imshow(counts, cmap="Blues", vmin=0, vmax=max(int(counts.max(initial=0)), 1))
    ax.set_xticks(range(len(columns)), labels=columns, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), labels=rows)
    ax.set_xlabel("predicted")
    ax.set_ylabel("expected")
    if title:
        ax.set_title(title)
    half = counts.max(initial=0) / 2
    for (i, j), v in np.ndenumerate(counts):
        ax.text(j, i, str(v), ha="center", va="center", color="white" if v > half else "black")
    return png_bytes(fig)


def markdown_image(data: bytes, alt: str) -> str:
    mime = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
    return f"![{alt}](data:{mime};base64,{base64.b64encode(data).decode()})"


def thumbnail_strip(frames, timestamps: list[float], height: int = 72, max_frames: int = 8) -> bytes:
    """The sampled frames side by side (at most ``max_frames``, evenly picked), each labelled with its
    time, as a JPEG (a tenth of the PNG's size: it travels inside the event log)."""
    n = len(frames)
    if n == 0:
        raise ValueError("no frames")
    pick = sorted({round(i * (n - 1) / max(1, min(n, max_frames) - 1)) for i in range(min(n, max_frames))})
    thumbs = []
    for i in pick:
        im = Image.fromarray(frames[i])
        w = max(1, round(im.width * height / im.height))
        thumbs.append((im.resize((w, height)), timestamps[i]))
    strip = Image.new("RGB", (sum(t.width for t, _ in thumbs) + 2 * (len(thumbs) - 1), height + 14), "white")
    d = ImageDraw.Draw(strip)
    x = 0
    for im, t in thumbs:
        strip.paste(im, (x, 0))
        d.text((x + 2, height + 1), f"{t:.1f}s", fill="black")
        x += im.width + 2
    buf = io.BytesIO()
    strip.save(buf, format="JPEG", quality=70)
    return buf.getvalue()
