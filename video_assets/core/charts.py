"""Small PNGs for materialisation metadata and MLflow artifacts (Pillow only)."""

from __future__ import annotations

import base64
import io

from PIL import Image, ImageDraw

CELL = 56


def confusion_png(rows: list[str], columns: list[str], matrix: list[list[int]], title: str = "") -> bytes:
    """A heat-mapped confusion matrix: rows expected, columns predicted, counts in the cells."""
    left, top = 90, 46 + (16 if title else 0)
    img = Image.new("RGB", (left + CELL * len(columns) + 10, top + CELL * len(rows) + 24), "white")
    d = ImageDraw.Draw(img)
    if title:
        d.text((6, 4), title, fill="black")
    d.text((left, top - 40), "predicted ->", fill="gray")
    d.text((4, top - 14), "expected", fill="gray")
    peak = max([max(r) for r in matrix] + [1])
    for j, c in enumerate(columns):
        d.text((left + j * CELL + 4, top - 22), c[:9], fill="black")
    for i, r in enumerate(rows):
        d.text((4, top + i * CELL + CELL // 2 - 6), r, fill="black")
        for j, v in enumerate(matrix[i]):
            shade = 255 - int(200 * v / peak)
            x, y = left + j * CELL, top + i * CELL
            fill = (shade, shade, 255) if i == j else (255, shade, shade)
            d.rectangle([x, y, x + CELL - 2, y + CELL - 2], fill=fill, outline="gray")
            d.text((x + CELL // 2 - 6, y + CELL // 2 - 6), str(v), fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


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
