"""Writes made outside a run (the review page, the live recorder) reported to the Dagster instance as
materialisations of their table's asset (an ``AssetSpec`` of the graph), so lineage and staleness see them."""

from __future__ import annotations

from typing import Any

from dagster import AssetMaterialization, DagsterInstance


def report_write(table: str, metadata: dict[str, Any] | None = None, partition: str | None = None) -> None:
    """A runless materialisation of ``table`` on this process's instance (DAGSTER_HOME)."""
    with DagsterInstance.get() as instance:
        instance.report_runless_asset_event(AssetMaterialization(table, partition=partition, metadata=metadata or {}))
