"""On-screen text from a frame with RapidOCR (PP-OCR models on onnxruntime, bundled in the package)."""

from __future__ import annotations

import numpy as np

# Lines whose vertical centres are closer than this share of the taller line's height read as one row.
ROW_OVERLAP = 0.5


class FrameOcr:
    """Detect and recognise text in RGB uint8 frames. The engine loads on the first ``read``."""

    def __init__(self, min_score: float = 0.5, **engine_kwargs):
        self.min_score = min_score
        self._engine_kwargs = engine_kwargs
        self._engine = None

    def _load(self):
        if self._engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as exc:
                raise ImportError(
                    "frame OCR needs the 'rapidocr-onnxruntime' package (video-assets 'archive' extra)"
                ) from exc
            self._engine = RapidOCR(**self._engine_kwargs)
        return self._engine

    def read(self, frame: np.ndarray) -> list[dict]:
        """Text lines as ``{text, score, box}`` (box: four [x, y] corners in frame pixels), in reading order."""
        frame = np.asarray(frame)
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"expected an HxWx3 uint8 RGB frame, got {frame.shape} {frame.dtype}")
        # RapidOCR takes arrays as OpenCV does: BGR.
        result, _elapsed = self._load()(np.ascontiguousarray(frame[:, :, ::-1]))
        lines = [
            {"text": str(text), "score": float(score), "box": [[float(x), float(y)] for x, y in box]}
            for box, text, score in (result or [])
            if float(score) >= self.min_score and str(text).strip()
        ]
        return reading_order(lines)

    def text(self, frame: np.ndarray) -> str:
        """All text in the frame: words of a row joined by spaces, rows by newlines."""
        rows: list[list[str]] = []
        last = None
        for line in self.read(frame):
            if last is not None and _same_row(last, line):
                rows[-1].append(line["text"])
            else:
                rows.append([line["text"]])
            last = line
        return "\n".join(" ".join(r) for r in rows)


def _span(line: dict) -> tuple[float, float]:
    ys = [p[1] for p in line["box"]]
    return min(ys), max(ys)


def _same_row(a: dict, b: dict) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    height = max(a1 - a0, b1 - b0, 1.0)
    return abs((a0 + a1) / 2 - (b0 + b1) / 2) < ROW_OVERLAP * height


def reading_order(lines: list[dict]) -> list[dict]:
    """Top to bottom by rows, left to right within a row (the detector's order is by box, not by reading)."""
    rows: list[list[dict]] = []
    for line in sorted(lines, key=lambda ln: sum(_span(ln)) / 2):
        if rows and _same_row(rows[-1][-1], line):
            rows[-1].append(line)
        else:
            rows.append([line])
    return [ln for row in rows for ln in sorted(row, key=lambda ln: min(p[0] for p in ln["box"]))]
