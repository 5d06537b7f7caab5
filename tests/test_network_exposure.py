"""Nothing the product starts accepts unauthenticated work from the network. During a real
materialisation with the product's `ray_cluster` resource (the embedded Ray, dashboard switched on): every
socket its Ray processes listen on is loopback-only (and any that were not would have to refuse a gRPC/HTTP
call without this instance's token and answer it with the token), the dashboard's API refuses a request
without the token, and a Ray client without the token cannot connect while one with it can. Every process is the run's own and stops with it; every wait is bounded."""

import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from ipaddress import ip_address

import grpc
import psutil
import pytest
from dagster import MaterializeResult, asset, materialize
from dagster_ray import RayResource

from resources.settings import ray_auth_token_path
from video_assets.definitions import build_resources
from video_assets.defs.ray_session import ray_dashboard

# One cheap read-only method per Ray gRPC service (GCS, raylet, object manager, core worker, and the
# dashboard agent's log service: with Ray Serve's dependencies installed the agent serves gRPC too). Ray
# checks the token after finding the method, so an unknown method says UNIMPLEMENTED either way.
PROBES = (
    "/ray.rpc.NodeInfoGcsService/GetClusterId",
    "/ray.rpc.NodeManagerService/GetSystemConfig",
    "/ray.rpc.ObjectManagerService/Pull",
    "/ray.rpc.CoreWorkerService/NumPendingTasks",
    "/ray.rpc.LogService/ListLogs",
)

CLIENT = "import ray, sys; ray.init(address=sys.argv[1]); print('CONNECTED', ray.get(ray.put(7)))"

observed: dict = {}


def _grpc(addr: str, method: str, token: str | None) -> str:
    meta = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(addr) as ch:
        try:
            ch.unary_unary(method)(b"", timeout=10, metadata=meta)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def _http(addr: str) -> int | str:
    try:
        urllib.request.urlopen(f"http://{addr}/", timeout=10)
        return 200
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:  # not HTTP (a gRPC port)
        return type(e).__name__


def _dashboard_codes(address: str, token: str) -> dict:
    """HTTP status of the dashboard's version API without the token and with it."""
    codes = {}
    for label, headers in (("without", {}), ("with_token", {"Authorization": f"Bearer {token}"})):
        request = urllib.request.Request(f"http://{address}/api/version", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                codes[label] = response.status
        except urllib.error.HTTPError as e:
            codes[label] = e.code
    return codes


def _listeners() -> list[tuple[int, str, str, int]]:
    """(pid, name, ip, port) of every listening TCP socket of this process's descendants started by
    the run: the Ray head node the resource started (GCS, raylet, agents, workers). Processes that
    were already there (another test's session Ray, with its own token) and theirs are not the run's."""
    found = []
    earlier = observed.get("earlier", set())
    for proc in psutil.Process().children(recursive=True):
        try:
            if {proc.pid, *(p.pid for p in proc.parents())} & earlier:
                continue
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    what = f"{proc.name()} [{' '.join(proc.cmdline()[:4])[:160]}]"  # the command says which server
                    found.append((proc.pid, what, c.laddr.ip, c.laddr.port))
        except psutil.Error:
            continue
    return found


def _loopback(ip: str) -> bool:
    # Ray's gRPC servers bind IPv4 loopback as "::ffff:127.0.0.1" (Python 3.11 does not call that loopback).
    addr = ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def _probe(token: str) -> None:
    import ray

    gcs = ray._private.worker._global_node.gcs_address
    ray.get(ray.remote(lambda: 1).remote())  # a worker up, so its own gRPC server is listening too
    sockets = []
    for pid, name, ip, port in _listeners():
        host = "127.0.0.1" if ip in ("::", "0.0.0.0") else ip
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        without = {m: _grpc(addr, m, None) for m in PROBES}
        with_token = {m: _grpc(addr, m, token) for m in PROBES}
        sockets.append(
            dict(pid=pid, name=name, ip=ip, port=port, without=without, with_token=with_token, http=_http(addr))
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    clients = {
        "auth disabled": {"RAY_AUTH_MODE": "disabled"},
        "wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "the instance's token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_auth_token_path())},
    }
    procs = {
        label: subprocess.Popen(
            [sys.executable, "-c", CLIENT, gcs],
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for label, extra in clients.items()
    }
    results = {}
    for label, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
        results[label] = (proc.returncode, out)
    observed.update(gcs=gcs, sockets=sockets, clients=results, auth_mode=os.environ.get("RAY_AUTH_MODE"))
    observed["dashboard"] = _dashboard_codes(ray._private.worker.get_dashboard_url(), token)


@asset
def network_probe(ray_cluster: RayResource) -> MaterializeResult:
    _probe(ray_auth_token_path().read_text().strip())
    return MaterializeResult(metadata=ray_dashboard(ray_cluster))  # what captions and structuring report


@pytest.mark.slow
def test_embedded_ray_refuses_clients_without_the_instance_token(instance, dagster_home, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # an operator's leftover setting: the embedded Ray ignores it
    monkeypatch.setenv("RAY_DASHBOARD", "1")  # the dashboard switched on: its sockets are checked too
    observed.clear()
    observed["earlier"] = {p.pid for p in psutil.Process().children(recursive=True)}
    result = materialize(
        [network_probe], instance=instance, resources={"ray_cluster": build_resources()["ray_cluster"]}
    )
    assert result.success

    token_file = dagster_home / "ray" / "auth_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32

    # (1) Listening sockets: the embedded Ray runs as a loopback node, so every socket of its processes
    # (GCS, raylet, agents, workers, the autoscaler monitor's metrics server) binds 127.0.0.1; on Linux
    # Ray would otherwise take the machine's routable address and the monitor would serve metrics on
    # every interface. Any socket that is not loopback-only must still refuse a call without the token
    # and answer the same call with it.
    assert observed["gcs"].startswith("127.0.0.1:"), observed["gcs"]
    gcs_port = int(observed["gcs"].rsplit(":", 1)[1])
    assert gcs_port in {s["port"] for s in observed["sockets"]}, observed["sockets"]
    wide = [f"{s['name']} {s['ip']}:{s['port']}" for s in observed["sockets"] if not _loopback(s["ip"])]
    assert not wide, wide
    for s in observed["sockets"]:
        if _loopback(s["ip"]):
            continue
        # With the token the call gets past authentication: answered, or failed in the handler (UNKNOWN:
        # the agent's log service given an empty request).
        past = lambda code: code not in ("UNAUTHENTICATED", "UNIMPLEMENTED", "UNAVAILABLE")  # noqa: E731
        guarded = [m for m in PROBES if s["without"][m] == "UNAUTHENTICATED" and past(s["with_token"][m])]
        assert guarded or s["http"] == 401, (
            f"{s['name']} (pid {s['pid']}) serves {s['ip']}:{s['port']} without a token: {s}"
        )

    # The dashboard: on loopback, its URL in the step's metadata, and its API refuses a request without the token.
    [mat] = result.asset_materializations_for_node("network_probe")
    dashboard = mat.metadata["ray_dashboard"].value
    assert dashboard.startswith("http://127.0.0.1:"), dashboard
    assert int(dashboard.rsplit(":", 1)[1]) in {s["port"] for s in observed["sockets"]}, (
        dashboard,
        observed["sockets"],
    )
    assert observed["dashboard"] == {"without": 401, "with_token": 200}, observed["dashboard"]

    # (2) Clients: without the token (auth off, or a wrong one) refused; with it, connected.
    codes = {label: rc for label, (rc, _) in observed["clients"].items()}
    assert codes["auth disabled"] != 0 and codes["wrong token"] != 0, observed["clients"]
    assert codes["the instance's token"] == 0 and "CONNECTED 7" in observed["clients"]["the instance's token"][1]
    assert "CONNECTED" not in observed["clients"]["auth disabled"][1] + observed["clients"]["wrong token"][1]

    # The run's own setting, restored after it.
    assert observed["auth_mode"] == "token"  # during the run
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # restored after it

    # Never logged: not in the run's event log.
    logs = instance.all_logs(result.run_id)
    assert not [e for e in logs if token in (e.user_message or "")]
