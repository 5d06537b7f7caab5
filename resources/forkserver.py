"""Preloaded by the multiprocess executor's forkserver only (``video_assets/defs/ingest/jobs.py``): the forkserver
dies with the run process that started it (``resources.lifetime.forkserver_ends_with_its_run``). Importing it
anywhere else does nothing."""

import sys

from resources.lifetime import forkserver_ends_with_its_run

# The forkserver is ``python -c 'from multiprocessing.forkserver import main; main(...)'``; a step forked from it
# has this module imported already, so the line below never runs there.
if sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules and sys.modules["__main__"].__spec__ is None:
    forkserver_ends_with_its_run()
