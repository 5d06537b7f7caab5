"""The docs under docs/ stay usable: every ```yaml block parses, docs/scale-out.md names only
environment variables of this project that the code actually reads, and its RayCluster manifest has a
head group and a worker group requesting GPUs."""

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SCALE_OUT = DOCS / "scale-out.md"
YAML_BLOCK = re.compile(r"^```ya?ml[^\n]*\n(.*?)^```", re.M | re.S)
# Settings named like this project's own (as opposed to AWS_*, DAGSTER_PG_*, upstream tools' variables).
PROJECT_VAR = re.compile(r"\b((?:VIDEO|VLM|MLFLOW|STRUCTURER)_[A-Z0-9_]+|RAY_ADDRESS)=")


def yaml_blocks(path: Path) -> list[str]:
    return YAML_BLOCK.findall(path.read_text(encoding="utf-8"))


def markdown_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_docs_exist():
    assert SCALE_OUT.is_file()
    assert markdown_files()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_yaml_block_parses(path):
    errors = []
    for number, block in enumerate(yaml_blocks(path), start=1):
        try:
            list(yaml.safe_load_all(block))
        except yaml.YAMLError as exc:
            errors.append(f"{path.relative_to(REPO)} yaml block {number}: {exc}")
    assert not errors, "\n".join(errors)


def source_text() -> str:
    files = [*(REPO / "video_assets").rglob("*.py"), *(REPO / "resources").rglob("*.py")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_scale_out_names_only_settings_the_code_reads():
    named = set(PROJECT_VAR.findall(SCALE_OUT.read_text(encoding="utf-8")))
    assert named, "expected VIDEO_*/VLM_*/MLFLOW_*/RAY_ADDRESS settings in docs/scale-out.md"
    src = source_text()
    unread = sorted(name for name in named if f'"{name}"' not in src and f"'{name}'" not in src)
    assert not unread, f"docs/scale-out.md sets variables no code in video_assets/ or resources/ reads: {unread}"


def _ray_clusters() -> list[dict]:
    docs = [d for block in yaml_blocks(SCALE_OUT) for d in yaml.safe_load_all(block)]
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "RayCluster"]


def _requests_gpu(container: dict) -> bool:
    res = container.get("resources") or {}
    return any(int((res.get(k) or {}).get("nvidia.com/gpu", 0)) > 0 for k in ("limits", "requests"))


def test_ray_cluster_manifest_has_a_head_and_a_gpu_worker_group():
    (cluster,) = _ray_clusters()
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["containers"], "head group has no container"
    gpu_groups = [
        g for g in spec["workerGroupSpecs"] if any(_requests_gpu(c) for c in g["template"]["spec"]["containers"])
    ]
    assert gpu_groups, "no worker group requests nvidia.com/gpu"
    assert all(g["template"]["spec"].get("nodeSelector") for g in gpu_groups), "GPU workers need a node selector"


PROOF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def test_every_proof_in_the_reliability_doc_exists():
    """docs/reliability.md backs each claim with a test: every test file and function it names exists."""
    text = (DOCS / "reliability.md").read_text(encoding="utf-8")
    named = PROOF.findall(text)
    assert len(named) >= 10
    missing = []
    for path, func in named:
        source = REPO / path
        if not source.is_file():
            missing.append(path)
        elif func and not re.search(rf"^def {func}\(", source.read_text(encoding="utf-8"), re.M):
            missing.append(f"{path}::{func}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"


# --- The README and every page under docs/ name only things that exist ------------------------------

README = REPO / "README.md"
README_MAX_LINES = 160
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# A repo path as the docs write one: under a top-level folder of the checkout, or a file at its root.
REPO_PATH = re.compile(
    r"(?:(?:video_assets|resources|tests|scripts|docs|samples|dagster_home|\.ci)/[\w./-]*"
    r"|(?:README\.md|Makefile|pyproject\.toml|workspace\.yaml|requirements[\w.-]*\.(?:lock|in)))"
)
MAKE = re.compile(r"\bmake ([a-z][\w-]*)")
CLI = re.compile(r"\bvideo-assets ([a-z][\w-]*(?:\s*\|\s*[a-z][\w-]*)*)([^`\n|]*)")
# Any name in the form of this project's settings, wherever the docs name it.
SETTING = re.compile(
    r"\b((?:VIDEO|VLM|MLFLOW|STRUCTURER|LLM|ARCHIVE|SPEECH_MODEL|FRAME_ENCODER|TEXT_ENCODER)_[A-Z0-9_]*[A-Z0-9]"
    r"|RAY_ADDRESS|RAY_SHIP_CODE|RAY_DASHBOARD)\b"
)


def doc_files() -> list[Path]:
    return [README, *markdown_files()]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def code_spans(text: str) -> list[str]:
    """Inline code outside fenced blocks, and every line of the fenced blocks."""
    spans = CODE_SPAN.findall(FENCE.sub("", text))
    return spans + [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def missing_paths(text: str, base: Path) -> list[str]:
    """Repo paths named in code spans, and link targets (with their #anchor), that do not exist.
    ``base`` is the folder links are relative to."""
    missing = []
    for span in CODE_SPAN.findall(FENCE.sub("", text)):
        span = span.split("::", 1)[0].rstrip(".,;:")
        if REPO_PATH.fullmatch(span) and not (REPO / span.rstrip("/")).exists():
            missing.append(span)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (base / file).resolve() if file else None
        if path is not None and not path.exists():
            missing.append(target)
        elif anchor and path is not None and path.suffix == ".md" and anchor not in _anchors(path):
            missing.append(target)
    return missing


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def unknown_make_targets(text: str) -> list[str]:
    targets = makefile_targets()
    named = {m for span in code_spans(text) for m in MAKE.findall(span)}
    return sorted(named - targets)


def _cli_help(*argv: str) -> str:
    """What ``video-assets ARGV --help`` prints (argparse exits before the command does anything)."""
    import contextlib
    import io

    from video_assets.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def _choices(help_text: str) -> set[str]:
    usage = help_text.split("\n\n", 1)[0]
    return {c for group in re.findall(r"\{([\w,-]+)\}", usage) for c in group.split(",")}


def unknown_cli(text: str) -> list[str]:
    """``video-assets SUBCOMMAND [ARG] [--option]`` the text names that the CLI's parser lacks:
    subcommands, a subcommand's positional choices (``ray up``) and its options."""
    commands = _choices(_cli_help())
    unknown = []
    for span in code_spans(text):
        for names, rest in CLI.findall(span):
            subs = [n.strip() for n in names.split("|")]
            for sub in subs:
                if sub not in commands:
                    unknown.append(f"video-assets {sub}")
            if len(subs) != 1 or subs[0] not in commands:
                continue
            sub_help = _cli_help(subs[0])
            choices = _choices(sub_help) - commands
            first = re.match(r"\s+([a-z][\w-]*)", rest)
            if choices and first and first.group(1) not in choices:
                unknown.append(f"video-assets {subs[0]} {first.group(1)}")
            for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
                if not re.search(rf"(?<![\w-]){option}(?![\w-])", sub_help):
                    unknown.append(f"video-assets {subs[0]} {option}")
    return sorted(set(unknown))


def _mlflow_variables() -> set[str]:
    import mlflow.environment_variables as mlflow_env

    return {name for name in vars(mlflow_env) if name.startswith("MLFLOW_")}


def unread_settings(text: str) -> list[str]:
    """Names in the form of this project's settings that no code in video_assets/ or resources/ reads
    (as the quoted name) or defines (a constant of that name); MLflow's own variables excepted."""
    src = source_text()
    named = set(SETTING.findall(text))
    unread = [
        name
        for name in named
        if f'"{name}"' not in src
        and f"'{name}'" not in src
        and not re.search(rf"^{name}\s*[:=]", src, re.M)
        and name not in _mlflow_variables()
    ]
    return sorted(unread)


def test_configuration_doc_is_what_the_generator_writes_now():
    from scripts.config_docs import OUTPUT, render

    assert OUTPUT.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is out of date with the settings' definitions: run `make config-docs`"
    )


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_every_path_the_docs_name_exists(path):
    missing = missing_paths(path.read_text(encoding="utf-8"), path.parent)
    assert not missing, f"{_rel(path)} names files or links that do not exist: {missing}"


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_every_make_target_the_docs_name_is_in_the_makefile(path):
    unknown = unknown_make_targets(path.read_text(encoding="utf-8"))
    assert not unknown, f"{_rel(path)} names make targets the Makefile does not have: {unknown}"


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_every_video_assets_command_the_docs_name_exists(path):
    unknown = unknown_cli(path.read_text(encoding="utf-8"))
    assert not unknown, f"{_rel(path)} names video-assets commands or options video_assets/cli.py lacks: {unknown}"


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_every_setting_the_docs_name_is_read_by_the_code(path):
    unread = unread_settings(path.read_text(encoding="utf-8"))
    assert not unread, f"{_rel(path)} names settings no code in video_assets/ or resources/ reads: {unread}"


def test_the_readme_is_one_page():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_the_checks_find_what_does_not_exist():
    """Each check above reports a made-up name, so a passing run means the names exist."""
    assert missing_paths("`video_assets/defs/nowhere.py` and [x](docs/nowhere.md)", REPO) == [
        "video_assets/defs/nowhere.py",
        "docs/nowhere.md",
    ]
    assert missing_paths("[x](docs/captioning.md#no-such-heading)", REPO) == ["docs/captioning.md#no-such-heading"]
    assert missing_paths("`video_assets/cli.py` and [x](docs/captioning.md#ray)", REPO) == []
    assert unknown_make_targets("run `make demo` then\n```\nmake no-such-target\n```\n") == ["no-such-target"]
    assert unknown_cli("`video-assets init | nosuch` and `video-assets ray sideways --nope`") == [
        "video-assets nosuch",
        "video-assets ray --nope",
        "video-assets ray sideways",
    ]
    assert unknown_cli("`video-assets ray up --num-cpus 2` and `video-assets demo --all`") == []
    assert unread_settings("set VIDEO_NO_SUCH_SETTING=1 or `VLM_ENGINE`; MLflow's MLFLOW_HTTP_REQUEST_TIMEOUT") == [
        "VIDEO_NO_SUCH_SETTING"
    ]


def _recipe(target: str) -> str:
    """The recipe lines of one Makefile target."""
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    block = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert block, f"the Makefile has no target {target}"
    return block.group(1)


def test_ci_runs_the_whole_suite_in_its_three_parts():
    """`make test` leaves the e2e tests out for speed and the vLLM ones (their own environment); CI must then
    run `make test-e2e` and `make test-vllm-cpu` too, or the daemon, browser, CLI, killed-run and vLLM tests
    would silently stop running anywhere."""
    assert "pytest -m 'not e2e and not vllm'" in _recipe("test") and "pytest -m e2e " in _recipe("test-e2e")
    assert "pytest -m vllm " in _recipe("test-vllm-cpu")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test(?![\w-])", ci, re.M) and re.search(r"^make test-e2e\b", ci, re.M)
    assert re.search(r"^make test-vllm-cpu\b", ci, re.M)
