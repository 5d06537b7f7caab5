"""A model folder built once, whoever asks first: built in a private temporary folder beside ``dest``,
then renamed into place, so a reader never sees half a build and concurrent builders do not clash."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(dest: str | Path, is_complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """``dest`` when ``is_complete(dest)``; else ``build(tmp)`` into a temporary folder renamed to ``dest``
    (an incomplete ``dest`` is replaced; a concurrent builder that finished first wins)."""
    dest = Path(dest).expanduser().resolve()
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the built model is ordinary shared data
        if is_complete(dest):  # someone else finished first
            return dest
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        try:
            os.rename(tmp, dest)
        except OSError:
            if is_complete(dest):  # lost a race to a concurrent builder
                return dest
            raise
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
