"""Pure embedding, OCR and similarity helpers for the searchable archive (no Dagster imports)."""
