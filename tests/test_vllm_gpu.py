"""End to end on a real vLLM on a CUDA GPU, with CUDA graphs, in float32: the model
runner vLLM picks by default (V2 on 0.29/0.30) or V1 with
``VLLM_USE_V2_MODEL_RUNNER=0``. Skipped without CUDA; run on the GPU machine (results
in docs/vllm.md, "GPU runs").

vLLM caches its environment once an engine has started, so one pytest process tests
one runner: run this module twice, once per value of ``VLLM_USE_V2_MODEL_RUNNER``.
Every engine here is compared with a run of the same runner without prefix caching,
one request at a time, and with transformers' own routers over the same tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import MOE_LAYERS, TINY, assert_same_completion, completion, generate, greedy, prompt_tokens, scheduler_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"),
]

RUNNER = "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip() in ("0", "false", "False") else "v2"
BLOCK_SIZE = 16
NUM_BLOCKS = 96  # 1536 token slots: the preemption scenario overflows it
TOKEN_BUDGET = 256  # prefills longer than this are chunked


def gpu_llm(model: str, **overrides):
    """A ``vllm.LLM`` on the GPU with CUDA graphs (vLLM's default mode), float32,
    routed experts on; ``overrides`` win."""
    from vllm import LLM

    args = dict(
        model=model, dtype="float32", skip_tokenizer_init=True, distributed_executor_backend="uni",
        enable_return_routed_experts=True, block_size=BLOCK_SIZE, seed=0, gpu_memory_utilization=0.25,
        max_model_len=2048, max_num_batched_tokens=TOKEN_BUDGET,
    )
    args.update(overrides)
    return LLM(**args)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def gpu_reference(tiny_model):
    """No prefix caching, one request at a time, room for everything."""
    llm = gpu_llm(tiny_model, enable_prefix_caching=False, max_num_seqs=1, max_num_batched_tokens=2048)
    memo = {}

    def run(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            (memo[key],) = generate(llm, [prompt], greedy(max_tokens))
        return memo[key]

    yield run
    del llm


@pytest.fixture(scope="module")
def llm(tiny_model, gpu_reference):
    engine = gpu_llm(tiny_model, enable_prefix_caching=True, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=1024)
    yield engine
    del engine


def test_engine_runs_the_expected_runner_with_cuda_graphs_and_slotroute_in_place(llm):
    from vllm.config import CUDAGraphMode

    from slotroute.vllm.runner_v2 import StepCapture
    from slotroute.vllm.scheduler import SchedulerRouting

    config = llm.llm_engine.vllm_config
    runner = runner_of(llm)
    assert config.use_v2_model_runner is (RUNNER == "v2")
    assert config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    assert not config.model_config.enforce_eager
    assert isinstance(scheduler_of(llm).routed_experts_mgr, SchedulerRouting)
    if RUNNER == "v2":
        assert type(runner).__module__ == "vllm.v1.worker.gpu.model_runner"
        assert isinstance(runner.routed_experts_capturer, StepCapture)
    else:
        assert type(runner).__module__ == "vllm.v1.worker.gpu_model_runner"
        assert runner.__dict__.get("_slotroute_routing") is not None
        assert not runner.routed_experts_initialized  # none of vLLM's int32 copies run
    print(f"RESULT runner={type(runner).__module__}.{type(runner).__qualname__} "
          f"cudagraph_mode={config.compilation_config.cudagraph_mode} "
          f"async_scheduling={config.scheduler_config.async_scheduling}")


def test_worker_ships_narrow_rows_that_the_scheduler_stores(llm):
    routing = scheduler_of(llm).routed_experts_mgr
    seen = []
    store_batch = routing.store_batch

    def spy(data, slots):
        seen.append((data.dtype, data.shape, data.nbytes, slots.shape))
        return store_batch(data, slots)

    routing.store_batch = spy
    try:
        (got,) = generate(llm, [prompt_tokens(3, 300)], greedy(5))
    finally:
        del routing.store_batch
    assert seen and {dtype for dtype, *_ in seen} == {np.dtype(np.uint8)}
    assert all(shape[1:] == (TINY["num_layers"], TINY["top_k"]) for _, shape, _, _ in seen)
    assert got.routed.dtype == np.uint8 and got.routed.shape == (300 + 5 - 1, TINY["num_layers"], TINY["top_k"])
    print(f"RESULT steps={len(seen)} bytes shipped={sum(n for _, _, n, _ in seen)} "
          f"(int32 would be {4 * sum(n for _, _, n, _ in seen)})")


def test_prefix_cache_hits_and_chunked_prefill_match_the_reference(llm, gpu_reference):
    shared = prompt_tokens(10, 400)
    prompts = [
        shared + prompt_tokens(11, 40),
        shared + prompt_tokens(12, 75),
        shared[:160] + prompt_tokens(13, 30),
        shared + prompt_tokens(11, 40),
    ]
    generate(llm, [prompts[0]], greedy(8))  # warm the cache
    got = generate(llm, prompts, greedy(8))
    assert all(g.num_cached_tokens >= 160 for g in got), [g.num_cached_tokens for g in got]
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, gpu_reference(prompt, 8))


def test_forced_preemption_returns_the_routing_of_an_unpreempted_run(llm, gpu_reference):
    scheduler = scheduler_of(llm)
    llm.reset_prefix_cache()
    preempted = []
    inner = scheduler._preempt_request

    def spy(*args, **kwargs):
        preempted.append(args)
        return inner(*args, **kwargs)

    scheduler._preempt_request = spy
    try:
        prompts = [prompt_tokens(70 + i, 100 + 10 * i) for i in range(8)]
        got = generate(llm, prompts, greedy(150))
    finally:
        del scheduler._preempt_request
    assert preempted, f"a pool of {NUM_BLOCKS} blocks did not force a preemption"
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, gpu_reference(prompt, 150))


def test_abort_leaves_no_state_and_other_requests_match_the_reference(llm, gpu_reference):
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    prompts = {name: prompt_tokens(40 + i, 300 + 60 * i) for i, name in enumerate("abc")}
    for name, prompt in prompts.items():
        engine.add_request(name, {"prompt_token_ids": prompt}, greedy(10))
    for _ in range(3):
        engine.step()
    engine.abort_request(["b"])
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: completion(o) for o in engine.step() if o.finished})
    assert {"a", "c"} <= set(finished)
    for name in "ac":
        assert_same_completion(finished[name], gpu_reference(prompts[name], 10))
    assert not scheduler.requests and not scheduler._re_block_ids


def test_routing_equals_the_top_k_of_transformers_routers(llm, tiny_model):
    """transformers' Qwen3-MoE in float32 on the same GPU, over the prompt and the
    generated tokens: its routers pick the experts vLLM returned. A pair whose k-th
    and (k+1)-th router probabilities are within 1e-5 is a near-tie that kernels may
    break either way; any other difference fails."""
    from hf_oracle import disagreements, router_topk

    prompt = prompt_tokens(160, 200)
    generate(llm, [prompt[:128] + prompt_tokens(161, 10)], greedy(2))  # cache a prefix
    (got,) = generate(llm, [prompt], greedy(24))
    oracle = router_topk(tiny_model, prompt + list(got.tokens[:-1]), device="cuda")
    bad = disagreements(got.routed, oracle)
    not_ties = [(t, layer) for t, layer in bad.tolist() if oracle.margin[t, layer] > 1e-5]
    print(f"RESULT transformers oracle: {got.routed.shape[0]} tokens x {len(MOE_LAYERS)} MoE layers, "
          f"{len(bad)} differ ({len(not_ties)} not near-ties), cached={got.num_cached_tokens}")
    assert not not_ties, f"(token, layer) pairs that differ from transformers: {not_ties[:5]} of {len(not_ties)}"
