"""What every stage's Dagster objects share, stated once: owners, groups and tags; code versions
computed from the source each stage runs; table metadata; and the key checks every table asset gets
from its declared key (``core.tables.KEYS``) and non-null columns."""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetKey,
    BackfillPolicy,
    Backoff,
    DataVersion,
    FloatMetadataValue,
    IntMetadataValue,
    Jitter,
    MaterializeResult,
    MetadataValue,
    RetryPolicy,
    TableColumn,
    TableSchema,
    multi_asset_check,
)

from resources.delta import DeltaTables
from video_assets.core.previews import markdown_table
from video_assets.core.sources import closure, files_digest, imported_names  # noqa: F401 (imported_names: tests)
from video_assets.core.tables import KEYS, SCHEMAS, required_columns
from video_assets.core.uploads.discovery import printable

OWNERS = ["team:video-platform"]
# Steps that hold a model engine: limited together by the instance (dagster.yaml `concurrency.pools`).
ACCELERATOR_POOL = "accelerator"
PACKAGE = Path(__file__).resolve().parents[1]
# For steps whose writes are idempotent (keyed merges, one-commit replacements, registrations keyed by
# content): a transient storage or MLflow error is worth two more tries, about 5 s and 15 s later
# (jittered, so runs that failed together do not retry together). A step that is not idempotent (one
# that records a new decision or MLflow run) gets none; errors a retry cannot fix are raised as
# Failure(allow_retries=False).
TRANSIENT_RETRY = RetryPolicy(max_retries=2, delay=5, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS)

# Data files a stage reads as code (a new prompt text is a new caption prompt), beside its import closure.
STAGE_DATA: dict[str, tuple[str, ...]] = {"models": ("prompts",)}


def import_closure(stage: str, root: Path = PACKAGE) -> list[Path]:
    """Every ``video_assets`` source file the stage's Dagster objects run: its defs folder and what it
    imports, transitively. (Resources are left out: they say where data lives, not what is computed.)"""
    return closure(sorted((root / "defs" / stage).glob("*.py")), root)


def stage_files(stage: str, root: Path = PACKAGE) -> list[Path]:
    """What a stage's code version covers: its import closure and its data files."""
    data = [f for rel in STAGE_DATA.get(stage, ()) for f in (root / rel).rglob("*") if f.is_file()]
    return sorted({*import_closure(stage, root), *data})


def source_digest(stage: str, root: Path = PACKAGE) -> str:
    """Hash of the files a stage runs (``stage_files``): any change to them is a new code version, so
    Dagster's staleness view flags the stage's materialisations as out of date."""
    return files_digest(stage_files(stage, root), root)


STAGES = sorted(p.name for p in (PACKAGE / "defs").iterdir() if (p / "__init__.py").is_file())
CODE_VERSIONS = {stage: source_digest(stage) for stage in STAGES}


def column_schema(name: str) -> TableSchema:
    """``dagster/column_schema`` for a table, from its pyarrow schema."""
    return TableSchema(
        columns=[
            TableColumn(name=f.name, type=str(f.type), description=(f.metadata or {}).get(b"doc", b"").decode())
            for f in SCHEMAS[name]
        ]
    )


def stage_asset(stage: str, table: str | None = None, kinds: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    """Keyword arguments of ``@asset``/``AssetSpec`` for an asset of ``stage``: group, owners, stage tag,
    the stage's code version and, for a table asset, its column schema and the ``delta`` kind."""
    metadata = dict(extra.pop("metadata", {}))
    if table is not None:
        metadata["dagster/column_schema"] = column_schema(table)
    return dict(
        group_name=stage,
        owners=OWNERS,
        tags={"stage": stage, **extra.pop("tags", {})},
        code_version=CODE_VERSIONS[stage],
        kinds={*kinds, *(("delta",) if table is not None else ())},
        metadata=metadata,
        **extra,
    )


# The tag every per-batch asset carries (batch_asset sets it): the batch_pipeline job selects by it.
PER_BATCH_TAG = ("partitions", "video_batches")
# Per-batch assets take a backfill's range of batches in one run (one step per asset): the step's
# resources (Ray, loaded models, the MLflow and Delta clients) start once, not once a batch.
SINGLE_RUN = BackfillPolicy.single_run()
# Counts that describe the whole table, not the batch: in a range run they are the last batch's.
TABLE_WIDE = ("table_row_count", "total_rows")
# Versions a later stage reads back (lineage): identities, never summed. A range run's batches share them
# (captions resolves one pair per run); each batch's own is under ``per_batch`` too.
IDENTITIES = ("prompt_version",)


def per_batch(context, body: Callable[[str], MaterializeResult | Iterable[MaterializeResult]]) -> list:
    """``body(batch)`` for each batch of the run, in partition order: one batch (a sensor's run), or a
    backfill's range (``SINGLE_RUN``), as sequential runs would do them. Returns ``body``'s results for
    one batch; for several, one result per asset (``merge_batches``)."""
    batches = list(context.partition_keys)
    results = []
    for batch in batches:
        out = body(batch)
        results.append([out] if isinstance(out, MaterializeResult) else list(out))
        if len(batches) > 1:
            context.log.info(f"batch {batch} done ({len(results)}/{len(batches)})")
    if len(batches) == 1:
        return results[0]
    return [merge_batches(batches, [r[i] for r in results]) for i in range(len(results[0]))]


class OneLinePerCall(logging.Filter):
    """Every message of a step's log escaped in one place (``printable``): a file name or a model's
    output with a newline, a tab or a bidi override cannot forge or hide a line of stdout or of the
    Dagster event log, whichever log call carries it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = printable(record.getMessage()), ()
        return True


def escaped_log(context) -> None:
    """Install ``OneLinePerCall`` on the step's log (once)."""
    if not any(isinstance(f, OneLinePerCall) for f in context.log.filters):
        context.log.addFilter(OneLinePerCall())


def batch_asset(stage: str, table: str | None = None, *, kinds: tuple[str, ...] = (), specs=None, **asset_kwargs):
    """The one definition of a per-batch asset (``specs``: a multi-asset of several tables).

    Decorates ``body(context, batch, <config>, <resources>...)``, the work of one upload batch. The
    asset it returns owns what every per-batch asset shares: the ``video_batches`` partitions, the
    single-run backfill policy (a backfill's range is one step: Ray, models and clients start once),
    the stage's group, owners, code version and table schema, the loop over the run's batches in
    partition order and the merge of their metadata (``per_batch``). Dagster reads the config and
    resources from ``body``'s own signature, less ``batch``. A body that takes ``batches`` instead
    gets the run's whole range at once (captions: one Ray job for a backfill's range)."""
    from dagster import asset, multi_asset

    from video_assets.defs.partitions import video_batches

    def decorate(body: Callable):
        signature = inspect.signature(body)
        params = [p for name, p in signature.parameters.items() if name not in ("batch", "batches")]

        if "batches" in signature.parameters:

            def step(context, **resources):
                escaped_log(context)
                return body(context, list(context.partition_keys), **resources)

        elif specs is None:

            def step(context, **resources):
                escaped_log(context)
                [result] = per_batch(context, lambda batch: body(context, batch, **resources))
                return result

        else:

            def step(context, **resources):
                escaped_log(context)
                yield from per_batch(context, lambda batch: body(context, batch, **resources))

        step.__name__, step.__qualname__, step.__doc__ = body.__name__, body.__qualname__, body.__doc__
        step.__module__ = body.__module__
        step.__signature__ = signature.replace(parameters=params)
        step.__annotations__ = {k: v for k, v in body.__annotations__.items() if k not in ("batch", "batches")}
        if specs is None:
            return asset(
                partitions_def=video_batches,
                backfill_policy=SINGLE_RUN,
                **stage_asset(stage, table, kinds=kinds, tags=dict([PER_BATCH_TAG]), **asset_kwargs),
            )(step)
        return multi_asset(
            specs=[
                s.replace_attributes(partitions_def=video_batches, tags={**s.tags, **dict([PER_BATCH_TAG])})
                for s in specs
            ],
            backfill_policy=SINGLE_RUN,
            name=body.__name__,
            **asset_kwargs,
        )(step)

    return decorate


def merge_batches(batches: list[str], results: list[MaterializeResult]) -> MaterializeResult:
    """One asset's results for several batches as one (Dagster records it for each partition of the
    range): counts summed (table-wide ones and versions are the last batch's), other values the last batch's, every
    number per batch under ``per_batch``, and a data version over all the batches' versions."""
    metas = [dict(r.metadata or {}) for r in results]
    merged = dict(metas[-1])
    for key, value in metas[-1].items():
        if isinstance(value, IntMetadataValue) and key not in TABLE_WIDE + IDENTITIES:
            merged[key] = MetadataValue.int(sum(int(m[key].value or 0) for m in metas if key in m))
        elif isinstance(value, FloatMetadataValue):
            merged.pop(key)  # rates and times of one batch: kept per batch below
    numbers = {
        batch: {k: v.value for k, v in m.items() if isinstance(v, IntMetadataValue | FloatMetadataValue)}
        for batch, m in zip(batches, metas)
    }
    merged["batches"] = MetadataValue.int(len(batches))
    merged["per_batch"] = MetadataValue.json(numbers)
    versions = [r.data_version.value for r in results if r.data_version is not None]
    version = DataVersion(hashlib.sha256("\n".join(versions).encode()).hexdigest()[:16]) if versions else None
    return MaterializeResult(asset_key=results[-1].asset_key, data_version=version, metadata=merged)


def table_metadata(uri: str, partition_rows: pl.DataFrame, table_rows: int, columns: list[str] | None = None) -> dict:
    """Where the table is, how many rows this materialisation and the whole table hold, a preview."""
    return {
        "dagster/uri": MetadataValue.path(uri),
        "dagster/row_count": MetadataValue.int(partition_rows.height),
        "table_row_count": MetadataValue.int(table_rows),
        "preview": MetadataValue.md(markdown_table(partition_rows, columns)),
    }


def duplicate_keys(df: pl.DataFrame, keys: list[str]) -> list:
    """Key values present more than once (lists for composite keys)."""
    dups = df.group_by(keys).len().filter(pl.col("len") > 1)
    return [row[0] if len(keys) == 1 else list(row) for row in dups.select(keys).iter_rows()]


def null_counts(df: pl.DataFrame, columns: list[str]) -> dict[str, int]:
    return {c: n for c in columns if (n := int(df.get_column(c).null_count())) > 0}


def checked_batches(context: AssetCheckExecutionContext, table: str, asset: AssetKey) -> list[str] | None:
    """The upload batches a check of ``asset`` covers, or None for the whole table.

    A per-batch table's check covers the batch its run materialised, so its cost is a batch's, not
    the archive's: the run's partition(s), else (a check launched on its own) the partition of the
    asset's latest materialisation. A table without ``batch_key``, or an asset never materialised for
    a partition, is checked whole."""
    if "batch_key" not in SCHEMAS[table].names:
        return None
    if context.has_partition_key:
        return [context.partition_key]
    if context.has_partition_key_range:
        return list(context.partition_keys)
    event = context.instance.get_latest_materialization_event(asset)
    partition = event.dagster_event.partition if event is not None and event.dagster_event else None
    return [partition] if partition else None


def read_checked(tables: DeltaTables, table: str, batches: list[str] | None) -> pl.DataFrame:
    """The rows a check covers: those of ``batches`` (pushed down to Delta), else the whole table."""
    if batches is None:
        return tables.read(table, SCHEMAS[table])
    return tables.batches(table, batches, SCHEMAS[table])


def check_scope(batches: list[str] | None) -> dict:
    """Check metadata naming what was checked, so a pass is not read as covering the archive."""
    return {"scope": "batch" if batches else "table", "batches": batches or []}


def table_checks(table: str, asset: str | None = None):
    """``unique_key`` and ``required_columns`` checks of a table asset, evaluated in one step and
    generated from the table's declared key and its non-nullable columns. A per-batch table is checked
    over the batch just materialised (``checked_batches``): every key includes ``video_id`` and each
    video belongs to one batch, so a key repeated across the table is repeated within a batch."""
    key = AssetKey(asset or table)
    scope = "the batch just materialised" if "batch_key" in SCHEMAS[table].names else "the whole table"

    @multi_asset_check(
        name=f"{key.path[-1]}_table_checks",
        specs=[
            AssetCheckSpec(
                "unique_key", asset=key, description=f"No two rows of {scope} share ({', '.join(KEYS[table])})."
            ),
            AssetCheckSpec(
                "required_columns", asset=key, description=f"Non-nullable columns of {scope} hold no nulls."
            ),
        ],
    )
    def _checks(context, tables: DeltaTables):  # (unannotated: this module's annotations are strings)
        batches = checked_batches(context, table, key)
        df = read_checked(tables, table, batches)
        dups = duplicate_keys(df, KEYS[table])
        nulls = null_counts(df, required_columns(table))
        yield AssetCheckResult(
            check_name="unique_key",
            asset_key=key,
            passed=not dups,
            severity=AssetCheckSeverity.ERROR,
            metadata={**check_scope(batches), "rows": df.height, "duplicate_keys": dups[:20]},
        )
        yield AssetCheckResult(
            check_name="required_columns",
            asset_key=key,
            passed=not nulls,
            severity=AssetCheckSeverity.ERROR,
            metadata={**check_scope(batches), "rows": df.height, "null_counts": nulls},
        )

    return _checks


class CostBreakdown:
    """Where a step's wall time goes, for its metadata: the set-up before the asset body ran (resources:
    starting or joining Ray), the parts the body times, and what is left (Dagster, bookkeeping)."""

    def __init__(self, context):
        import time

        self._clock = time.perf_counter
        self._body_started = self._clock()
        self.parts: dict[str, float] = {"setup": _setup_seconds(context, time.time())}

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + max(0.0, float(seconds))

    def part(self, name: str):
        from contextlib import contextmanager

        @contextmanager
        def timed():
            started = self._clock()
            try:
                yield
            finally:
                self.add(name, self._clock() - started)

        return timed()

    def metadata(self, **busy: float) -> MetadataValue:
        """Seconds per part of the wall time (they sum to ``total``), plus ``busy`` figures that overlap
        it (e.g. CPU seconds summed over parallel decode tasks)."""
        body = self._clock() - self._body_started
        parts = {k: round(v, 3) for k, v in self.parts.items()}
        parts["other"] = round(max(0.0, body - sum(v for k, v in self.parts.items() if k != "setup")), 3)
        parts["total"] = round(body + self.parts["setup"], 3)
        return MetadataValue.json({"wall_s": parts, "busy_s": {k: round(v, 3) for k, v in busy.items()}})


# The events of a step that mark its own start: its resources' set-up (Ray), or the step itself when it
# has none. Not the first event carrying its key: ASSET_MATERIALIZATION_PLANNED comes at the run's start
# and STEP_WORKER_STARTING before a concurrency pool's wait, so other steps and queueing would count.
_SETUP_EVENTS = ("RESOURCE_INIT_STARTED", "STEP_START")


def _setup_seconds(context, now: float) -> float:
    """Seconds between this step's own start (its resources' set-up) and now: resource set-up, e.g. Ray."""
    try:
        step = context.get_step_execution_context().step.key
        times = [
            e.timestamp
            for e in context.instance.all_logs(context.run_id)
            if e.step_key == step and e.dagster_event is not None and e.dagster_event.event_type_value in _SETUP_EVENTS
        ]
        return max(0.0, now - min(times)) if times else 0.0
    except Exception:  # a breakdown must never fail the step
        return 0.0
