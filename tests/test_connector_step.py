"""The scheduler's reads on vLLM 0.31+ (NOTE 2 of ``ConnectorRouting``: one read per
request, when it finishes; NOTE 3: its prompt's rows read ahead while it decodes),
without an engine: the connector over slotroute's real store and routing core, vLLM's
blocks, coordinator and requests entering as plain objects with the attributes it
reads. The end-to-end suites check the same rows in a
real engine against runs without prefix caching, one request at a time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from slotroute.spec import MissingRoutingError, RoutingSpec
from slotroute.tools.bench import make_scheduler_read_workload

SPEC = RoutingSpec(num_layers=3, top_k=2, num_experts=16)
BLOCK = 16


class Request:
    """The part of vLLM's ``Request`` the connector reads."""

    def __init__(
        self, request_id: str, num_tokens: int, num_prompt_tokens: int, finished: bool = False, max_tokens: int = 1024
    ) -> None:
        self.request_id, self.num_tokens, self.num_prompt_tokens = request_id, num_tokens, num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_output_tokens = num_tokens - num_prompt_tokens
        self.sampling_params = SimpleNamespace(routed_experts_prompt_start=0)
        self.finished = finished

    def is_finished(self) -> bool:
        return self.finished


@pytest.fixture
def workload():
    w = make_scheduler_read_workload(SPEC, requests=8, block_size=BLOCK)
    req_to_blocks = w.routing._req_blocks
    # What vLLM's KVCacheCoordinator.get_blocks returns: one block list per group.
    w.routing._coordinator.get_blocks = lambda req_id: (req_to_blocks.get(req_id, []),)
    w.routing._cursors.update(dict.fromkeys(w.req_ids, 0))  # as build_connector_meta set them at their first step
    return w


def stored(w, i: int, start: int, end: int) -> np.ndarray:
    """Request ``i``'s rows ``start .. end - 1`` as the slot buffer holds them."""
    return w.routing.store.routed_experts_by_slot[w.slots[i][start:end]]


def request(w, i: int, finished: bool = False, prompt: int = 10) -> Request:
    """Request ``i`` after its step: every token up to its position forwarded, one sampled."""
    return Request(w.req_ids[i], w.positions[i] + 2, prompt, finished)


def test_a_running_request_gets_no_rows_and_no_read_is_made(workload, monkeypatch):
    routing = workload.routing
    monkeypatch.setattr(routing.store, "get", lambda *args: pytest.fail("a running request's output read the store"))
    assert [routing.take_output(request(workload, i), None) for i in range(8)] == [None] * 8
    assert set(routing._cursors.values()) == {0}


def test_a_finished_request_gets_every_row_from_its_cursor_in_one_read_and_then_none(workload):
    routing = workload.routing
    routing._cursors[workload.req_ids[2]] = 5  # routed_experts_prompt_start, or rows already returned
    done = request(workload, 2, finished=True)
    rows = routing.take_output(done, None)
    np.testing.assert_array_equal(rows, stored(workload, 2, 5, workload.positions[2] + 1))
    assert rows.base is None or rows.base is not routing.store.routed_experts_by_slot  # a copy
    assert routing._cursors[done.request_id] == workload.positions[2] + 1
    assert routing.take_output(done, None) is None


def test_a_preempted_request_keeps_the_rows_it_emitted_before_its_blocks_are_freed(workload):
    """Rows read at preemption come first in the request's next rows, even though its
    blocks were handed out again (and their slots rewritten) before it finished."""
    w = workload
    routing = w.routing
    i, j = np.argsort(w.positions)[[0, -1]]  # i resumes in j's blocks, which hold more tokens
    req_id = w.req_ids[i]
    before = stored(w, i, 0, w.positions[i] + 1)
    routing.request_finished(request(w, i))  # preempted: not finished
    assert routing._parked[req_id] == [block.block_id for block in routing._req_blocks[req_id]]
    # vLLM frees its blocks; another request rewrites them; it resumes in new blocks.
    routing.store.invalidate_blocks(np.unique(w.slots[i] // BLOCK))
    routing._req_blocks[req_id] = routing._req_blocks.pop(w.req_ids[j])
    del routing._parked[req_id]  # dropped at its next schedule (build_connector_meta)
    end = w.positions[j] + 1
    rows = routing.take_output(Request(req_id, end + 1, 10, finished=True), None)
    np.testing.assert_array_equal(rows[: len(before)], before)
    np.testing.assert_array_equal(rows[len(before):], stored(w, j, len(before), end))
    assert len(rows) == end


def test_the_output_of_a_step_in_flight_at_preemption_is_read_from_the_parked_blocks(workload):
    w = workload
    routing = w.routing
    req_id = w.req_ids[1]
    routing.request_finished(Request(req_id, w.positions[1], 10))  # preempted with one step in flight
    routing._req_blocks.pop(req_id)  # vLLM freed its blocks
    rows = routing.take_output(request(w, 1), None)  # that step's output: one more row, from the parked blocks
    np.testing.assert_array_equal(rows, stored(w, 1, 0, w.positions[1] + 1))


def test_a_request_preempted_in_its_prompt_saves_nothing(workload, monkeypatch):
    routing = workload.routing
    monkeypatch.setattr(routing.store, "get", lambda *args: pytest.fail("a prompt's rows were read at preemption"))
    prefilling = Request(workload.req_ids[0], 300, 300)
    routing.request_finished(prefilling)
    assert workload.req_ids[0] not in routing._saved


def test_rows_lost_before_a_preemption_read_fail_the_request_when_it_finishes(workload):
    w = workload
    routing = w.routing
    routing.store.invalidate_blocks(np.unique(w.slots[5] // BLOCK))
    routing.request_finished(request(w, 5))
    assert isinstance(routing._saved[w.req_ids[5]], MissingRoutingError)
    marker = routing.take_output(request(w, 5, finished=True), None)
    assert marker.shape[0] == 0 and [m is marker for m, _ in routing.core._missing] == [True]


def test_a_finished_request_is_forgotten(workload):
    routing = workload.routing
    running = request(workload, 6)
    routing.request_finished(running)
    assert routing._saved and routing._parked
    running.finished = True
    routing.request_finished(running)
    assert not routing._saved and not routing._parked and running.request_id not in routing._cursors


# -- NOTE 3: the prompt's rows read ahead ------------------------------------------------

PROMPT = 40  # every request of the workload holds at least 48 stored rows


def reads_of(routing, monkeypatch) -> list[int]:
    """The number of rows of each store read the connector makes from now on."""
    rows, get = [], routing.store.get

    def counted(block_ids, num_tokens, token_start=0, out=None):
        rows.append(num_tokens - token_start)
        return get(block_ids, num_tokens, token_start, out)

    monkeypatch.setattr(routing.store, "get", counted)
    return rows


def decoding(w, i: int, outputs: int, finished: bool = False, max_tokens: int = 1024) -> Request:
    """Request ``i`` with a prompt of ``PROMPT`` tokens after ``outputs`` sampled tokens."""
    return Request(w.req_ids[i], PROMPT + outputs, PROMPT, finished, max_tokens)


def due(w, *indices: int) -> None:
    """Requests ``indices`` noted at their first schedule as build_connector_meta notes them."""
    w.routing._prompt_due.update(w.req_ids[i] for i in indices)


def test_a_prompt_is_read_ahead_from_its_second_emitting_step_and_its_finish_reads_only_the_rest(workload, monkeypatch):
    w, i = workload, 3
    routing, end = w.routing, w.positions[3] + 1
    due(w, i)
    reads = reads_of(routing, monkeypatch)
    assert routing.take_output(decoding(w, i, 1), None) is None  # the step that completed the prefill
    assert reads == []
    assert routing.take_output(decoding(w, i, 2), None) is None
    assert reads == [PROMPT] and routing._cursors[w.req_ids[i]] == PROMPT
    assert routing.take_output(decoding(w, i, 3), None) is None
    assert reads == [PROMPT]  # once
    rows = routing.take_output(decoding(w, i, end + 1 - PROMPT, finished=True), None)
    assert reads == [PROMPT, end - PROMPT]
    np.testing.assert_array_equal(rows, stored(w, i, 0, end))
    assert not np.shares_memory(rows, routing.store.routed_experts_by_slot)
    assert routing._ahead_held == 0 and not routing._ahead


def test_a_read_ahead_buffer_holds_every_row_max_tokens_allows_and_the_finish_copies_nothing_twice(workload):
    w, i = workload, 5
    routing, end = w.routing, w.positions[5] + 1
    due(w, i)
    routing.take_output(decoding(w, i, 2, max_tokens=end + 1 - PROMPT), None)
    buffer, first = routing._ahead[w.req_ids[i]]
    assert (len(buffer), first) == (end, 0)  # rows 0 .. prompt + max_tokens - 2
    rows = routing.take_output(decoding(w, i, end + 1 - PROMPT, finished=True), None)
    assert rows.base is buffer and len(rows) == end
    np.testing.assert_array_equal(rows, stored(w, i, 0, end))


def test_rows_beyond_what_max_tokens_allowed_are_joined_to_the_read_ahead_ones(workload):
    """A streaming session given more tokens than its first ``max_tokens``."""
    w, i = workload, 1
    routing, end = w.routing, w.positions[1] + 1
    due(w, i)
    routing.take_output(decoding(w, i, 2, max_tokens=4), None)
    rows = routing.take_output(decoding(w, i, end + 1 - PROMPT, finished=True), None)
    np.testing.assert_array_equal(rows, stored(w, i, 0, end))


def test_a_prompt_start_past_the_prompt_reads_nothing_ahead(workload, monkeypatch):
    w, i = workload, 2
    w.routing._cursors[w.req_ids[i]] = PROMPT + 1  # resumed after its prompt's rows were returned
    due(w, i)
    reads = reads_of(w.routing, monkeypatch)
    assert w.routing.take_output(decoding(w, i, 4), None) is None
    assert reads == [] and not w.routing._prompt_due and not w.routing._ahead


def test_read_ahead_stops_for_the_step_once_its_budget_is_spent_and_goes_on_in_the_next(workload, monkeypatch):
    from slotroute.vllm import connector

    w = workload
    routing = w.routing
    row_bytes = routing.store.routed_experts_by_slot[0].nbytes
    monkeypatch.setattr(connector, "READ_AHEAD_STEP_BYTES", PROMPT * row_bytes + 1)
    routing._ahead_budget = connector.READ_AHEAD_STEP_BYTES  # as take_step sets it each step
    due(w, 0, 1, 2)
    reads = reads_of(routing, monkeypatch)
    for i in (0, 1, 2):
        routing.take_output(decoding(w, i, 2), None)
    assert reads == [PROMPT, PROMPT]  # the first read leaves 1 byte, so a second: then spent
    assert routing._prompt_due == {w.req_ids[2]}
    routing._ahead_budget = connector.READ_AHEAD_STEP_BYTES
    routing.take_output(decoding(w, 2, 3), None)
    assert reads == [PROMPT] * 3 and not routing._prompt_due
    assert routing._ahead_held == 3 * PROMPT * row_bytes


def test_nothing_is_read_ahead_past_the_held_budget_or_into_too_large_a_buffer(workload, monkeypatch):
    from slotroute.vllm import connector

    w = workload
    routing = w.routing
    row_bytes = routing.store.routed_experts_by_slot[0].nbytes
    monkeypatch.setattr(connector, "READ_AHEAD_HELD_BYTES", PROMPT * row_bytes)
    monkeypatch.setattr(connector, "READ_AHEAD_REQUEST_BYTES", 2048 * row_bytes)
    due(w, 0, 1, 2)
    reads = reads_of(routing, monkeypatch)
    routing.take_output(decoding(w, 0, 2, max_tokens=4096), None)  # a buffer of 4,135 rows: read at finish
    routing.take_output(decoding(w, 1, 2), None)
    routing.take_output(decoding(w, 2, 2), None)  # the held budget spent by request 1
    assert reads == [PROMPT] and list(routing._ahead) == [w.req_ids[1]]
    assert routing._prompt_due == {w.req_ids[2]}
    end = w.positions[0] + 1
    rows = routing.take_output(decoding(w, 0, end + 1 - PROMPT, finished=True, max_tokens=4096), None)
    np.testing.assert_array_equal(rows, stored(w, 0, 0, end))


def test_a_buffer_the_host_refuses_leaves_the_rows_to_be_read_at_finish(workload, monkeypatch):
    w, i = workload, 6
    routing, end = w.routing, w.positions[6] + 1
    due(w, i)
    with monkeypatch.context() as refusing:
        refusing.setattr(np, "empty", lambda *args, **kwargs: (_ for _ in ()).throw(MemoryError()))
        assert routing.take_output(decoding(w, i, 2), None) is None
    assert not routing._ahead and not routing._prompt_due and routing._cursors[w.req_ids[i]] == 0
    rows = routing.take_output(decoding(w, i, end + 1 - PROMPT, finished=True), None)
    np.testing.assert_array_equal(rows, stored(w, i, 0, end))


def test_a_read_ahead_that_misses_fails_the_request_at_once(workload):
    w, i = workload, 4
    routing = w.routing
    routing.store.invalidate_blocks(np.unique(w.slots[i] // BLOCK))
    due(w, i)
    marker = routing.take_output(decoding(w, i, 2), None)
    assert marker.shape[0] == 0 and [m is marker for m, _ in routing.core._missing] == [True]
    assert not routing._ahead and routing._ahead_held == 0


def test_a_request_preempted_after_its_read_ahead_returns_every_row_in_order(workload):
    w = workload
    routing = w.routing
    i, j = np.argsort(w.positions)[[0, -1]]  # i resumes in j's blocks, which hold more tokens
    req_id = w.req_ids[i]
    due(w, i)
    routing.take_output(decoding(w, i, 2), None)
    before = stored(w, i, 0, w.positions[i] + 1)
    routing.request_finished(decoding(w, i, w.positions[i] + 2 - PROMPT))  # preempted: not finished
    assert not routing._ahead and routing._ahead_held == 0
    routing.store.invalidate_blocks(np.unique(w.slots[i] // BLOCK))
    routing._req_blocks[req_id] = routing._req_blocks.pop(w.req_ids[j])
    del routing._parked[req_id]
    end = w.positions[j] + 1
    rows = routing.take_output(decoding(w, i, end + 1 - PROMPT, finished=True), None)
    np.testing.assert_array_equal(rows[: len(before)], before)
    np.testing.assert_array_equal(rows[len(before):], stored(w, j, len(before), end))


def test_a_finished_or_aborted_request_forgets_its_read_ahead(workload):
    w = workload
    routing = w.routing
    due(w, 0, 1)
    routing.take_output(decoding(w, 0, 2), None)
    for i in (0, 1):  # read ahead, and still due
        routing.request_finished(decoding(w, i, 5, finished=True))
    assert not routing._ahead and not routing._prompt_due and routing._ahead_held == 0


@pytest.mark.parametrize("seed", range(12))
def test_rows_returned_over_random_schedules_equal_the_stored_rows(seed, monkeypatch):
    """Requests of random prompts decode step by step, interleaved, under a random step
    budget, some preempted and resumed in their own (cached) blocks, some starting past
    row 0: what each returns, joined, equals its stored rows, whether its prompt was
    read ahead or not, and nothing is left behind."""
    from slotroute.vllm import connector

    rng = np.random.default_rng(seed)
    w = make_scheduler_read_workload(SPEC, requests=8, block_size=BLOCK, seed=seed)
    routing = w.routing
    routing._coordinator.get_blocks = lambda req_id: (routing._req_blocks.get(req_id, []),)
    row_bytes = routing.store.routed_experts_by_slot[0].nbytes
    monkeypatch.setattr(connector, "READ_AHEAD_STEP_BYTES", int(rng.integers(1, 200)) * row_bytes)
    prompts = [int(rng.integers(1, p + 1)) for p in w.positions]
    starts = [int(rng.integers(0, n)) if rng.random() < 0.3 else 0 for n in prompts]
    outputs = [1] * len(prompts)
    returned: dict[int, list[np.ndarray]] = {i: [] for i in range(len(prompts))}
    routing._cursors.update({r: s for r, s in zip(w.req_ids, starts)})
    due(w, *range(len(prompts)))
    live = set(range(len(prompts)))
    while live:
        routing._ahead_budget = connector.READ_AHEAD_STEP_BYTES  # a step
        for i in rng.permutation(sorted(live)):
            finished = prompts[i] + outputs[i] == w.positions[i] + 2
            req = Request(w.req_ids[i], prompts[i] + outputs[i], prompts[i], finished, max_tokens=2 * w.positions[i])
            rows = routing.take_output(req, None)
            if rows is not None:
                returned[i].append(rows.copy())
            if finished:
                routing.request_finished(req)
                live.discard(i)
            elif rng.random() < 0.05:  # preempted; resumed in its cached blocks next step
                routing.request_finished(req)
                routing._parked.pop(w.req_ids[i])
                outputs[i] += 1
            else:
                outputs[i] += 1
    for i, chunks in returned.items():
        np.testing.assert_array_equal(np.concatenate(chunks), stored(w, i, starts[i], w.positions[i] + 1))
    assert not routing._ahead and not routing._prompt_due and not routing._saved and not routing._cursors
    assert routing._ahead_held == 0


def test_a_step_carried_no_prompt_token_where_each_request_ran_its_one_token_and_its_drafts():
    from slotroute.vllm.connector import decode_only

    def step(tokens: dict, drafts: dict | None = None):
        return SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                               scheduled_spec_decode_tokens=drafts or {})

    assert decode_only(step({"a": 1, "b": 1}))
    assert not decode_only(step({"a": 1, "b": 40}))  # b's prompt, or a chunk of it
    assert decode_only(step({"a": 4, "b": 1}, {"a": [7, 8, 9]}))
    assert not decode_only(step({"a": 4, "b": 3}, {"a": [7, 8, 9]}))
