"""Which structured_events rows belong to one caption pair and structuring model (and use case
version), and what a structuring run has to do so that the rows follow their captions. Pure polars."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from video_assets.core.captioning.versions import caption_versions, with_caption_digest
from video_assets.core.structuring.usecase import UseCase

# A structured row belongs to the caption row with these values: a recaption or a new split changes
# the digest, so the rows made from the old caption no longer join.
CAPTION_KEY = ["video_id", "segment", "caption_digest"]


def structuring_versions(
    model_version: str, prompt_version: int, structurer: str, uc: UseCase | None = None
) -> pl.Expr:
    """structured_events rows of one caption pair and structuring model (and use case version, if given)."""
    expr = caption_versions(model_version, prompt_version) & (pl.col("structurer") == structurer)
    if uc is not None:
        expr = expr & (pl.col("use_case") == uc.name) & (pl.col("use_case_version") == uc.version)
    return expr


def with_digest_column(rows: pl.DataFrame) -> pl.DataFrame:
    """Rows of a table written before ``caption_digest`` existed get it as null (they match no caption)."""
    return rows if "caption_digest" in rows.columns else rows.with_columns(caption_digest=pl.lit(None, pl.String))


@dataclass
class StructuringPlan:
    """What a structuring run writes for one caption pair: ``todo`` captions per use case (rows of the
    captions table with their ``caption_digest``); ``affected`` videos, whose rows of the pair are
    replaced in one commit by ``keep`` (their rows that still match a current caption) plus the new
    rows; ``stale``, rows whose caption was replaced or is gone (dropped by that commit)."""

    todo: dict[str, list[dict]]
    keep: pl.DataFrame
    affected: list[str]
    stale: int

    def rows(self, new_rows: list[dict], key: list[str]) -> list[dict]:
        """The affected videos' rows after the run: the kept rows, less those a new row replaces."""
        new_keys = {tuple(r[k] for k in key) for r in new_rows}
        kept = [r for r in self.keep.to_dicts() if tuple(r[k] for k in key) not in new_keys]
        return kept + new_rows


def plan_structuring(
    caps: pl.DataFrame, existing: pl.DataFrame, use_cases: list[UseCase], structurer: str, restructure: bool = False
) -> StructuringPlan:
    """``caps``: one caption pair's caption rows (a batch's, or some videos'); ``existing``: the
    structured rows of that pair for the same videos, of every structurer and use-case version.

    A caption is to structure for a use case when no row of the use case's current version and this
    ``structurer`` carries its digest (or always, with ``restructure``). A row whose digest matches no
    current caption is stale, and its video is rewritten even when nothing is left to structure."""
    caps = with_caption_digest(caps)
    existing = with_digest_column(existing)
    current = caps.select(CAPTION_KEY)
    valid = existing.join(current, on=CAPTION_KEY, how="semi")  # a null digest (older rows) joins nothing
    stale = existing.join(current, on=CAPTION_KEY, how="anti")
    todo = {}
    for uc in use_cases:
        if restructure:
            todo[uc.name] = caps.to_dicts()
            continue
        done = valid.filter(
            (pl.col("use_case") == uc.name)
            & (pl.col("use_case_version") == uc.version)
            & (pl.col("structurer") == structurer)
        ).select(CAPTION_KEY)
        todo[uc.name] = caps.join(done, on=CAPTION_KEY, how="anti", maintain_order="left").to_dicts()
    affected = set(stale.get_column("video_id").to_list())
    affected |= {c["video_id"] for rows in todo.values() for c in rows}
    return StructuringPlan(
        todo, valid.filter(pl.col("video_id").is_in(sorted(affected))), sorted(affected), stale.height
    )


# Rows derived from a caption join it on these: the caption pair, the segment and the caption's digest.
_DERIVED_KEY = ["video_id", "segment", "model_version", "prompt_version", "caption_digest"]


def rows_without_caption(rows: pl.DataFrame, caps: pl.DataFrame) -> pl.DataFrame:
    """Rows derived from captions (structured or routed) whose caption digest no current caption row
    has: they describe a caption that was replaced or is gone. Rows without a digest, written before
    the column existed, cannot be judged and are left out (``legacy_rows`` counts them)."""
    rows = with_digest_column(rows).filter(pl.col("caption_digest").is_not_null())
    return rows.join(with_caption_digest(caps).select(_DERIVED_KEY), on=_DERIVED_KEY, how="anti")


def legacy_rows(rows: pl.DataFrame) -> int:
    """Rows without a caption digest (written before it existed)."""
    return with_digest_column(rows).get_column("caption_digest").null_count()


def captions_without_rows(
    caps: pl.DataFrame, events: pl.DataFrame, use_cases: dict[str, str], structurer: str
) -> pl.DataFrame:
    """Caption rows (of the pair a run structured) lacking a structured row of that run, i.e. of each
    use case at its version (``{name: version}``) by ``structurer``, made from that very caption."""
    runs = pl.DataFrame(
        {
            "use_case": list(use_cases),
            "use_case_version": list(use_cases.values()),
            "structurer": [structurer] * len(use_cases),
        },
        schema={"use_case": pl.String, "use_case_version": pl.String, "structurer": pl.String},
    )
    expected = with_caption_digest(caps).select(_DERIVED_KEY).join(runs, how="cross")
    on = [*_DERIVED_KEY, "use_case", "use_case_version", "structurer"]
    return expected.join(with_digest_column(events).select(on), on=on, how="anti")
