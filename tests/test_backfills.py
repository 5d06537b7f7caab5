"""Backfills of many batches in one run: the pure parts (which runs the demo makes, how per-batch results
combine). The runs themselves: tests/test_captions.py (one Ray job for a range) and tests/test_cli.py
(`dagster asset materialize --partition-range` over the per-batch graph)."""

from dagster import DataVersion, MaterializeResult, MetadataValue

from video_assets.defs.common import merge_batches
from video_assets.defs.partitions import consecutive_ranges


def test_batches_to_run_become_ranges_of_consecutive_partitions():
    order = ["b1", "b2", "b3", "b4", "b5", "b6"]
    assert consecutive_ranges(order, ["b1", "b2", "b4", "b6", "b5"]) == [("b1", "b2"), ("b4", "b6")]
    assert consecutive_ranges(order, ["b3"]) == [("b3", "b3")]
    assert consecutive_ranges(order, []) == []
    assert consecutive_ranges(order, ["gone"]) == []  # a key no longer a partition runs nowhere


def _result(rows: int, table_rows: int, rate: float, version: str, note: str) -> MaterializeResult:
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            "dagster/row_count": MetadataValue.int(rows),
            "table_row_count": MetadataValue.int(table_rows),
            "frames_per_s": MetadataValue.float(rate),
            "engine": MetadataValue.text(note),
        },
    )


def test_results_of_several_batches_merge_into_one_that_says_what_each_did():
    merged = merge_batches(["b1", "b2"], [_result(3, 10, 5.0, "v1", "x"), _result(4, 14, 7.0, "v2", "y")])
    meta = merged.metadata
    assert meta["dagster/row_count"].value == 7  # the range's rows
    assert meta["table_row_count"].value == 14  # the table after the last batch, not a sum
    assert "frames_per_s" not in meta  # a rate of one batch is not the range's
    assert meta["per_batch"].value == {
        "b1": {"dagster/row_count": 3, "table_row_count": 10, "frames_per_s": 5.0},
        "b2": {"dagster/row_count": 4, "table_row_count": 14, "frames_per_s": 7.0},
    }
    assert meta["batches"].value == 2 and meta["engine"].value == "y"
    other = merge_batches(["b1", "b2"], [_result(3, 10, 5.0, "v1", "x"), _result(4, 14, 7.0, "v3", "y")])
    assert merged.data_version != other.data_version  # any batch's new content is a new version


def test_a_range_keeps_the_caption_pair_it_was_made_with():
    """The versions a later stage reads back from a range run's materialisation are the batches' own,
    not their sum (a two-batch range of prompt v1 once read as prompt v2, and scored nothing)."""
    from video_assets.defs.lineage import CaptionPair

    pair = CaptionPair("1", 1).metadata()
    one = MaterializeResult(metadata={**pair, "dagster/row_count": MetadataValue.int(2)})
    merged = merge_batches(["b1", "b2"], [one, one])
    assert merged.metadata["prompt_version"].value == 1 and merged.metadata["model_version"].value == "1"
    assert merged.metadata["dagster/row_count"].value == 4
