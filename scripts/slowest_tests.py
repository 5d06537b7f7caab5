"""`make slowest`: the slowest tests of the last runs, from pytest's junit files (each test's own time,
setup and teardown included), so a reviewer sees where the suite's time goes.

    python scripts/slowest_tests.py artifacts/junit.xml [artifacts/junit-e2e.xml ...] [--top 20]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def cases(path: Path) -> list[tuple[float, str, str]]:
    """(seconds, test id, outcome) of every test case in a junit file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out.append((float(case.get("time") or 0.0), name, outcome))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    found = [f for f in args.files if f.exists()]
    if not found:
        print(f"no junit file among {[str(f) for f in args.files]}: run make test first", file=sys.stderr)
        return 1
    everything = sorted((c for f in found for c in cases(f)), reverse=True)
    total = sum(c[0] for c in everything)
    print(f"{len(everything)} tests, {total / 60:.1f} min of test time in {', '.join(map(str, found))}")
    for seconds, name, outcome in everything[: args.top]:
        print(f"{seconds:8.1f}s  {name}{'' if outcome == 'passed' else f'  ({outcome})'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
