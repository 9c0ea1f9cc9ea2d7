"""The scheduler's reads on vLLM 0.31+ (NOTE 2 of ``ConnectorRouting``: one read per
request, when it finishes), without an engine: the connector over slotroute's real
store and routing core, vLLM's blocks, coordinator and requests entering as plain
objects with the attributes it reads. The end-to-end suites check the same rows in a
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

    def __init__(self, request_id: str, num_tokens: int, num_prompt_tokens: int, finished: bool = False) -> None:
        self.request_id, self.num_tokens, self.num_prompt_tokens = request_id, num_tokens, num_prompt_tokens
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
