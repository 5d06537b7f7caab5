"""Dagster objects, one folder per pipeline stage (assets, checks, jobs, schedules, sensors);
``video_assets.definitions`` composes them. Pure logic lives in ``video_assets.core``."""
