"""Which upload batches hold rows of a model or prompt that is no longer in production. Pure (polars).

After ``production`` moves (a promotion, or an operator's alias change), a batch is stale from:

- ``captions`` when a video of it has captions (ok or not) but none from the production model and prompt:
  captions and everything downstream must be made again;
- ``structured_events`` when its captions are current but a configured use case's rows are not from the
  current structuring (use case version and structuring model) for them: structuring and downstream.

A batch never captioned is not stale (it is new: the upload sensor's run handles it).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

CAPTIONS_ROOT, STRUCTURING_ROOT = "captions", "structured_events"


def stale_batches(
    captions: pl.DataFrame,
    structured: pl.DataFrame,
    model_version: str,
    prompt_version: int,
    structuring: Sequence[tuple[str, str, str]],
) -> dict[str, dict]:
    """``{batch: {"root": captions | structured_events, "videos": n, "reason": text}}`` for the stale batches.
    ``structuring``: the current (use_case, use_case_version, structurer) triples."""
    out: dict[str, dict] = {}
    if captions.is_empty():
        return out
    current = (pl.col("model_version") == str(model_version)) & (pl.col("prompt_version") == int(prompt_version))
    videos = captions.select("batch_key", "video_id").unique()
    fresh = captions.filter(current).select("video_id").unique()
    old = videos.join(fresh, on="video_id", how="anti")
    for (batch,), rows in old.group_by(["batch_key"]):
        found = captions.filter(pl.col("batch_key") == batch).select("model_version", "prompt_version").unique()
        was = ", ".join(f"model v{m} prompt v{p}" for m, p in sorted(found.iter_rows()))
        out[batch] = {
            "root": CAPTIONS_ROOT,
            "videos": rows.height,
            "reason": f"{rows.height} video(s) captioned by {was}, not by production model v{model_version} "
            f"prompt v{prompt_version}",
        }
    if structured.is_empty():
        return out
    mine = structured.filter(current)
    for use_case, version, structurer in structuring:
        rows = mine.filter(pl.col("use_case") == use_case)
        done = rows.filter((pl.col("use_case_version") == version) & (pl.col("structurer") == structurer))
        behind = (
            rows.select("batch_key", "video_id")
            .unique()
            .join(done.select("video_id").unique(), on="video_id", how="anti")
        )
        for (batch,), left in behind.group_by(["batch_key"]):
            if batch in out:
                continue  # captions first: structuring comes with them
            out[batch] = {
                "root": STRUCTURING_ROOT,
                "videos": left.height,
                "reason": f"{left.height} video(s) of {use_case} structured by another use case version or "
                f"structurer than {version} / {structurer}",
            }
    return dict(sorted(out.items()))
