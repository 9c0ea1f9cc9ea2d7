"""Drive a real in-process vLLM engine through a fixed workload, step by step.

Used by ``slotroute demo`` (``slotroute.tools.demo.run_engine``) and
``benchmarks/vllm_e2e.py``. Arrivals are keyed to engine steps and aborts to generated
tokens, so a workload meets the same prefix-cache hits and preemptions on every run.
vLLM is imported by the functions that start and drive an engine, not with this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DemoRequest", "EngineJob", "EngineRun", "RequestResult", "drive", "start_engine"]


@dataclass(frozen=True)
class DemoRequest:
    """One request of a workload: greedy, ``max_tokens`` tokens, EOS ignored.

    It enters the engine before step ``arrive_step``. If ``abort_after`` is set, it is
    aborted as soon as it has generated that many tokens.
    """

    name: str
    prompt: list[int]
    max_tokens: int
    arrive_step: int = 0
    abort_after: int | None = None


@dataclass
class EngineJob:
    """How to run one engine over the workload; JSON-serialisable."""

    model: str
    prefix_caching: bool
    num_blocks: int
    block_size: int = 32
    chunk: int = 128
    max_model_len: int = 1024
    dtype: str = "float32"
    routing: bool = True
    seed: int = 0
    # The KV cache budget handed to vLLM (num_blocks fixes the pool itself). Without
    # one the CPU worker reserves a share of host memory and refuses to start when
    # that much is not free.
    kv_cache_bytes: int = 64 << 20
    # vLLM's executor: "uni" runs the worker in the engine's process; "mp" in a process
    # of its own, as `vllm serve` does, its output crossing a shared-memory queue.
    executor: str = "uni"


@dataclass
class RequestResult:
    """What one request returned. ``routing`` is ``None`` when vLLM returned none
    (aborted, or routing not enabled); ``num_preemptions`` is ``None`` when unknown."""

    name: str
    prompt_len: int
    token_ids: list[int]
    num_cached_tokens: int | None
    num_preemptions: int | None
    finish_reason: str
    routing: np.ndarray | None = None


@dataclass
class EngineRun:
    """The results of one run, with where and how long it ran."""

    results: dict[str, RequestResult]
    device: str
    engine_start_s: float
    run_s: float
    steps: int
    extra: dict = field(default_factory=dict)


def start_engine(job: EngineJob, progress: Callable[[str], None] = lambda _: None):
    """Build an in-process vLLM ``LLM`` for ``job``.

    Needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` set before vLLM is imported (the child
    entry point does this), so that the engine core runs in this process.

    Returns
    -------
    (LLM, float)
        The engine and the seconds it took to start.
    """
    progress("importing vLLM")
    from vllm import LLM

    progress("starting the engine")
    started = time.perf_counter()
    llm = LLM(
        model=job.model,
        dtype=job.dtype,
        seed=job.seed,
        enforce_eager=True,
        skip_tokenizer_init=True,
        distributed_executor_backend=job.executor,
        block_size=job.block_size,
        max_model_len=job.max_model_len,
        max_num_batched_tokens=job.chunk,
        enable_chunked_prefill=True,
        enable_prefix_caching=job.prefix_caching,
        num_gpu_blocks_override=job.num_blocks,
        enable_return_routed_experts=job.routing,
        kv_cache_memory_bytes=job.kv_cache_bytes,
        # Stats on: RequestOutput.metrics then counts each request's preemptions.
        disable_log_stats=False,
    )
    return llm, time.perf_counter() - started


def drive(llm, workload: Sequence[DemoRequest], progress: Callable[[str], None] = lambda _: None) -> EngineRun:
    """Drive ``workload`` through ``llm``'s engine step by step until every request is done.

    Arrivals are keyed to engine steps and aborts to generated tokens, so the schedule
    (and with it the prefix-cache hits and preemptions) is the same on every run.

    Returns
    -------
    EngineRun
        Per-request results (``engine_start_s`` 0); routing arrays are those vLLM
        returned (not copied).
    """
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    engine = llm.llm_engine
    pending = sorted(workload, key=lambda r: r.arrive_step)
    abort_after = {r.name: r.abort_after for r in workload if r.abort_after is not None}
    finished = {}
    step = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_step <= step:
            request = pending.pop(0)
            params = SamplingParams(
                max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
            )
            engine.add_request(request.name, {"prompt_token_ids": request.prompt}, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
            elif len(output.outputs[0].token_ids) >= abort_after.get(output.request_id, 1 << 62):
                engine.abort_request([output.request_id])
                finished[output.request_id] = output
        step += 1
        if step % 10 == 0:
            progress(f"step {step}, {len(finished)}/{len(workload)} requests done")
    run_s = time.perf_counter() - started

    results = {}
    for request in workload:
        output = finished.get(request.name)
        aborted = request.abort_after is not None and (output is None or not output.finished)
        completion = output.outputs[0] if output is not None else None
        metrics = getattr(output, "metrics", None)
        results[request.name] = RequestResult(
            name=request.name,
            prompt_len=len(request.prompt),
            token_ids=list(completion.token_ids) if completion is not None else [],
            num_cached_tokens=getattr(output, "num_cached_tokens", None),
            num_preemptions=getattr(metrics, "num_preemptions", None),
            finish_reason="abort" if aborted else str(completion.finish_reason),
            routing=None if aborted or completion is None else completion.routed_experts,
        )
    device = str(current_platform.device_name or current_platform.device_type)
    return EngineRun(results, device, 0.0, run_s, step)
