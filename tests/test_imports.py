"""No import cycle among the product's modules (video_assets, resources), counting imports inside
functions too: a lazy import that only hides a cycle still ties two modules into one."""

from pathlib import Path

from video_assets.defs.common import imported_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("video_assets", "resources")


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (``from x import y`` may name a
    module ``x.y``)."""
    files = {_module(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    return {name: {n for n in imported_names(path) if n in files and n != name} for name, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "video_assets"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from video_assets.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from video_assets import a\n")
    (pkg / "c.py").write_text("import video_assets.a\n")
    assert import_cycles(import_graph(tmp_path, ("video_assets",))) == [["video_assets.a", "video_assets.b"]]


def test_no_import_cycle_among_the_products_modules():
    assert import_cycles(import_graph(ROOT)) == []
