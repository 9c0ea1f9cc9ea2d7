"""End to end on a real vLLM on a CUDA GPU, with CUDA graphs, in float32: the model
runner vLLM picks by default (V2 on 0.29/0.30) or V1 with
``VLLM_USE_V2_MODEL_RUNNER=0``. Skipped without CUDA; run on the GPU machine (results
in docs/vllm.md, "GPU runs").

vLLM caches its environment once an engine has started, so one pytest process tests
one runner: run this module twice, once per value of ``VLLM_USE_V2_MODEL_RUNNER``.
Every engine here is compared with a run of the same runner without prefix caching,
one request at a time (in a child process: the V1 runner's workspace and graph
capture do not allow a second engine in one process), and with transformers' own
routers over the same tokens.

Numerics: vLLM's fused-MoE Triton kernels multiply float32 on TF32 tensor cores, and
cuBLAS picks kernels by batch shape, so a batched run and a lone run (or vLLM and
transformers) may break a near-tie between two experts differently. A row may
therefore differ from the comparison run only where transformers' router puts the
k-th and (k+1)-th expert close to each other: within ``NEAR_TIE`` against the same
runner's lone run (same kernels), within ``NEAR_TIE_TRANSFORMERS`` against transformers
(float32 without TF32, whose difference grows with depth: gaps up to 0.0103 flipped in
the last MoE layer on an H200), at most in ``MAX_TIE_SHARE`` of the (token, layer)
pairs. A shifted, stale, missing or foreign row differs at pairs far from any tie, in
every layer, and fails.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import (
    MOE_LAYERS,
    TINY,
    Completion,
    completion,
    connector_generation,
    generate,
    greedy,
    per_request_routing_state,
    prompt_tokens,
    routing_of,
    runner_of,
    scheduler_of,
    worker_routing,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"),
]

RUNNER = "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip() in ("0", "false", "False") else "v2"
BLOCK_SIZE = 16
NUM_BLOCKS = 96  # 1536 token slots: the preemption scenario overflows it
TOKEN_BUDGET = 256  # prefills longer than this are chunked
NEAR_TIE = 2e-3  # router probability gap under which batch-shape noise may flip a choice
NEAR_TIE_TRANSFORMERS = 2e-2  # the same against transformers' float32 (no TF32)
MAX_TIE_SHARE = 0.01

# The scenarios' requests, fixed here so the reference child can run them all first.
SHARED = prompt_tokens(10, 400)
PREFIX_PROMPTS = [
    SHARED + prompt_tokens(11, 40),
    SHARED + prompt_tokens(12, 75),
    SHARED[:160] + prompt_tokens(13, 30),
    SHARED + prompt_tokens(11, 40),
]
PREEMPT_PROMPTS = [prompt_tokens(70 + i, 100 + 10 * i) for i in range(8)]
ABORT_PROMPTS = {name: prompt_tokens(40 + i, 300 + 60 * i) for i, name in enumerate("abc")}
FAILING_PROMPT = prompt_tokens(63, 70)
REFERENCE_JOBS = (
    [(p, 8) for p in PREFIX_PROMPTS] + [(p, 150) for p in PREEMPT_PROMPTS] + [(ABORT_PROMPTS[n], 10) for n in "ac"]
    + [(FAILING_PROMPT, 4)]
)

# The reference engine, alone in its process: argv = model, jobs (json), output (npz).
REFERENCE_CHILD = """
import json, os, sys
import numpy as np
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
jobs = json.load(open(sys.argv[2]))
llm = LLM(model=sys.argv[1], dtype="float32", skip_tokenizer_init=True, distributed_executor_backend="uni",
          enable_return_routed_experts=True, block_size=%d, seed=0, gpu_memory_utilization=0.25,
          max_model_len=2048, max_num_batched_tokens=2048, enable_prefix_caching=False, max_num_seqs=1)
out = {}
for i, (prompt, n) in enumerate(jobs):
    (o,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0,
                        ignore_eos=True), use_tqdm=False)
    out[f"tokens{i}"] = np.array(o.outputs[0].token_ids)
    out[f"routed{i}"] = o.outputs[0].routed_experts
np.savez(sys.argv[3], **out)
print("REFERENCE DONE", len(jobs))
""" % BLOCK_SIZE


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


@pytest.fixture(scope="module")
def gpu_reference(tiny_model, tmp_path_factory):
    """Each scenario request run alone on the same runner without prefix caching."""
    import json
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("gpu-reference")
    (work / "jobs.json").write_text(json.dumps(REFERENCE_JOBS))
    result = subprocess.run(
        [sys.executable, "-c", REFERENCE_CHILD, tiny_model, str(work / "jobs.json"), str(work / "ref.npz")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = np.load(work / "ref.npz")
    memo = {
        (tuple(prompt), n): Completion(tuple(prompt), tuple(found[f"tokens{i}"].tolist()), found[f"routed{i}"], "length", 0)
        for i, (prompt, n) in enumerate(REFERENCE_JOBS)
    }
    return lambda prompt, n: memo[(tuple(prompt), n)]


@pytest.fixture(scope="module")
def oracle(tiny_model):
    """transformers' routing of a completion's tokens (prompt, then generated)."""
    from hf_oracle import router_topk

    return lambda got: router_topk(tiny_model, list(got.prompt) + list(got.tokens[:-1]), device="cuda")


def assert_same_routing(got: Completion, want: Completion, oracle) -> None:
    """Rows equal to the reference's wherever both runs forwarded the same tokens, and
    every row equal to transformers' routers over this run's own tokens, except at
    near-ties (module docstring). Under TF32 noise a long greedy run may sample a
    different token than the lone run; rows after it are checked against transformers
    alone."""
    from hf_oracle import disagreements

    assert got.routed is not None, f"no routed_experts (finish_reason={got.finish_reason})"
    assert got.routed.dtype == want.routed.dtype and got.routed.shape == want.routed.shape
    same = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b), len(got.tokens))
    rows = len(got.prompt) + same  # rows forwarded from the same tokens in both runs
    choice = oracle(got)
    for name, differ, tie in (
        ("the reference",
         np.argwhere((np.sort(got.routed[:rows], axis=2) != np.sort(want.routed[:rows], axis=2)).any(axis=2)), NEAR_TIE),
        ("transformers", disagreements(got.routed, choice), NEAR_TIE_TRANSFORMERS),
    ):
        far = [(t, layer, float(choice.margin[t, layer])) for t, layer in differ.tolist() if choice.margin[t, layer] >= tie]
        assert not far, f"rows differ from {name} away from any near-tie at (token, layer, margin) {far[:5]} of {len(far)}"
        assert len(differ) <= MAX_TIE_SHARE * got.routed.shape[0] * len(MOE_LAYERS), f"{len(differ)} near-ties"
        if len(differ) or same < len(got.tokens):
            print(f"RESULT {len(differ)} near-tie pairs differ from {name}; {same}/{len(got.tokens)} generated tokens "
                  "equal the reference's")


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = gpu_llm(tiny_model, enable_prefix_caching=True, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=1024)
    yield engine
    del engine


def test_engine_runs_the_expected_runner_with_cuda_graphs_and_slotroute_in_place(llm):
    import vllm
    from vllm.config import CUDAGraphMode

    from slotroute.vllm import COPY_ONCE_ENV, capture_copy_once
    from slotroute.vllm.connector import ConnectorRouting
    from slotroute.vllm.scheduler import SchedulerRouting

    connector = connector_generation()

    config = llm.llm_engine.vllm_config
    runner = runner_of(llm)
    assert config.use_v2_model_runner is (RUNNER == "v2")
    assert config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    assert not config.model_config.enforce_eager
    assert isinstance(routing_of(scheduler_of(llm)), ConnectorRouting if connector else SchedulerRouting)
    if RUNNER == "v2":
        assert type(runner).__module__ == "vllm.v1.worker.gpu.model_runner"
        if connector:
            from slotroute.vllm.runner_v2_connector import StepConnector

            assert isinstance(runner.aux_output_connector, StepConnector)
        else:
            from slotroute.vllm.runner_v2 import StepCapture

            assert isinstance(runner.routed_experts_capturer, StepCapture)
    else:
        assert type(runner).__module__ == "vllm.v1.worker.gpu_model_runner"
        assert runner.__dict__.get("_slotroute_routing") is not None
        if not connector:
            assert not runner.routed_experts_initialized  # none of vLLM's int32 copies run
    # one capture copy a step unless SLOTROUTE_CAPTURE_COPY_ONCE=0 (the default on CUDA)
    copy_once = worker_routing(llm).capturer._copy_once
    assert copy_once is capture_copy_once("cuda", os.environ.get(COPY_ONCE_ENV))
    print(f"RESULT runner={type(runner).__module__}.{type(runner).__qualname__} "
          f"cudagraph_mode={config.compilation_config.cudagraph_mode} "
          f"async_scheduling={config.scheduler_config.async_scheduling} vllm={vllm.__version__} "
          f"capture={'one copy a step' if copy_once else 'a copy per MoE layer'}")


def test_worker_ships_narrow_rows_that_the_scheduler_stores(llm):
    routing = routing_of(scheduler_of(llm)).store
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


def test_prefix_cache_hits_and_chunked_prefill_match_the_reference(llm, gpu_reference, oracle, connector_reads):
    generate(llm, [PREFIX_PROMPTS[0]], greedy(8))  # warm the cache
    got = generate(llm, PREFIX_PROMPTS, greedy(8))
    assert all(g.num_cached_tokens >= 160 for g in got), [g.num_cached_tokens for g in got]
    for g, prompt in zip(got, PREFIX_PROMPTS):
        assert_same_routing(g, gpu_reference(prompt, 8), oracle)
    if connector_reads is not None:  # vLLM 0.31+: the prompt's rows read ahead, the rest at finish
        reads = connector_reads.of_requests()
        print(f"RESULT connector reads {len(connector_reads.reads)} for {len(reads)} requests")
        assert len(reads) == 1 + len(PREFIX_PROMPTS)
        # each request's rows read in order, the prompt's ahead where a step without
        # prompt tokens came before it finished, the rest at finish
        assert all(connector_reads.in_order(r) and len(r) <= 2 for r in reads.values()), reads


def test_forced_preemption_returns_the_routing_of_an_unpreempted_run(llm, gpu_reference, oracle):
    scheduler = scheduler_of(llm)
    llm.reset_prefix_cache()
    preempted = []
    inner = scheduler._preempt_request

    def spy(*args, **kwargs):
        preempted.append(args)
        return inner(*args, **kwargs)

    scheduler._preempt_request = spy
    try:
        got = generate(llm, PREEMPT_PROMPTS, greedy(150))
    finally:
        del scheduler._preempt_request
    assert preempted, f"a pool of {NUM_BLOCKS} blocks did not force a preemption"
    for g, prompt in zip(got, PREEMPT_PROMPTS):
        assert_same_routing(g, gpu_reference(prompt, 150), oracle)


def test_abort_leaves_no_state_and_other_requests_match_the_reference(llm, gpu_reference, oracle):
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    prompts = ABORT_PROMPTS
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
        assert_same_routing(finished[name], gpu_reference(prompts[name], 10), oracle)
    assert not scheduler.requests and not per_request_routing_state(scheduler)


def test_step_whose_routing_fails_its_check_fails_its_request_alone(llm, gpu_reference, oracle):
    """An expert id out of range in the capture buffer of one step (written between the
    forward, a CUDA graph replay, and the snapshot kernel that checks it): the worker
    ships the step's failure instead of rows, the step's request finishes with an
    error, and the engine serves the same prompt on with the reference's routing."""
    routing = worker_routing(llm)
    snapshot, armed = routing.snapshot_step, [True]

    def snapshot_step(num_tokens, slots, *args, **kwargs):
        if armed[0]:
            armed[0] = False
            routing.capturer._buffer[2, MOE_LAYERS[-1], 1] = routing.capturer.spec.num_experts
        return snapshot(num_tokens, slots, *args, **kwargs)

    llm.reset_prefix_cache()
    routing.snapshot_step = snapshot_step
    try:
        (failed,) = generate(llm, [FAILING_PROMPT], greedy(4))
    finally:
        del routing.snapshot_step
    assert not armed[0], "no step was snapshotted"
    assert failed.finish_reason == "error" and failed.routed is None
    llm.reset_prefix_cache()
    (after,) = generate(llm, [FAILING_PROMPT], greedy(4))
    assert_same_routing(after, gpu_reference(FAILING_PROMPT, 4), oracle)
    print(f"RESULT failing step ({RUNNER}): the request failed alone, the engine served on with exact routing")


@pytest.mark.skipif(connector_generation(), reason="the reads ahead are vLLM 0.28-0.30's scheduler's")
def test_prompts_read_ahead_of_their_last_prefill_step_match_the_reference(llm, gpu_reference, oracle):
    """Reads ahead (``SchedulerRouting``'s NOTE 2, on unless ``SLOTROUTE_READ_AHEAD=0``)
    under the engine's async scheduling, with CUDA graphs: prompts with prefix-cache
    hits and prompts prefilled in chunks have the rows stored before their last prefill
    step read while it runs, and that step's rows added at its output; every request
    equals the lone run's rows and transformers' routers, and reads were made ahead and
    served."""
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling, "the reads ahead need a step in flight"
    routing = routing_of(scheduler_of(llm))
    made, served = routing.reads_made_ahead, routing.reads_served_ahead
    on = routing.reads_ahead
    routing.reads_ahead = True  # the default, whatever the variable set when the engine started
    try:
        llm.reset_prefix_cache()
        generate(llm, [PREFIX_PROMPTS[0]], greedy(8))  # warm the cache
        got = generate(llm, PREFIX_PROMPTS, greedy(8))
        chunked = [ABORT_PROMPTS[name] for name in "ac"]  # 300 and 420 tokens over a budget of 256
        got_chunked = generate(llm, chunked, greedy(10))
    finally:
        routing.reads_ahead = on
    for g, prompt in zip(got, PREFIX_PROMPTS):
        assert_same_routing(g, gpu_reference(prompt, 8), oracle)
    for g, prompt in zip(got_chunked, chunked):
        assert_same_routing(g, gpu_reference(prompt, 10), oracle)
    made, served = routing.reads_made_ahead - made, routing.reads_served_ahead - served
    print(f"RESULT reads ahead ({RUNNER}): {made} prompts read ahead, {served} served, of "
          f"{len(PREFIX_PROMPTS) + 1 + len(chunked)} requests")
    assert made > 0, "no prompt was read ahead"
    assert served > 0, "no read made ahead was served"
    assert not routing._ahead and not routing._ahead_by_list


def test_routing_equals_the_top_k_of_transformers_routers(llm, oracle):
    """transformers' Qwen3-MoE in float32 on the same GPU, over the prompt and the
    generated tokens: its routers pick the experts vLLM returned, except at near-ties."""
    from hf_oracle import disagreements

    prompt = prompt_tokens(160, 200)
    generate(llm, [prompt[:128] + prompt_tokens(161, 10)], greedy(2))  # cache a prefix
    (got,) = generate(llm, [prompt], greedy(24))
    choice = oracle(got)
    bad = disagreements(got.routed, choice)
    far = [(t, layer, float(choice.margin[t, layer])) for t, layer in bad.tolist()
           if choice.margin[t, layer] >= NEAR_TIE_TRANSFORMERS]
    print(f"RESULT transformers oracle: {got.routed.shape[0]} tokens x {len(MOE_LAYERS)} MoE layers, "
          f"{len(bad)} differ (margins {[round(float(choice.margin[t, layer]), 6) for t, layer in bad.tolist()]}), "
          f"cached={got.num_cached_tokens}")
    assert not far, f"(token, layer, margin) that differ from transformers away from a tie: {far[:5]} of {len(far)}"
    assert len(bad) <= MAX_TIE_SHARE * got.routed.shape[0] * len(MOE_LAYERS)
