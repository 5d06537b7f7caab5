"""Whether the process that started something is still the one running under its pid."""

from __future__ import annotations

import psutil

# psutil's create_time and Dagster's event timestamps come from different clocks' roundings.
CLOCK_SLACK_S = 2.0


def still_running(pid: int, seen_at: float) -> bool:
    """True when ``pid`` is alive and its process already existed at ``seen_at`` (a Unix time when the
    process was known to run, e.g. its run's start event). A process created later is a reuse of the
    pid by something else; a zombie has exited."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= seen_at + CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return False
