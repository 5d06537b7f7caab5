"""docs/scale-out.md's KubeRay recipe, run as far as a machine without Kubernetes allows: its Python builds
dagster-ray's ``KubeRayCluster`` from its YAML's head and worker groups, the ``RayCluster`` manifest comes
out of it, and dagster-ray's ``RayClusterClient`` (the Kubernetes client, from the ``kuberay`` extra) sends
it to a Kubernetes API server: a stand-in on 127.0.0.1 that records the request and answers as the API
would. Stopped by the test."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dagster as dg
import pytest
import yaml

DOCS = Path(__file__).resolve().parents[1] / "docs" / "scale-out.md"


def _recipe() -> tuple[str, dict]:
    text = DOCS.read_text()
    section = text[text.index("### KubeRay") : text.index("## (b)")]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    manifest = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    return python, manifest


@pytest.fixture
def kube_api(tmp_path):
    """A Kubernetes API stand-in on 127.0.0.1 and a kubeconfig naming it; yields (kubeconfig, requests)."""
    seen: list[dict] = []

    class Api(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"method": "POST", "path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            created = {**body, "metadata": {**body["metadata"], "uid": "1", "resourceVersion": "1"}}
            self._answer(201, created)

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # keep the test's output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = tmp_path / "kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
                "users": [{"name": "u", "user": {"token": "test-token"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
                "current-context": "k",
            }
        )
    )
    try:
        yield config, seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_docs_kuberay_recipe_builds_and_reaches_the_kubernetes_api(kube_api):
    from dagster_ray.kuberay import KubeRayCluster
    from dagster_ray.kuberay.client import RayClusterClient

    kubeconfig, seen = kube_api
    python, manifest = _recipe()
    head, workers = manifest["spec"]["headGroupSpec"], manifest["spec"]["workerGroupSpecs"]
    names = {"HEAD_GROUP": head, "GPU_WORKERS": workers[0]}
    # The docs' snippet is the value of the `ray_cluster` resource key: evaluate exactly that.
    exec(python.replace('"ray_cluster": ', "resource = ", 1), names)
    resource = names["resource"]
    assert isinstance(resource, KubeRayCluster)

    body = resource.ray_cluster.to_k8s(dg.build_asset_context(), image=resource.image)
    assert body["apiVersion"] == manifest["apiVersion"] and body["kind"] == manifest["kind"]
    spec = body["spec"]
    assert spec["headGroupSpec"]["rayStartParams"] == head["rayStartParams"]
    assert spec["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == resource.image
    (gpu,) = spec["workerGroupSpecs"]
    assert {k: gpu[k] for k in ("groupName", "minReplicas", "maxReplicas")} == {
        k: workers[0][k] for k in ("groupName", "minReplicas", "maxReplicas")
    }
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"

    body["metadata"]["name"] = manifest["metadata"]["name"]
    created = RayClusterClient(kube_config=str(kubeconfig)).create(body=body, namespace="video")
    assert created["metadata"]["uid"] == "1"
    (request,) = seen
    assert request["path"] == "/apis/ray.io/v1/namespaces/video/rayclusters"
    assert request["auth"] == "Bearer test-token"
    assert request["body"]["spec"]["workerGroupSpecs"][0]["groupName"] == "gpu-workers"
