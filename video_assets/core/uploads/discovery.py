"""Pure logic of upload discovery: which listed files are new, which are duplicates, how they form batches.

Nothing here touches Dagster or storage, so each rule has a plain unit test.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO

DEFAULT_BATCH_SIZE = 50
HASH_CHUNK = 8 * 1024 * 1024  # streamed: a 10 GB file never sits in memory


@dataclass(frozen=True)
class VolumeFile:
    uri: str  # what the rest of the pipeline opens: a local path or a full object-store URI
    size_bytes: int
    mtime: float  # seconds since the epoch


@dataclass(frozen=True)
class Refused:
    """A volume entry that is never read (a link, a special file), with the reason; reported, not dropped."""

    uri: str
    reason: str


@dataclass(frozen=True)
class Listing:
    files: list[VolumeFile]
    refused: list[Refused]


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """``text`` safe for one log line: control, format (bidi overrides) and line-separator
    characters escaped, so a file name with a newline cannot forge a second log line."""
    out = []
    for ch in str(text):
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def sha256_stream(stream: IO[bytes], chunk: int = HASH_CHUNK) -> str:
    """The video_id: sha256 of the bytes, read in chunks."""
    digest = hashlib.sha256()
    while True:
        block = stream.read(chunk)
        if not block:
            return digest.hexdigest()
        digest.update(block)


def fingerprint(f: VolumeFile) -> tuple[str, int, int]:
    """Identity of a listing entry: a changed size or mtime means new bytes to hash."""
    return (f.uri, f.size_bytes, int(round(f.mtime * 1_000_000)))


def listing_digest(files: Iterable[VolumeFile], refused: Iterable[Refused] = ()) -> str:
    """Cheap digest of a whole listing; the sensor's cursor, so an unchanged volume costs one listing."""
    entries = sorted(fingerprint(f) for f in files)
    # Refused names may hold undecodable bytes (lone surrogates): escaped, so the digest never fails.
    payload = json.dumps([entries, sorted((printable(r.uri), r.reason) for r in refused)])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Discovery:
    uri: str
    size_bytes: int
    mtime: float
    video_id: str
    duplicate_of: str | None  # uri already registered with the same bytes


def discover(
    files: Iterable[VolumeFile],
    seen: set[tuple[str, int, int]],
    known_ids: Mapping[str, str] | Callable[[list[str]], Mapping[str, str]],
    hasher: Callable[[str], str],
    max_files: int | None = None,
    unreadable: list[Refused] | None = None,
) -> tuple[list[Discovery], int]:
    """Hash the files not seen before; mark those whose bytes are already known as duplicates.

    ``seen``: fingerprints already in the manifest; ``known_ids``: video_id -> uri registered, or a function
    that answers that for the ids just hashed (so a caller looks up only those, not the whole archive).
    Returns the discoveries and how many new files were left for a later call (``max_files``).
    ``unreadable``: when given, a file the hasher cannot read (``OSError``: no permission, gone, a
    link swapped in) is appended with the reason instead of failing the whole listing; it is not in
    the manifest, so a later call tries it again.
    """
    fresh = [f for f in sorted(files, key=lambda f: f.uri) if fingerprint(f) not in seen]
    hashed: list[tuple[VolumeFile, str]] = []
    tried = 0
    for f in fresh:
        if max_files is not None and len(hashed) >= max_files:
            break  # unreadable files do not count against the bound: they cannot starve the rest
        tried += 1
        try:
            hashed.append((f, hasher(f.uri)))
        except OSError as exc:
            if unreadable is None:
                raise
            unreadable.append(Refused(f.uri, f"not readable: {exc.__class__.__name__}: {exc.strerror or exc}"))
    known = known_ids(sorted({vid for _, vid in hashed})) if callable(known_ids) else known_ids
    ids: dict[str, str] = {}  # the bytes this call registers, first file first
    out = []
    for f, vid in hashed:
        dup = known.get(vid) or ids.get(vid)
        if dup is None:
            ids[vid] = f.uri
        out.append(Discovery(f.uri, f.size_bytes, f.mtime, vid, dup))
    return out, len(fresh) - tried


def batch_key(video_ids: Iterable[str], now: datetime) -> str:
    """``b20261202T120000-1a2b3c4d``: sorts by time in the UI; the suffix is derived from the content."""
    digest = hashlib.sha256("\n".join(sorted(video_ids)).encode()).hexdigest()[:8]
    return f"b{now.astimezone(UTC):%Y%m%dT%H%M%S}-{digest}"


def plan_batches(
    discoveries: Iterable[Discovery], now: datetime, batch_size: int = DEFAULT_BATCH_SIZE
) -> dict[str, list[Discovery]]:
    """Group the non-duplicate discoveries into batches of at most ``batch_size``, in uri order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    unique = sorted((d for d in discoveries if d.duplicate_of is None), key=lambda d: d.uri)
    batches: dict[str, list[Discovery]] = {}
    for i in range(0, len(unique), batch_size):
        chunk = unique[i : i + batch_size]
        batches[batch_key((d.video_id for d in chunk), now)] = chunk
    return batches


def manifest_rows(
    discoveries: Iterable[Discovery], batches: Mapping[str, list[Discovery]], now: datetime
) -> list[dict]:
    """One manifest row per discovery: its batch, or the uri it duplicates. Nothing is dropped."""
    key_of = {d.uri: key for key, ds in batches.items() for d in ds}
    rows = []
    for d in discoveries:
        rows.append(
            {
                "uri": d.uri,
                "size_bytes": d.size_bytes,
                "mtime": datetime.fromtimestamp(d.mtime, tz=UTC),
                "video_id": d.video_id,
                "status": "duplicate" if d.duplicate_of else "batched",
                "batch_key": key_of.get(d.uri),
                "duplicate_of": d.duplicate_of,
                "discovered_at": now,
            }
        )
    return rows
