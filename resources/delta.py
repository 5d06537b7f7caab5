"""Delta Lake tables: one folder (or bucket prefix) holds every table, one sub-path per asset."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
from dagster import ConfigurableResource, InitResourceContext
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from pydantic import Field

from resources.lifetime import exit_with_run_process

COMMIT_RETRIES = 5  # concurrent runs of different batches may race on a commit; delta-rs reports it


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

    def read(self, name: str, schema: pa.Schema | None = None) -> pl.DataFrame:
        """The whole table; an empty frame of ``schema`` when the table does not exist yet."""
        try:
            return pl.read_delta(self.table_uri(name), storage_options=self._options())
        except (TableNotFoundError, FileNotFoundError):
            if schema is None:
                return pl.DataFrame()
            return pl.from_arrow(schema.empty_table())

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
    ) -> dict:
        """Upsert ``rows`` keyed by ``keys``: rerunning the same rows changes nothing.

        ``update=False`` keeps existing rows untouched (first write wins); ``keep`` names columns a
        matched row keeps (e.g. ``registered_at``); ``update_predicate`` limits which matches update.
        """
        uri = self.table_uri(name)
        if not self.exists(name):
            try:
                write_deltalake(uri, rows, mode="error", storage_options=self._options())
                return {"num_target_rows_inserted": rows.num_rows, "created": True}
            except Exception:  # another run created it first: fall through to a merge
                if not self.exists(name):
                    raise
        if rows.num_rows == 0:
            return {"num_target_rows_inserted": 0}
        predicate = " AND ".join(f"t.{k} = s.{k}" for k in keys)
        for attempt in range(COMMIT_RETRIES):
            try:
                table = DeltaTable(uri, storage_options=self._options())
                merger = table.merge(rows, predicate=predicate, source_alias="s", target_alias="t")
                if update:
                    updates = {c: f"s.{c}" for c in rows.column_names if c not in keep}
                    merger = merger.when_matched_update(updates=updates, predicate=update_predicate)
                return merger.when_not_matched_insert_all().execute()
            except CommitFailedError:
                if attempt == COMMIT_RETRIES - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def maintain(self, name: str, retention_hours: int = 168) -> dict:
        """Compact small files (every merge adds some), then vacuum files unreferenced for longer
        than ``retention_hours``: a week by default, so readers of older versions never break."""
        if not self.exists(name):
            return {"table": name, "skipped": "does not exist"}
        table = DeltaTable(self.table_uri(name), storage_options=self._options())
        compacted = table.optimize.compact()
        removed = table.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False)
        return {
            "table": name,
            "files_added": compacted.get("numFilesAdded", 0),
            "files_removed": compacted.get("numFilesRemoved", 0),
            "vacuumed": len(removed),
        }

    def delete(self, name: str, predicate: str) -> None:
        if self.exists(name):
            DeltaTable(self.table_uri(name), storage_options=self._options()).delete(predicate)
