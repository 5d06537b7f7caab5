"""scripts/gpu_check.py --smoke: the GPU check's plumbing (tiny random model on CPU) prints a results
table with one row per batch size, writes its JSON, and imports nothing beyond torch/transformers and
the three engine modules it is allowed (no Ray, Dagster, MLflow, PyAV or resources/)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"


def test_smoke_run_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)],
        cwd=tmp_path,  # the script finds the project from its own location
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+n/a\s+0\s*$", proc.stdout, re.M)
    assert [(b, f) for b, f, *_ in rows] == [("1", "4"), ("2", "4")], proc.stdout
    assert all(float(req_s) > 0 and float(tok_s) > 0 for _, _, req_s, _, tok_s in rows)
    assert "not a benchmark" in proc.stdout

    data = json.loads(out.read_text())
    assert [(r["batch"], r["frames"], r["errors"]) for r in data["results"]] == [(1, 4, 0), (2, 4, 0)]
    assert all(r["output_tokens"] == 8 * r["batch"] for r in data["results"])
    assert data["info"]["forbidden_modules_loaded"] == []


def test_script_imports_only_engine_modules_from_the_project():
    text = SCRIPT.read_text()
    imported = set(re.findall(r"^\s*(?:from|import)\s+(video_assets[\w.]*|resources[\w.]*)", text, re.M))
    assert imported <= {
        "video_assets.core.captioning.requests",
        "video_assets.core.captioning.transformers_engine",
        "video_assets.core.inference",  # `from video_assets.core.inference import hf` style
        "video_assets.core.inference.hf",
        "video_assets.core.models.tiny_vlm",
    }, imported


def test_gpu_check_refuses_without_cuda_unless_smoke():
    # CUDA hidden from the script, so the refusal is checked on a GPU machine too (not skipped there).
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(SCRIPT), "--shape", "7b"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no CUDA device visible" in proc.stderr
