"""A batch's rows are replaced in one Delta commit: no version of the table lacks them."""

from datetime import UTC, datetime

import polars as pl
import pytest
from dagster import materialize
from deltalake import DeltaTable

from resources.delta import DeltaTables
from video_assets.core.tables import GOLDEN_SET, RAW_VIDEOS, to_arrow
from video_assets.defs.evaluation.assets import golden_set


def _rows(batch: str, ids: list[str]):
    now = datetime.now(UTC)
    return to_arrow(
        RAW_VIDEOS,
        [
            {
                "video_id": i,
                "uri": f"/v/{i}.mp4",
                "size_bytes": 1,
                "mtime": now,
                "batch_key": batch,
                "registered_at": now,
            }
            for i in ids
        ],
    )


def _versions(uri: str) -> list[pl.DataFrame]:
    """Every version of the table, oldest first."""
    last = DeltaTable(uri).version()
    return [pl.read_delta(uri, version=v) for v in range(last + 1)]


def test_replace_is_one_commit_and_touches_only_its_batch(tmp_path):
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    uri = tables.table_uri(RAW_VIDEOS)
    tables.replace(RAW_VIDEOS, _rows("b1", ["a", "b", "c"]), "batch_key", ["b1"])  # creates the table
    tables.replace(RAW_VIDEOS, _rows("b2", ["x"]), "batch_key", ["b2"])
    before = tables.version(RAW_VIDEOS)

    tables.replace(RAW_VIDEOS, _rows("b1", ["c", "d"]), "batch_key", ["b1"])
    assert tables.version(RAW_VIDEOS) == before + 1  # one commit: no version between old and new rows
    out = tables.read(RAW_VIDEOS).sort("video_id")
    assert out.select("video_id", "batch_key").rows() == [("c", "b1"), ("d", "b1"), ("x", "b2")]
    # Every version since b1 was first written holds its rows (the old set or the new): none is empty of
    # them. (Version 0 is the table created empty, before any writer's rows.)
    assert _versions(uri)[0].is_empty()
    for df in _versions(uri)[1:]:
        assert df.filter(pl.col("batch_key") == "b1").height > 0

    # Empty rows empty the batch, still in one commit; a quote in a value is a literal, not SQL.
    tables.replace(RAW_VIDEOS, _rows("b1", []), "batch_key", ["b1"])
    assert tables.version(RAW_VIDEOS) == before + 2
    assert tables.read(RAW_VIDEOS)["video_id"].to_list() == ["x"]
    tables.replace(RAW_VIDEOS, _rows("it's", ["q"]), "batch_key", ["it's"])
    assert sorted(tables.read(RAW_VIDEOS)["video_id"].to_list()) == ["q", "x"]


def test_replace_refuses_rows_outside_the_values(tmp_path):
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    tables.replace(RAW_VIDEOS, _rows("b1", ["a"]), "batch_key", ["b1"])
    version = tables.version(RAW_VIDEOS)
    with pytest.raises(Exception, match="failed validation"):
        tables.replace(RAW_VIDEOS, _rows("b2", ["z"]), "batch_key", ["b1"])
    assert tables.version(RAW_VIDEOS) == version and tables.read(RAW_VIDEOS)["video_id"].to_list() == ["a"]


def test_golden_set_rematerialised_is_one_commit_with_the_same_rows(instance, tmp_path):
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    assert materialize([golden_set], instance=instance, resources={"tables": tables}).success
    first, version = tables.read(GOLDEN_SET).sort("use_case", "video_id"), tables.version(GOLDEN_SET)
    assert first.height > 0
    assert materialize([golden_set], instance=instance, resources={"tables": tables}).success
    assert tables.version(GOLDEN_SET) == version + 1
    assert tables.read(GOLDEN_SET).sort("use_case", "video_id").equals(first)


def test_writers_racing_on_one_table_all_land(tmp_path):
    """Batches written at the same moment by several runs: a commit another writer raced is retried
    against the table as it is then, so every batch's rows land (merges and replaces alike)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    tables = DeltaTables(root_uri=str(tmp_path))
    tables.merge(RAW_VIDEOS, _rows("b0", ["seed"]), keys=["video_id"])
    batches = [f"b{i}" for i in range(1, 5)]
    start = Barrier(len(batches))

    def write(batch: str) -> None:
        start.wait()  # all commit against the same table version
        tables.merge(RAW_VIDEOS, _rows(batch, [f"{batch}-m"]), keys=["video_id"])
        tables.replace(RAW_VIDEOS, _rows(batch, [f"{batch}-r1", f"{batch}-r2"]), "batch_key", [batch])

    with ThreadPoolExecutor(len(batches)) as pool:
        list(pool.map(write, batches))
    got = pl.read_delta(tables.table_uri(RAW_VIDEOS))
    assert sorted(got["video_id"]) == sorted(["seed"] + [f"{b}-r{i}" for b in batches for i in (1, 2)])


def _first_write(root: str, how: str, barrier) -> None:
    """One run's first write of a batch's ten rows to a table that does not exist yet."""
    tables = DeltaTables(root_uri=root)
    rows = _rows("b1", [f"v{i}" for i in range(10)])
    barrier.wait()  # both processes find no table, then write
    if how == "merge":
        tables.merge(RAW_VIDEOS, rows, keys=["video_id"])
    else:
        tables.replace(RAW_VIDEOS, rows, "batch_key", ["b1"])


@pytest.mark.parametrize("how", ["merge", "replace"])
def test_two_first_writers_in_separate_processes_leave_each_key_once(tmp_path, how):
    """A sensor run and a manual rerun of one batch writing a fresh instance's table at the same moment:
    the table is created empty first, so the second writer's commit is a merge (or a replace) against
    the first one's rows, never a blind append of the same keys (which left 20 rows, 6 times in 6)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for attempt in range(3):
        root = str(tmp_path / str(attempt))
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_first_write, args=(root, how, barrier)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
        got = pl.read_delta(DeltaTables(root_uri=root).table_uri(RAW_VIDEOS))
        assert sorted(got["video_id"]) == [f"v{i}" for i in range(10)], f"attempt {attempt}: {got.height} rows"
