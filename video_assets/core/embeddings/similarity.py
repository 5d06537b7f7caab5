"""Cosine similarity, top-k search and a 2-D PCA view of embeddings (numpy and Pillow only)."""

from __future__ import annotations

import colorsys
import io

import numpy as np
from PIL import Image, ImageDraw


def _unit_rows(x) -> np.ndarray:
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def cosine_matrix(a, b) -> np.ndarray:
    """(n, m) cosine similarities between the rows of ``a`` (n, d) and ``b`` (m, d); zero rows give 0."""
    a, b = _unit_rows(a), _unit_rows(b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"dimension mismatch: {a.shape[1]} vs {b.shape[1]}")
    return a @ b.T


def top_k(query, matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and cosine scores of the ``k`` rows of ``matrix`` nearest to ``query``, best first.

    A 1-D query gives (k,) arrays, an (m, d) query (m, k) arrays. Ties go to the lower index, so the
    result is deterministic. ``k`` is capped at the number of rows.
    """
    single = np.asarray(query).ndim == 1
    sims = cosine_matrix(query, matrix)
    k = max(0, min(int(k), sims.shape[1]))
    # lexsort: last key first; sorting by (-score, index) keeps equal scores in index order.
    order = np.array([np.lexsort((np.arange(len(row)), -row))[:k] for row in sims], dtype=np.int64).reshape(-1, k)
    scores = np.take_along_axis(sims, order, axis=1)
    return (order[0], scores[0]) if single else (order, scores)


def project_2d(vectors) -> np.ndarray:
    """(n, 2) coordinates on the two main principal axes (PCA by SVD of the centred rows).

    Each axis's sign is fixed so that its largest-magnitude loading is positive: the same vectors
    always give the same picture, whatever the SVD routine returns.
    """
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected an (n, d) array, got shape {x.shape}")
    n = x.shape[0]
    out = np.zeros((n, 2), dtype=np.float32)
    if n < 2:
        return out
    centred = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    axes = vt[:2]
    signs = np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(axis=1)])
    axes = axes * np.where(signs == 0, 1.0, signs)[:, None]
    out[:, : len(axes)] = centred @ axes.T
    return out


def _palette(n: int) -> list[tuple[int, int, int]]:
    """n well-spread, saturated colours (golden-ratio hue steps)."""
    return [tuple(int(255 * c) for c in colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.75, 0.85)) for i in range(n)]


def scatter_png(points, labels: list[str], size: int = 360, title: str = "") -> bytes:
    """A small scatter plot of 2-D ``points``, one colour per distinct label, with a legend, as PNG.

    For materialisation metadata (wrap with ``video_assets.core.charts.markdown_image``): a person sees
    at a glance whether the frames of one clip cluster.
    """
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    if len(labels) != len(pts):
        raise ValueError(f"{len(pts)} points but {len(labels)} labels")
    names = list(dict.fromkeys(str(lb) for lb in labels))  # first-seen order
    colours = dict(zip(names, _palette(len(names))))
    legend_w = 12 + 7 * max([len(n[:24]) for n in names] + [0]) + 24
    top = 20 if title else 6
    pad = 10
    img = Image.new("RGB", (size + legend_w, max(size, top + 14 * len(names) + pad)), "white")
    d = ImageDraw.Draw(img)
    if title:
        d.text((6, 4), title, fill="black")
    d.rectangle([pad, top, size - pad, size - pad], outline="gray")
    if len(pts):
        lo, hi = pts.min(axis=0), pts.max(axis=0)
        span = np.where(hi - lo > 1e-12, hi - lo, 1.0)
        inner = np.array([size - 2 * pad - 12, size - top - pad - 12], dtype=np.float64)
        xy = (pts - lo) / span * inner
        for (x, y), label in zip(xy, labels):
            cx, cy = pad + 6 + x, size - pad - 6 - y  # y up, as in a plot
            d.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=colours[str(label)], outline="black")
    for i, name in enumerate(names):
        y = top + 14 * i
        d.rectangle([size + 2, y + 2, size + 10, y + 10], fill=colours[name], outline="black")
        d.text((size + 14, y), name[:24], fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
