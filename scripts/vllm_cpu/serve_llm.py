"""``ray.serve.llm`` serving a model on vLLM's CPU build, for scripts/vllm_cpu_check.py step 6 (test code).

A Ray of its own in this process (127.0.0.1), Serve's HTTP proxy on 127.0.0.1:PORT, one OpenAI-compatible
application (``build_openai_app``) with one LLM deployment of MODEL named NAME; prints ``ready`` once the
application runs, then waits for SIGTERM. Everything vLLM's CPU build needs is configuration.

    python scripts/vllm_cpu/serve_llm.py MODEL NAME PORT
"""

from __future__ import annotations

import signal
import sys
import time


def main(model: str, name: str, port: int) -> None:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    ray.init(num_cpus=4, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = LLMConfig(
        model_loading_config={"model_id": name, "model_source": model},
        engine_kwargs={
            "dtype": "float32",
            "max_model_len": 8192,
            "max_num_seqs": 4,
            "limit_mm_per_prompt": {"image": 8, "video": 0},
        },
        placement_group_config={"bundles": [{"CPU": 1}]},  # Ray's default asks for a GPU
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        log_engine_metrics=False,
    )
    serve.run(build_openai_app({"llm_configs": [config]}), route_prefix="/")
    print("ready", flush=True)
    while not stop:
        time.sleep(0.5)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
