"""The layout rules: pure logic (video_assets/core) never imports Dagster or the infrastructure;
every asset lives in the stage folder named by its group; only resources/ reads the environment;
the README's layout section names files that exist."""

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "video_assets" / "core"
# What the pure tree must never import: the orchestrator and the code that knows where data lives.
FORBIDDEN = (
    "dagster",
    "dagster_ray",
    "dagster_webserver",
    "resources",
    "video_assets.defs",
    "video_assets.definitions",
)


def forbidden_imports(root: Path, forbidden=FORBIDDEN) -> list[str]:
    """``file:line: module`` for every import (top level or inside a function) of a forbidden package."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    hits.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    return hits


def test_the_checker_catches_a_deliberate_dagster_import(tmp_path):
    pkg = tmp_path / "core"
    (pkg / "media").mkdir(parents=True)
    (pkg / "media" / "ok.py").write_text("import av\nfrom video_assets.core.vocabulary import VERDICTS\n")
    (pkg / "media" / "bad.py").write_text("def f():\n    from dagster import asset\n    return asset\n")
    (pkg / "worse.py").write_text("import resources.delta\n")
    assert forbidden_imports(pkg) == ["core/media/bad.py:2: dagster", "core/worse.py:1: resources.delta"]


def test_core_never_imports_dagster_or_resources():
    assert forbidden_imports(CORE) == []


def test_importing_every_core_module_loads_no_dagster():
    """The same rule at run time, transitively: a fresh interpreter imports all of core (the served vLLM
    application's classes only where vLLM is installed: Ray Serve LLM imports it)."""
    import importlib.util

    needs_vllm = {"video_assets.core.serving.vllm_server"}
    modules = sorted(
        m
        for p in CORE.rglob("*.py")
        if (m := ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")) not in needs_vllm
        or importlib.util.find_spec("vllm") is not None
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_ray', 'resources'))\n"
        "print(len(bad), bad[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("0 "), out.stdout


def test_every_asset_lives_in_the_folder_of_its_stage():
    import dagster as dg

    from video_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    seen = set()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assets_def = graph.assets_def_for_key(key)
        if not assets_def.is_executable:  # an external asset (written by a sensor): a spec in its stage's assets.py
            stage_assets = importlib.import_module(f"video_assets.defs.{node.group_name}.assets")
            assert key in {v.key for v in vars(stage_assets).values() if isinstance(v, dg.AssetSpec)}, key
            seen.add(node.group_name)
            continue
        module = inspect.getmodule(assets_def.op.compute_fn.decorated_fn).__name__
        assert module == f"video_assets.defs.{node.group_name}.assets", (key, module)
        seen.add(node.group_name)
    stages = {p.name for p in (ROOT / "video_assets" / "defs").iterdir() if (p / "assets.py").exists()}
    assert seen == stages


def test_only_resources_read_the_environment():
    hits = []
    for path in sorted((ROOT / "video_assets").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"os\.environ|os\.getenv|getenv\(", text):
            hits.append(f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}")
    assert hits == []


def test_readme_layout_names_paths_that_exist():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    paths = set(re.findall(r"`((?:video_assets|resources|tests)/[^`*<>{} ]+)`", layout))
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert missing == []


def test_the_makefile_parses_and_names_its_targets():
    """A broken Makefile breaks both set-up commands: every documented target must at least plan."""
    import subprocess

    targets = ["demo", "test", "ui", "mlflow-ui", "ray-up", "ray-down", "bench", "gpu-check", "test-vllm-cpu"]
    done = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def cross_stage_imports(defs_root: Path) -> list[str]:
    """``file:line: module`` for every import (top level or inside a function) by one stage folder's
    code of another stage folder's: shared pieces live in the defs-level modules (common, lineage,
    engines, registry, scoring, partitions), so a stage is read in one hop."""
    stages = {p.name for p in defs_root.iterdir() if (p / "__init__.py").is_file()}
    hits = []
    for stage in sorted(stages):
        for path in sorted((defs_root / stage).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["video_assets", "defs"] and len(parts) > 2 and parts[2] in stages - {stage}:
                        hits.append(f"{path.relative_to(defs_root)}:{node.lineno}: {name}")
                        break
    return sorted(set(hits))


def test_the_checker_catches_a_deliberate_cross_stage_import(tmp_path):
    for stage in ("captioning", "routing"):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "__init__.py").write_text("")
    (tmp_path / "lineage.py").write_text("")
    (tmp_path / "routing" / "ok.py").write_text("from video_assets.defs.lineage import upstream_pair\n")
    (tmp_path / "routing" / "own.py").write_text("from video_assets.defs.routing import ok\n")
    (tmp_path / "routing" / "bad.py").write_text("def f():\n    from video_assets.defs import captioning\n")
    (tmp_path / "captioning" / "worse.py").write_text("import video_assets.defs.routing.ok\n")
    assert cross_stage_imports(tmp_path) == [
        "captioning/worse.py:1: video_assets.defs.routing.ok",
        "routing/bad.py:2: video_assets.defs.captioning",
    ]


def test_no_stage_imports_another_stage():
    assert cross_stage_imports(ROOT / "video_assets" / "defs") == []
