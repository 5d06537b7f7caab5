"""Delta Lake tables: one folder (or bucket prefix) holds every table, one sub-path per asset."""

from __future__ import annotations

import tempfile
from pathlib import Path

import polars as pl
import pyarrow as pa
from dagster import ConfigurableResource, InitResourceContext
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from pydantic import Field
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_incrementing

from resources.lifetime import exit_with_run_process
from video_assets.core.tables import BATCH_SCOPED

COMMIT_RETRIES = 5  # concurrent runs of different batches may race on a commit; delta-rs reports it


def _commit_attempts() -> Retrying:
    """Attempts of one commit: a CommitFailedError (another writer committed first) is retried with a
    growing pause, up to COMMIT_RETRIES times; then it is raised as it is."""
    return Retrying(
        retry=retry_if_exception_type(CommitFailedError),
        stop=stop_after_attempt(COMMIT_RETRIES),
        wait=wait_incrementing(start=0.5, increment=0.5),
        reraise=True,
    )


# Delta's default deletedFileRetentionDuration (a week): the shortest vacuum retention allowed by default.
MIN_RETENTION_HOURS = 168


def sql_literal(value: str) -> str:
    """A string as a SQL literal in a delta-rs predicate."""
    return "'" + str(value).replace("'", "''") + "'"


class TablesUnavailable(RuntimeError):
    """The tables root cannot be written; the message names the setting to fix."""


class DeltaTables(ConfigurableResource):
    """Reads with polars, writes idempotent merges with deltalake."""

    root_uri: str = Field(description="Folder or bucket URI under which each table is <root>/<name>")
    storage_options: dict[str, str] = Field(
        default_factory=dict, description="deltalake storage options (credentials, endpoint) for object stores"
    )

    def table_uri(self, name: str) -> str:
        return f"{self.root_uri.rstrip('/')}/{name}"

    def _options(self) -> dict[str, str] | None:
        return self.storage_options or None

    def setup_for_execution(self, context: InitResourceContext) -> None:
        # Before the step (or sensor tick) does any work: a root it cannot write fails now, not
        # after every file is hashed and behind a "table not found".
        self.check_writable()
        # Every writing step holds this resource: a step whose run process died stops before it commits.
        exit_with_run_process()

    def check_writable(self) -> None:
        """A local root must exist (it is created) and take a file; raises ``TablesUnavailable``
        naming VIDEO_TABLES_URI otherwise. Object-store roots are checked by their first request."""
        if "://" in self.root_uri and not self.root_uri.startswith("file://"):
            return
        root = Path(self.root_uri.removeprefix("file://"))
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=root, prefix=".preflight-"):
                pass
        except OSError as exc:
            raise TablesUnavailable(
                f"the tables folder {root} is not writable ({exc.__class__.__name__}: {exc.strerror or exc}); "
                "fix its permissions or set VIDEO_TABLES_URI to a writable folder or bucket"
            ) from exc

    def exists(self, name: str) -> bool:
        return DeltaTable.is_deltatable(self.table_uri(name), storage_options=self._options())

    def read(self, name: str, schema: pa.Schema | None = None, where: pl.Expr | None = None) -> pl.DataFrame:
        """The table, or the rows matching ``where`` (pushed down to Delta: files whose statistics
        exclude it are never read, so a batch's read does not grow with the archive); an empty frame of
        ``schema`` when the table does not exist yet."""
        try:
            if where is None:
                return pl.read_delta(self.table_uri(name), storage_options=self._options())
            return pl.scan_delta(self.table_uri(name), storage_options=self._options()).filter(where).collect()
        except Exception:  # polars reports a missing table in several error types: only that is empty
            if self.exists(name):
                raise
        if schema is None:
            return pl.DataFrame()
        return pl.from_arrow(schema.empty_table())

    def duplicate_keys(self, name: str, keys: list[str]) -> int:
        """Keys held by more than one row in the whole table (only the key columns are read); 0 when
        the table does not exist. The per-batch ``unique_key`` checks cannot see a key repeated across
        batches; the maintenance job counts them here."""
        if not self.exists(name):
            return 0
        scan = pl.scan_delta(self.table_uri(name), storage_options=self._options()).select(keys)
        return scan.group_by(keys).len().filter(pl.col("len") > 1).select(pl.len()).collect().item()

    def batch(self, name: str, batch: str, schema: pa.Schema | None = None) -> pl.DataFrame:
        """One upload batch's rows."""
        return self.read(name, schema, where=pl.col("batch_key") == batch)

    def batches(self, name: str, batches: list[str], schema: pa.Schema | None = None) -> pl.DataFrame:
        """The rows of several upload batches (a backfill's range run in one step), pushed down like ``batch``."""
        if len(batches) == 1:
            return self.batch(name, batches[0], schema)
        return self.read(name, schema, where=pl.col("batch_key").is_in(list(batches)))

    def row_count(self, name: str) -> int:
        """Rows in the table, from the Delta log's file statistics (no data file is read)."""
        if not self.exists(name):
            return 0
        actions = DeltaTable(self.table_uri(name), storage_options=self._options()).get_add_actions(flatten=True)
        return int(sum(n or 0 for n in actions.column("num_records").to_pylist()))

    def version(self, name: str) -> int | None:
        if not self.exists(name):
            return None
        return DeltaTable(self.table_uri(name), storage_options=self._options()).version()

    def merge(
        self,
        name: str,
        rows: pa.Table,
        keys: list[str],
        update: bool = True,
        update_predicate: str | None = None,
        keep: tuple[str, ...] = (),
        scope: str | None = None,
    ) -> dict:
        """Upsert ``rows`` keyed by ``keys``: rerunning the same rows changes nothing.

        ``update=False`` keeps existing rows untouched (first write wins); ``keep`` names columns a
        matched row keeps (e.g. ``registered_at``); ``update_predicate`` limits which matches update.
        ``scope``: a key column whose values in ``rows`` bound the rows that can match (e.g. the manifest's
        ``uri``), so target files whose statistics exclude them are skipped, as a batch's are.
        New columns of ``rows`` are added to the table.
        """
        uri = self.table_uri(name)
        if not self.exists(name):
            # Created empty, then merged like any other write: a first write that created the table with
            # its rows was a blind append, and two first writers at once left every key twice.
            self.create(name, rows.schema)
        if rows.num_rows == 0:
            return {"num_target_rows_inserted": 0}
        predicate = " AND ".join(f"t.{k} = s.{k}" for k in keys)
        if name in BATCH_SCOPED and "batch_key" in rows.column_names:
            scope = "batch_key"
        if scope is not None:
            # The target files of other batches (other files) are skipped (their statistics exclude these
            # values): a batch's merge costs the same in a year-old archive as in a new one.
            values = sorted(set(rows.column(scope).to_pylist()))
            predicate = f"t.{scope} IN ({', '.join(sql_literal(v) for v in values)}) AND {predicate}"
        for attempt in _commit_attempts():
            with attempt:  # each attempt merges against the table as it is now
                table = DeltaTable(uri, storage_options=self._options())
                merger = table.merge(rows, predicate=predicate, source_alias="s", target_alias="t", merge_schema=True)
                if update:
                    updates = {c: f"s.{c}" for c in rows.column_names if c not in keep}
                    merger = merger.when_matched_update(updates=updates, predicate=update_predicate)
                result = merger.when_not_matched_insert_all().execute()
        return result

    def create(self, name: str, schema: pa.Schema) -> bool:
        """Create the table, empty, with ``schema``, unless it exists; True when this call created it. Two
        creators at once: one commits the table's first version, the other finds it there."""
        try:
            DeltaTable.create(self.table_uri(name), schema=schema, mode="ignore", storage_options=self._options())
        except Exception:  # lost the race for the first commit: the table is there now
            if not self.exists(name):
                raise
            return False
        return True

    def replace(self, name: str, rows: pa.Table, column: str, values: list[str]) -> dict:
        """Replace the rows whose ``column`` is one of ``values`` (e.g. one batch's) with ``rows``, in one
        commit: a crash leaves either the old rows or the new ones, never none (a delete then a merge was
        two commits). Every row of ``rows`` must have one of ``values`` (delta-rs checks it). Creates the
        table, with ``rows``' schema, when it does not exist."""
        return self.replace_where(name, rows, {column: values})

    def replace_where(self, name: str, rows: pa.Table, selection: dict[str, list]) -> dict:
        """``replace`` for rows selected by several columns (``{column: values}``, all must match): e.g.
        some videos' captions for one model and prompt. Files whose statistics exclude the selection are
        not touched, so the cost does not grow with the table. Columns ``rows`` has and the table lacks
        are added first (a schema-only commit)."""
        if not selection or not all(selection.values()):
            raise ValueError("replace needs at least one value per column to select the rows it replaces")
        predicate = " AND ".join(
            f"{column} IN ({', '.join(str(int(v)) if isinstance(v, int) else sql_literal(v) for v in values)})"
            for column, values in selection.items()
        )
        uri = self.table_uri(name)
        if self.exists(name) or not self.create(name, rows.schema):  # created first, as merge does
            self._add_missing_columns(name, rows.schema)
        for attempt in _commit_attempts():
            with attempt:
                write_deltalake(uri, rows, mode="overwrite", predicate=predicate, storage_options=self._options())
        return {"num_target_rows_inserted": rows.num_rows}

    def _add_missing_columns(self, name: str, schema: pa.Schema) -> None:
        """Tables made before a column existed get it (nullable), so new rows can be written."""
        from deltalake.schema import Field as DeltaField

        table = DeltaTable(self.table_uri(name), storage_options=self._options())
        have = set(table.schema().to_arrow().names)
        missing = [f for f in schema if f.name not in have]
        if missing:
            table.alter.add_columns([DeltaField.from_arrow(f.with_nullable(True)) for f in missing])

    def maintain(
        self, name: str, retention_hours: int = MIN_RETENTION_HOURS, allow_short_retention: bool = False
    ) -> dict:
        """Compact small files (every merge adds some), then vacuum files unreferenced for longer
        than ``retention_hours``: a week by default, so readers of older versions never break.

        Below ``MIN_RETENTION_HOURS`` vacuum may delete files a concurrent writer has staged but not
        yet committed, so a shorter retention is refused unless ``allow_short_retention`` (only for
        when nothing else writes the tables)."""
        if retention_hours < MIN_RETENTION_HOURS and not allow_short_retention:
            raise ValueError(
                f"retention_hours={retention_hours} is below the {MIN_RETENTION_HOURS} h floor: vacuum could delete "
                "files a running batch has written but not committed yet. Set allow_short_retention=true "
                "(maintain_tables op config) only when no run writes the tables."
            )
        if not self.exists(name):
            return {"table": name, "skipped": "does not exist"}
        table = DeltaTable(self.table_uri(name), storage_options=self._options())
        compacted = table.optimize.compact()
        table.create_checkpoint()  # readers start here instead of replaying every commit since the last one
        # delta-rs's own check stays on (it also honours a table's deletedFileRetentionDuration) unless
        # the operator explicitly allowed a short retention.
        removed = table.vacuum(
            retention_hours=retention_hours, dry_run=False, enforce_retention_duration=not allow_short_retention
        )
        return {
            "table": name,
            "files_added": compacted.get("numFilesAdded", 0),
            "files_removed": compacted.get("numFilesRemoved", 0),
            "vacuumed": len(removed),
        }

    def delete(self, name: str, predicate: str) -> None:
        if self.exists(name):
            DeltaTable(self.table_uri(name), storage_options=self._options()).delete(predicate)
