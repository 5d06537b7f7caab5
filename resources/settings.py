"""Embedded defaults for every environment variable the product reads.

This is the one module that looks at the environment: it hands Dagster an ``EnvVar`` when the
variable is set (so the UI shows where a value came from) and the embedded default otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

from dagster import EnvVar
from pydantic import BaseModel

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_SAMPLES = REPO_ROOT / "samples"


def dagster_home() -> Path:
    return Path(os.environ.get("DAGSTER_HOME") or REPO_ROOT / "dagster_home").resolve()


def dagster_home_set() -> bool:
    """Whether DAGSTER_HOME is set: the instance's dagster.yaml reads it, so there is no instance without it."""
    return bool(os.environ.get("DAGSTER_HOME"))


def env_or(name: str, default: Any, field: tuple[type[BaseModel], str] | None = None) -> Any:
    """``EnvVar(name)`` when set and non-empty, else ``default``. With ``field`` (a resource class and the
    name of a number field, which Dagster's EnvVar cannot carry: it holds strings, and ints without bounds):
    the value checked against that field's type and bounds when the resources are built, and passed as
    the value itself; a ValueError naming the variable when it does not fit."""
    value = os.environ.get(name)
    if not value:
        return default
    if field is None:
        return EnvVar(name)
    from pydantic import TypeAdapter, ValidationError

    cls, attr = field
    info = cls.model_fields[attr]
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    try:
        return TypeAdapter(kind).validate_strings(value.strip())
    except ValidationError as exc:
        why = "; ".join(e["msg"] for e in exc.errors())
        raise ValueError(f"{name}={value!r} (sets {cls.__name__}.{attr}): {why}") from None


def default_volume_uri() -> str:
    return str(BUNDLED_SAMPLES)


def default_tables_uri() -> str:
    return str(dagster_home() / "tables")


def default_mlflow_uri() -> str:
    return f"sqlite:///{dagster_home() / 'mlflow.db'}"


def default_mlflow_artifacts() -> str:
    return str(dagster_home() / "mlartifacts")


def default_index_uri() -> str:
    """The search index (LanceDB): next to the tables, ``<tables root>/../search_index``, so a demo's
    tables and its index move together; VIDEO_INDEX_URI overrides it."""
    tables = os.environ.get("VIDEO_TABLES_URI") or default_tables_uri()
    return f"{tables.rstrip('/').rsplit('/', 1)[0]}/search_index"


def forward_env_names(defaults: tuple[str, ...]) -> list[str]:
    """The variables steps send to their Ray workers: ``defaults`` plus RAY_FORWARD_ENV's comma-separated
    names (e.g. a storage credential of another cloud)."""
    extra = [n.strip() for n in os.environ.get("RAY_FORWARD_ENV", "").split(",") if n.strip()]
    return list(dict.fromkeys([*defaults, *extra]))


def secrets_forwarded() -> bool:
    """RAY_FORWARD_SECRETS=1: credentials sent by value to a RAY_ADDRESS cluster's workers, for nodes that cannot
    hold their own (they are then in its nodes' runtime-env logs); never to a local Ray, whose workers inherit them."""
    on = os.environ.get("RAY_FORWARD_SECRETS", "0").strip().lower() in ("1", "true", "yes", "on")
    return on and bool(os.environ.get("RAY_ADDRESS"))


def model_reverify_after_s() -> float | None:
    """VIDEO_MODEL_REVERIFY_DAYS (default 7): a registered model's file is hashed once, then each use compares
    its stamp (size, mtime, ctime, inode, sha256) and hashes only a file that changed; a stamp older than this
    many days is hashed again in full. 0 hashes every file on every use: the full re-verify, for a change
    made to keep the stamp (e.g. ``VIDEO_MODEL_REVERIFY_DAYS=0 video-assets demo`` once); ``never``: no
    re-hash by age."""
    raw = (os.environ.get("VIDEO_MODEL_REVERIFY_DAYS") or "7").strip().lower()
    if raw == "never":
        return None
    try:
        days = float(raw)
    except ValueError:
        raise ValueError(f"VIDEO_MODEL_REVERIFY_DAYS={raw!r}: a number of days, 0, or never") from None
    return max(0.0, days) * 86400.0


def batch_max_runtime_s() -> int:
    """VIDEO_BATCH_MAX_RUNTIME_S (default 21600, six hours): a run of the per-batch job still going after this
    many seconds is canceled by Dagster's run monitoring (the daemon; its ``dagster/max_runtime`` tag), so a
    replica or endpoint that stalls past every request timeout cannot hold a batch, its pool slot and its
    queue forever. 0 turns the limit off."""
    raw = (os.environ.get("VIDEO_BATCH_MAX_RUNTIME_S") or "21600").strip()
    try:
        seconds = int(raw)
    except ValueError:
        raise ValueError(f"VIDEO_BATCH_MAX_RUNTIME_S={raw!r}: a whole number of seconds (0: no limit)") from None
    if seconds < 0:
        raise ValueError(f"VIDEO_BATCH_MAX_RUNTIME_S={raw!r}: a whole number of seconds (0: no limit)")
    return seconds


def default_models_dir() -> str:
    return str(dagster_home() / "models")


def default_curation_dir() -> str:
    """Kept-frame JPEGs (``frames/``) and training exports (``exports/``) of frame curation."""
    return str(dagster_home() / "curation")


# The packages a Ray worker needs to run this product's stages (decode tasks, VLM actors).
SHIPPED_PACKAGES = ("video_assets", "resources")


# Ray puts its unix sockets at <temp>/<child>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store: with
# a 2-character child and a 7-digit pid that is 70 characters after the root, and a socket path must fit
# in 107, so a longer root is refused (configured) or replaced by a short one in the system temp folder.
RAY_TEMP_ROOT_MAX = 36


def ray_temp_root() -> Path:
    """This instance's private Ray temp folder (0700, owned by this user): the embedded Rays and the `ray up`
    service keep their session folders (logs, sockets, the runtime-env agent's log) under it, never in
    Ray's shared, world-readable default. VIDEO_RAY_TEMP_DIR when set; else ``$DAGSTER_HOME/ray/tmp`` when
    short enough for Ray's sockets; else ``<system temp>/va-<uid>-<digest of DAGSTER_HOME>``."""
    configured = os.environ.get("VIDEO_RAY_TEMP_DIR", "").strip()
    if configured:
        root = Path(configured).expanduser().absolute()
        if len(str(root)) > RAY_TEMP_ROOT_MAX:
            raise ValueError(
                f"VIDEO_RAY_TEMP_DIR={root} is {len(str(root))} characters; Ray's socket paths under it need "
                f"it to be at most {RAY_TEMP_ROOT_MAX}"
            )
    else:
        root = dagster_home() / "ray" / "tmp"
        if len(str(root)) > RAY_TEMP_ROOT_MAX:
            digest = hashlib.sha256(str(dagster_home()).encode()).hexdigest()[:8]
            root = Path(tempfile.gettempdir()) / f"va-{os.getuid()}-{digest}"
    return private_dir(root)


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can enter: created 0700, or an existing one of this user narrowed
    to 0700; a symlink or another user's folder (planted in a shared temp folder) is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a folder of this user: refusing it as the private Ray temp folder")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def ray_auth_token_path() -> Path:
    """This instance's Ray token: one per DAGSTER_HOME, so two instances on a machine (or a stale
    ``~/.ray/auth_token`` from another tool) never share one."""
    return dagster_home() / "ray" / "auth_token"


def stream_credentials() -> Mapping[str, str]:
    """Where a camera's ``username_env`` / ``password_env`` are looked up: this process's environment."""
    return os.environ


def recorder_files() -> tuple[Path, Path]:
    """The running recorder's pid file (JSON: pid, start time, config) and its log (``video-assets record``)."""
    folder = dagster_home() / "streams"
    return folder / "recorder.json", folder / "recorder.log"


def review_token_path() -> Path:
    """This instance's reviewer token: the review page's writes (labels) need it (``video-assets review-token``)."""
    return dagster_home() / "review" / "token"


def ensure_secret_file(path: Path) -> Path:
    """Create the token file once, readable by its owner only (0600 from the first byte: O_EXCL with
    the mode, so no window where it is wider); an existing file is narrowed to 0600. Never logged."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


# What Ray's processes read at start: token mode, and where the token is (Ray's C++ loader reads
# RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH, so an inherited RAY_AUTH_TOKEN is set aside).
_RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "RAY_enable_metrics_collection")


@contextlib.contextmanager
def embedded_ray_auth() -> Iterator[Path | None]:
    """Within: a Ray started by ``ray.init()`` here listens on loopback (``loopback_ray_node``) and runs
    with token authentication and this instance's token (what refuses other local users' clients). With
    RAY_ADDRESS set nothing changes: that cluster's own authentication applies (RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH, as Ray documents)."""
    if os.environ.get("RAY_ADDRESS"):
        yield None
        return
    with loopback_ray_node(), ray_token_auth(ensure_secret_file(ray_auth_token_path())) as token:
        yield token


# Ray's switch for its single-machine mode (the macOS/Windows default): node address 127.0.0.1 instead
# of the machine's routable address, so every Ray socket binds loopback.
_RAY_CLUSTER_MODE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_ray_node() -> Iterator[None]:
    """Within: a Ray started here (and its processes, which inherit the environment) takes 127.0.0.1 as
    its node address. On Linux Ray otherwise uses the routable address, and its autoscaler monitor then
    serves Prometheus metrics on every interface without the token (it binds loopback only for a
    loopback head). Ray reads the switch once at import, so this process's copy is set too; both restored."""
    saved_env = os.environ.get(_RAY_CLUSTER_MODE_VAR)
    os.environ[_RAY_CLUSTER_MODE_VAR] = "0"
    saved_switch = _set_ray_cluster_mode(False)
    try:
        yield
    finally:
        _set_ray_cluster_mode(saved_switch)
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_MODE_VAR, None)
        else:
            os.environ[_RAY_CLUSTER_MODE_VAR] = saved_env


def _set_ray_cluster_mode(on: bool) -> bool:
    """This process's copy of Ray's cluster-mode switch (``_RAY_CLUSTER_MODE_VAR``) set to ``on``; returns the
    one it had. Ray reads the variable once, at import, into ``ray._private.ray_constants``, and has no public
    setting for a loopback node on Linux (a node address of 127.0.0.1 is turned into the routable one while
    the switch is on); hence the private module (docs/reliability.md, "Private Ray/Dagster APIs still used")."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = on
    return saved


@contextlib.contextmanager
def ray_token_auth(token: Path) -> Iterator[Path]:
    """Within: this process, and the Ray processes it starts (they inherit the environment), use token
    authentication with the token in ``token``. Restored on exit, so a later connection to another
    cluster in the same process sees the caller's settings."""
    saved = {k: os.environ.get(k) for k in _RAY_AUTH_VARS}
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # No metrics exporter: with Ray Serve's dependencies installed the dashboard agent would serve
    # Prometheus metrics on every interface, without the token.
    os.environ["RAY_enable_metrics_collection"] = "false"
    _reload_ray_auth()
    try:
        yield token
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload_ray_auth()


def _reload_ray_auth() -> None:
    # Ray caches the mode (RayConfig) and the token per process and has no public call to read them again
    # after the environment changed; this is what Ray's own enable-token-auth path does (ray._private.
    # authentication), hence the private module (docs/reliability.md, "Private Ray/Dagster APIs still used").
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def service_allowed_hosts() -> list[str]:
    """Names the search service answers to besides its bind address and localhost: VIDEO_SERVICE_ALLOWED_HOSTS,
    comma-separated (archive.example.com, or *.example.com for its subdomains), for a service reached by a
    name or through a proxy; a request with any other Host header is refused with 400 (DNS rebinding)."""
    return [h.strip() for h in os.environ.get("VIDEO_SERVICE_ALLOWED_HOSTS", "").split(",") if h.strip()]


def serve_key_path() -> Path:
    """This instance's key for the served caption model's route (``core.serving.captioner``)."""
    return dagster_home() / "serve" / "api_key"


def serve_http() -> dict:
    """Where the served caption model's OpenAI route is: Serve's HTTP proxy host and port when a step or
    `video-assets ray up` starts Serve (VIDEO_SERVE_HOST, default 127.0.0.1; VIDEO_SERVE_PORT, default 8100),
    the base URL steps send to (VIDEO_SERVE_URL, default http://host:port: set it to the head node's or a
    RayService's address when the workers are elsewhere), and the bearer key (VIDEO_SERVE_API_KEY, else this
    instance's key file, made 0600 under DAGSTER_HOME). Replicas are given only the key's digest."""
    from video_assets.core.serving.captioner import DEFAULT_HTTP  # the defaults: one place

    host = os.environ.get("VIDEO_SERVE_HOST", "").strip() or DEFAULT_HTTP["host"]
    raw = os.environ.get("VIDEO_SERVE_PORT", "").strip() or str(DEFAULT_HTTP["port"])
    try:
        port = int(raw)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise ValueError(f"VIDEO_SERVE_PORT must be a port number (1-65535), got {raw!r}") from None
    url = os.environ.get("VIDEO_SERVE_URL", "").strip() or f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    key = os.environ.get("VIDEO_SERVE_API_KEY", "").strip()
    if not key:
        key = ensure_secret_file(serve_key_path()).read_text().strip()
    return {"host": host, "port": port, "url": url.rstrip("/"), "api_key": key}
