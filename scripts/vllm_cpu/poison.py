"""A Ray worker setup hook for tests/test_vllm_cpu.py (test code: the product has no hook of its own).

While ``$VLLM_CPU_CHECK_WORK/poison`` exists, every request that reaches Ray's vLLM engine stage raises
vLLM's ``EngineDeadError`` (what a CUDA out-of-memory kill of the engine raises), and the engine actor's pid
is recorded under ``$VLLM_CPU_CHECK_WORK/tries``. Named by module path in the runtime_env, so it travels as
a string (Dagster resource config cannot hold a function)."""

from __future__ import annotations

import os
from pathlib import Path


def install() -> None:
    work = os.environ.get("VLLM_CPU_CHECK_WORK")
    if not work:
        return
    flag, tries = Path(work) / "poison", Path(work) / "tries"

    from ray.llm._internal.batch.stages import vllm_engine_stage as stage
    from vllm.v1.engine.exceptions import EngineDeadError

    real = stage.vLLMEngineWrapper.generate_async

    async def generate_async(self, row):
        if flag.exists():
            (tries / f"{os.getpid()}-{id(row)}").touch()
            raise EngineDeadError("injected by tests/test_vllm_cpu.py")
        return await real(self, row)

    stage.vLLMEngineWrapper.generate_async = generate_async
