"""Cosine similarity, top-k search and a 2-D PCA view of embeddings (numpy; scikit-learn's PCA and a
matplotlib scatter for the view)."""

from __future__ import annotations

import numpy as np


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
    """(n, 2) coordinates on the two main principal axes (scikit-learn's PCA, exact SVD solver).

    Each axis's sign is fixed so that its largest-magnitude loading is positive (sklearn's ``svd_flip``
    on the components): the same vectors always give the same picture, whatever the row order.
    """
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected an (n, d) array, got shape {x.shape}")
    n = x.shape[0]
    out = np.zeros((n, 2), dtype=np.float32)
    if n < 2:
        return out
    from sklearn.decomposition import PCA  # a second's import: only for the plot

    pca = PCA(n_components=min(2, n, x.shape[1]), svd_solver="full")
    out[:, : pca.n_components] = pca.fit_transform(x)
    return out


def scatter_png(points, labels: list[str], size: int = 360, title: str = "") -> bytes:
    """A small scatter plot of 2-D ``points``, one colour per distinct label, with a legend, as PNG
    (``size`` pixels high).

    For materialisation metadata (wrap with ``video_assets.core.charts.markdown_image``): a person sees
    at a glance whether the frames of one clip cluster.
    """
    from video_assets.core.charts import figure, png_bytes

    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    if len(labels) != len(pts):
        raise ValueError(f"{len(pts)} points but {len(labels)} labels")
    names = list(dict.fromkeys(str(lb) for lb in labels))  # first-seen order
    fig = figure()
    fig.set_size_inches(size / fig.dpi * 1.5, size / fig.dpi)
    ax = fig.add_subplot()
    label_of = np.array([str(lb) for lb in labels], dtype=object)
    for name in names:
        mine = pts[label_of == name]
        ax.scatter(mine[:, 0], mine[:, 1], s=18, edgecolors="black", linewidths=0.5, label=name[:24])
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    if names:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False)
    return png_bytes(fig)
