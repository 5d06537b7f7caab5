"""make bench: one table, each measurement ours vs a baseline measured in the same run, the ratio and
the target (issue "Performance"). Sections (scripts/bench/<name>.py, each ``rows(clips, work)``):

- probe: the probe vs one ffprobe per file and vs a bare header open;
- sampling: frame sampling vs the ffmpeg CLI at 1 fps and vs a keyframe-only decode, total CPU time;
- frames: bytes per segment through the object store (JPEG vs raw), and the caption frames the later
  stages need read from sampled_frames vs decoded again (frames decoded per frame used);
- delta: a new batch's Delta work with 1,000 batches in the table vs 1;
- pipeline: a 2-clip vs a 20-clip batch through the real captions asset, and batch wall time vs its
  decode + generation time;
- throughput: the throughput model's predictions vs measured batches;
- archive: transcription vs real time, frame embedding vs decoding the frames, text embedding rate;
- latency: a live camera (HLS) recorded, sensed and run batch by batch: median detected_after_s vs the
  segment length;
- models: a verified 2 GB model folder's second use vs its first hash, and the bytes a step that does not
  run the engine fetches of it.

Clips: ../shared/samples (the bundled samples/ when absent) plus the longer clips the sampling section
generates. Needs the ffmpeg and ffprobe CLIs (`make bench` installs Debian's ffmpeg when missing).

    .venv/bin/python -m scripts.bench [--only probe,sampling] [--markdown OUT] [--work DIR]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("probe", "sampling", "frames", "delta", "ticks", "pipeline", "throughput", "archive", "latency", "models")
NO_VIDEO = {"models", "ticks"}  # sections that decode no video (no ffmpeg needed)
SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mpg", ".mov")


def corpus() -> tuple[str, list[Path]]:
    shared = ROOT.parent / "shared" / "samples"
    folder = shared if shared.is_dir() else ROOT / "samples"
    return str(folder), sorted(p for p in folder.iterdir() if p.suffix.lower() in SUFFIXES)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt_ratio(ratio: float) -> str:
    """Two decimals; two significant digits below 0.1 (a 1 % target would otherwise read 0.00)."""
    return f"{ratio:.2g}" if 0 < abs(ratio) < 0.1 else f"{ratio:.2f}"


def table(results: list[tuple[str, dict]]) -> str:
    lines = [
        "| section | measurement | ours | baseline | baseline time | ratio | target | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for section, r in results:
        note = str(r.get("note", "")).replace("|", "/")
        lines.append(
            f"| {section} | {r['measurement']} | {r.get('ours_text') or _fmt_s(r['ours_s'])} | {r['baseline']} | "
            f"{r.get('baseline_text') or _fmt_s(r['baseline_s'])} | {_fmt_ratio(r['ratio'])} | {r['target']} | {note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--work", default="/tmp/video-assets-bench", help="generated clips and tables (kept)")
    ap.add_argument("--markdown", help="also write the table here")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    names = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := [name for name in names if name not in SECTIONS]:
        raise SystemExit(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    missing = [tool for tool in ("ffmpeg", "ffprobe") if not shutil.which(tool)]
    if missing and set(names) - NO_VIDEO:
        raise SystemExit(f"bench needs the {' and '.join(missing)} CLI (Debian: apt-get install ffmpeg)")
    folder, clips = corpus()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results, took = [], {}
    for name in names:
        started = time.perf_counter()
        rows = importlib.import_module(f"scripts.bench.{name}").rows(clips, work)
        took[name] = time.perf_counter() - started
        results += [(name, r) for r in rows]
        print(f"[bench] {name}: {len(rows)} rows in {took[name]:.0f} s", file=sys.stderr, flush=True)
    header = (
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"corpus: {folder} ({len(clips)} clips); sections took " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items())
    )
    text = f"{header}\n\n{table(results)}\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
