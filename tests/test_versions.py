"""Code versions follow the source a stage runs (its import closure, found from the imports
themselves); every asset carries its stage's code version."""

import shutil
from pathlib import Path

from video_assets.core.sources import module_digest
from video_assets.defs.common import CODE_VERSIONS, PACKAGE, STAGES, import_closure, source_digest


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "video_assets"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_stage_code_version_changes_with_the_source_it_runs_only(tmp_path):
    root = _copy_package(tmp_path)
    before = {s: source_digest(s, root) for s in STAGES}
    assert before == CODE_VERSIONS
    routing = root / "core" / "routing.py"
    routing.write_text(routing.read_text().replace("EXCERPT_CHARS = 300", "EXCERPT_CHARS = 200"))
    after = {s: source_digest(s, root) for s in STAGES}
    assert {s for s in after if after[s] != before[s]} == {"routing"}
    # A shared schema change touches every stage that reads a table.
    tables = root / "core" / "tables.py"
    tables.write_text(tables.read_text() + "\n# changed\n")
    changed = {s for s in STAGES if source_digest(s, root) != after[s]}
    assert changed >= {"ingest", "captioning", "structuring", "routing", "evaluation", "search", "curation"}


def test_the_closure_follows_imports_a_hand_list_missed():
    # The text encoder's code runs in search_index (events and summaries are embedded there).
    files = {p.relative_to(PACKAGE).as_posix() for p in import_closure("search")}
    assert "core/embeddings/text.py" in files and "defs/lineage.py" in files
    assert "core/transcription/whisper.py" not in files  # not run by the search stage


def test_every_asset_carries_its_stage_code_version():
    from video_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.code_version == CODE_VERSIONS[node.group_name], key


def test_serving_code_reaches_only_the_stages_that_run_a_model(tmp_path):
    # Routing, scoring, transcripts, embeddings and maintenance run no model: an edit to the serving code must
    # not mark their materialisations stale (it did while every stage imported one engines module).
    root = _copy_package(tmp_path)
    before = {s: source_digest(s, root) for s in STAGES}
    captioner = root / "core" / "serving" / "captioner.py"
    captioner.write_text(captioner.read_text() + "\n# changed\n")
    changed = {s for s in STAGES if source_digest(s, root) != before[s]}
    assert changed == {"captioning", "curation", "promotion", "structuring", "summaries"}


def test_a_serve_application_is_named_by_the_code_it_runs_only(tmp_path):
    root = _copy_package(tmp_path)
    served = root / "core" / "serving" / "captioner.py"
    first = module_digest(served, root)
    routing = root / "core" / "routing.py"  # not run by a replica: deploys nothing new
    routing.write_text(routing.read_text() + "\n# changed\n")
    assert module_digest(served, root) == first
    engine = root / "core" / "captioning" / "transformers_engine.py"  # the replica's engine: a new application
    engine.write_text(engine.read_text() + "\n# changed\n")
    assert module_digest(served, root) != first
