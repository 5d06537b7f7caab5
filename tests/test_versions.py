"""Code versions follow the source a stage runs; every asset carries its stage's code version."""

import shutil
from pathlib import Path

from video_assets.defs.common import CODE_VERSIONS, PACKAGE, STAGE_SOURCES, source_digest


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "video_assets"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_stage_code_version_changes_with_its_own_source_only(tmp_path):
    root = _copy_package(tmp_path)
    before = {s: source_digest(p, root) for s, p in STAGE_SOURCES.items()}
    assert before == CODE_VERSIONS
    routing = root / "core" / "routing.py"
    routing.write_text(routing.read_text().replace("EXCERPT_CHARS = 300", "EXCERPT_CHARS = 200"))
    after = {s: source_digest(p, root) for s, p in STAGE_SOURCES.items()}
    assert {s for s in after if after[s] != before[s]} == {"routing"}
    # A shared schema change touches every stage.
    tables = root / "core" / "tables.py"
    tables.write_text(tables.read_text() + "\n# changed\n")
    assert all(source_digest(p, root) != after[s] for s, p in STAGE_SOURCES.items())


def test_every_asset_carries_its_stage_code_version():
    from video_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.code_version == CODE_VERSIONS[node.group_name], key
