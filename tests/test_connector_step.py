"""The scheduler's one read per step on vLLM 0.31+ (NOTE 2 of ``ConnectorRouting``),
without an engine: the connector over slotroute's real store, vLLM's blocks and
scheduler output entering as plain objects with the attributes it reads. The
end-to-end suites check every payload read against the store read in a real engine
(``step_reads_checked`` in conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import slotroute.vllm.connector as connector_module
from slotroute.spec import RoutingSpec
from slotroute.tools.bench import make_scheduler_read_workload
from slotroute.vllm.connector import token_slots

SPEC = RoutingSpec(num_layers=3, top_k=2, num_experts=16)
BLOCK = 16


@pytest.fixture(params=["C", "python"])
def slots_path(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(connector_module, "_native", None)
    else:
        # The install the tests run on builds slotroute._native.
        assert connector_module._native is not None
    return request.param


def random_blocks(rng, requests: int):
    req_ids = [f"r{i}" for i in range(requests)]
    req_blocks = {r: [SimpleNamespace(block_id=int(b)) for b in rng.permutation(1000)[: rng.integers(0, 6)]]
                  for r in req_ids[:-1]}  # the last request holds no blocks
    return req_ids, req_blocks


def test_token_slots_is_the_slot_of_each_requests_token_or_minus_one(slots_path):
    rng = np.random.default_rng(0)
    req_ids, req_blocks = random_blocks(rng, 64)
    positions = rng.integers(-1, 6 * BLOCK, len(req_ids))
    got = token_slots(req_ids, positions, req_blocks, BLOCK)
    for req_id, position, slot in zip(req_ids, positions.tolist(), got.tolist()):
        blocks = req_blocks.get(req_id, [])
        if position < 0 or position // BLOCK >= len(blocks):
            assert slot == -1
        else:
            assert slot == blocks[position // BLOCK].block_id * BLOCK + position % BLOCK


def test_token_slots_in_c_equals_its_python_reference(monkeypatch):
    rng = np.random.default_rng(1)
    for _ in range(20):
        req_ids, req_blocks = random_blocks(rng, int(rng.integers(1, 40)))
        positions = rng.integers(-2, 7 * BLOCK, len(req_ids))
        in_c = token_slots(req_ids, positions, req_blocks, BLOCK)
        monkeypatch.setattr(connector_module, "_native", None)
        in_python = token_slots(req_ids, positions, req_blocks, BLOCK)
        monkeypatch.undo()
        np.testing.assert_array_equal(in_c, in_python)


@pytest.mark.parametrize(
    "req_blocks, message",
    [
        ({"a": (SimpleNamespace(block_id=1),)}, "req_blocks values must be lists"),
        ({"a": [SimpleNamespace(id=1)]}, "block_id"),
        ({"a": [SimpleNamespace(block_id=-3)]}, "block_id is negative"),
        ({"a": [SimpleNamespace(block_id="1")]}, "integer"),
    ],
)
def test_token_slots_in_c_raises_on_blocks_that_are_not_vllms(req_blocks, message):
    with pytest.raises((TypeError, ValueError, AttributeError), match=message):
        connector_module._native.token_slots(np.empty(1, np.int64), ["a"], np.zeros(1, np.int64), req_blocks, BLOCK)


@pytest.mark.parametrize("out, positions", [(np.empty(2, np.int64), np.zeros(1, np.int64)),
                                            (np.empty(1, np.int32), np.zeros(1, np.int64)),
                                            (np.empty(1, np.int64), np.zeros(1, np.float64))])
def test_token_slots_in_c_raises_on_arrays_of_another_dtype_or_length(out, positions):
    with pytest.raises(ValueError, match="int64 with one item per request id"):
        connector_module._native.token_slots(out, ["a"], positions, {}, BLOCK)


def take_step(workload, req_ids=None):
    """The step stored, indexed as ``take_step`` does, then one ``take_output`` per
    request as vLLM's ``update_from_output`` makes them."""
    w = workload
    routing = w.routing
    routing._cursors.update(zip(w.req_ids, w.positions))
    routing._step_rows = routing._index_step(w.step, w.payload, w.req_ids if req_ids is None else req_ids, {})
    requests = [SimpleNamespace(request_id=r, num_tokens=p + 2) for r, p in zip(w.req_ids, w.positions)]
    return [routing.take_output(request, None) for request in requests]


def store_reads(workload):
    return [workload.routing._read_into(r, p, p + 1) for r, p in zip(workload.req_ids, workload.positions)]


def test_a_decode_step_hands_each_request_its_row_from_the_payload_with_no_store_read(slots_path, monkeypatch):
    w = make_scheduler_read_workload(SPEC, requests=32, block_size=BLOCK)
    expected = store_reads(w)
    monkeypatch.setattr(w.routing, "_read", lambda *args: pytest.fail("a decode step read the store"))
    got = take_step(w)
    for rows, want, position, req_id in zip(got, expected, w.positions, w.req_ids):
        np.testing.assert_array_equal(rows, want)
        assert rows.base is None or rows.base is not w.payload.routing_data  # a copy, not a view of the step
        assert w.routing._cursors[req_id] == position + 1


def test_rows_in_an_order_other_than_req_ids_are_never_handed_out_from_the_payload(slots_path):
    """The worker's token order is checked per request against its KV slot: a payload
    laid out in another order sends every request to the store, which holds its rows
    by slot."""
    w = make_scheduler_read_workload(SPEC, requests=16, block_size=BLOCK)
    expected = store_reads(w)
    got = take_step(w, req_ids=w.req_ids[::-1])
    assert not w.routing._step_rows.ready
    for rows, want in zip(got, expected):
        np.testing.assert_array_equal(rows, want)


def test_a_request_whose_cursor_is_behind_its_token_is_not_ready(slots_path):
    """A request whose output starts before this step's token (a catch-up) is not
    served the one row of the payload: it gets every row from its cursor on."""
    w = make_scheduler_read_workload(SPEC, requests=8, block_size=BLOCK)
    routing = w.routing
    routing._cursors.update(zip(w.req_ids, w.positions))
    lagging = w.req_ids[3]
    routing._cursors[lagging] -= 2
    routing._step_rows = routing._index_step(w.step, w.payload, w.req_ids, {})
    assert lagging not in routing._step_rows.ready and len(routing._step_rows.ready) == 7
