"""The source a piece of code runs: a module's import closure within the package, found from the imports
themselves (no hand-kept list to forget), and a digest of it. Stages' code versions and Serve applications'
names both come from here, so each changes with exactly the code it runs."""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # video_assets/


def _module_file(module: str, root: Path) -> Path | None:
    """The file of a ``video_assets`` module below ``root`` (the package folder), or None."""
    parts = module.split(".")
    if parts[0] != "video_assets":
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _parse(path: Path, tries: int = 5) -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's SystemError "AST constructor recursion depth mismatch":
    its AST module keeps one recursion counter for all threads, so a parse on another thread at the same
    moment (Ray's, Dagster's) breaks this one (python/cpython#106905)."""
    text = path.read_text()
    for attempt in range(tries):
        try:
            return ast.parse(text, filename=str(path))
        except SystemError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def imported_names(path: Path) -> set[str]:
    """Every absolute name ``path`` imports, at module level or inside functions; ``from x import y``
    gives both ``x`` and ``x.y`` (y may be a module of package x)."""
    names = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def imports(path: Path, root: Path) -> set[Path]:
    """Project files ``path`` imports (``imported_names`` that are files of the package). Each file is parsed once
    per process while its stamp holds: every stage's closure walks the same shared modules (importing the
    definitions parsed about 650 files, 1.7 s of its 4.2 s)."""
    stat = path.stat()
    return set(_imports(path, root, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4096)
def _imports(path: Path, root: Path, mtime_ns: int, size: int) -> frozenset[Path]:
    return frozenset(f for name in imported_names(path) if (f := _module_file(name, root)) is not None)


def closure(start: list[Path], root: Path = PACKAGE) -> list[Path]:
    """``start`` and every package file it imports, transitively."""
    todo = list(start)
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(imports(path, root) - seen)
    return sorted(seen)


def files_digest(files: list[Path], root: Path = PACKAGE) -> str:
    """A short digest of ``files`` (their paths below ``root`` and contents)."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def module_digest(module_file: str | Path, root: Path = PACKAGE) -> str:
    """``files_digest`` of a module's import closure: what its code computes depends on nothing else here."""
    return files_digest(closure([Path(module_file).resolve()], root), root)
