"""export_training_frames: the kept frames, their descriptions and image bytes as Parquet shards with a
manifest, read from one version of the frames table (reproducible: export the same version again)."""

from datetime import UTC, datetime

from dagster import Config, Failure, MetadataValue, OpExecutionContext, job, op
from pydantic import Field

from resources.curation import CurationStore
from resources.delta import DeltaTables
from video_assets.core.curation.export import export_frames
from video_assets.core.tables import CURATED_FRAMES


class ExportConfig(Config):
    table_version: int | None = Field(default=None, description="Delta version of the frames table; None: latest")
    curation_version: str | None = Field(default=None, description="Only rows of this curation_version; None: all")
    name: str | None = Field(
        default=None, description="Sub-folder of the exports folder; None: frames-v<table version>"
    )
    shard_rows: int = Field(default=1000, ge=1, description="Rows per Parquet shard")


@op(tags={"stage": "curation"})
def export_training_frames_op(
    context: OpExecutionContext, config: ExportConfig, tables: DeltaTables, curation: CurationStore
) -> dict:
    if not tables.exists(CURATED_FRAMES):
        raise Failure("the frames table does not exist yet: materialise frames first", allow_retries=False)
    version = config.table_version if config.table_version is not None else tables.version(CURATED_FRAMES)
    name = config.name or f"frames-v{version}" + (f"-{config.curation_version}" if config.curation_version else "")
    out = curation.export_path(name)
    manifest = export_frames(
        tables.table_uri(CURATED_FRAMES),
        out,
        version=version,
        curation_version=config.curation_version,
        shard_rows=config.shard_rows,
        storage_options=tables.storage_options or None,
    )
    context.add_output_metadata(
        {
            "path": MetadataValue.path(str(out)),
            "table_version": MetadataValue.int(manifest["table_version"]),
            "rows": MetadataValue.int(manifest["rows"]),
            "shards": MetadataValue.int(len(manifest["shards"])),
            "exported_at": MetadataValue.text(datetime.now(UTC).isoformat()),
        }
    )
    context.log.info(f"exported {manifest['rows']} frames of table version {version} to {out}")
    return manifest


@job(tags={"stage": "curation"}, description=__doc__)
def export_training_frames():
    export_training_frames_op()
