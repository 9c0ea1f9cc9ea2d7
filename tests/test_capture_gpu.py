"""RoutedExpertsCapturer on a CUDA device: graph capture and replay, the asynchronous
snapshot racing the next step, and no host synchronisation before ``result()``.

Skipped without CUDA; run on a GPU machine (results in docs/capture.md).
"""

import numpy as np
import pytest
import torch

from slotroute import capture
from slotroute.capture import NOT_CAPTURED, RoutedExpertsCapturer
from slotroute.spec import RoutingSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEEPSEEK = RoutingSpec(num_layers=61, top_k=8, num_experts=256)
POISON_HOST = 0xA5  # a valid uint8 id: an unwritten staging byte matches a random id 1 time in 256


@pytest.fixture(params=["triton", "torch"])
def narrowing(request, monkeypatch):
    """Run each snapshot test with the fused Triton pass and with the torch fallback."""
    if request.param == "triton" and capture._fused_kernel() is None:
        pytest.fail("Triton is missing from this CUDA build of torch")
    if request.param == "torch":
        monkeypatch.setattr(capture, "_fused_kernel", lambda: None)
    return request.param


def random_routing(spec, num_tokens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, spec.num_experts, (num_tokens, *spec.token_shape), generator=gen, device="cuda", dtype=torch.int32)


def capture_step(cap, ids):
    """One forward's worth of capture() calls, int64 ids on odd layers like some routers."""
    for layer in range(ids.shape[1]):
        rows = ids[:, layer]
        cap.capture(layer, rows.long() if layer % 2 else rows)


def poison(cap, num_tokens, blocks=4):
    """Fill the device staging buffers, and pinned blocks the caching host allocator
    will hand to the next snapshots of ``num_tokens``, with values a correct snapshot
    overwrites (a nonzero count of bad ids fails ``result()`` if it is left there)."""
    for stage in cap._stages:
        stage.narrow.fill_(POISON_HOST)
        stage.bad.fill_(777)
        stage.slots.fill_(-7)
    held = [capture._pinned_block(num_tokens, cap.spec.token_shape, cap._stages[0].narrow.dtype) for _ in range(blocks)]
    for slots, bad, rows in held:
        slots.fill_(-7)
        bad.fill_(777)
        rows.fill_(POISON_HOST)
    torch.cuda.synchronize()  # dropping `held` returns the blocks to the allocator's cache


def assert_snapshot_equals(lists, ids, slots, spec):
    expected = ids.cpu().numpy().astype(spec.storage_dtype)
    assert lists.routing_data.dtype == spec.storage_dtype
    assert lists.routing_data.shape == expected.shape
    np.testing.assert_array_equal(lists.routing_data, expected)
    np.testing.assert_array_equal(lists.slot_mapping, slots.cpu().numpy())


def test_capture_recorded_in_a_cuda_graph_writes_each_replays_routing():
    spec, n = RoutingSpec(num_layers=8, top_k=4, num_experts=64), 300
    cap = RoutedExpertsCapturer(spec, max_num_tokens=512, device="cuda")
    logits = torch.randn(n, spec.num_experts, device="cuda")
    bias = torch.randn(spec.num_layers, spec.num_experts, device="cuda")

    def forward():
        for layer in range(spec.num_layers):
            ids = torch.topk(logits + bias[layer], spec.top_k, dim=-1).indices  # int64
            cap.capture(layer, ids if layer % 2 else ids.int())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up outside the graph, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    for step, poison in enumerate([NOT_CAPTURED, 7, spec.num_experts - 1, 123456]):
        logits.copy_(torch.randn(n, spec.num_experts, device="cuda"))
        cap.get_device_buffer().fill_(poison)
        graph.replay()
        expected = torch.stack(
            [torch.topk(logits + bias[layer], spec.top_k, dim=-1).indices for layer in range(spec.num_layers)], dim=1
        )
        buffer = cap.get_device_buffer().cpu()
        assert torch.equal(buffer[:n], expected.int().cpu()), f"replay {step}"
        assert (buffer[n:] == poison).all(), f"replay {step} wrote past its {n} tokens"


def test_snapshot_is_not_torn_when_the_next_step_overwrites_the_buffer_at_once(narrowing):
    n = 8192
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=n, device="cuda")
    slots = torch.empty(n, dtype=torch.int64, device="cuda")  # one buffer, reused each step
    poison(cap, n)
    in_flight = []
    for step in range(6):
        ids = random_routing(DEEPSEEK, n, seed=step)
        cap.clear_buffer()
        capture_step(cap, ids)
        slots.copy_(torch.randperm(10 * n, device="cuda")[:n])
        in_flight.append((cap.snapshot(n, slots), ids, slots.clone()))
        if step % 2:  # resolve every second step: two snapshots in flight at once
            for pending, expected_ids, expected_slots in in_flight:
                assert_snapshot_equals(pending.result(), expected_ids, expected_slots, DEEPSEEK)
            in_flight.clear()  # their pinned blocks go back to the allocator for reuse


def test_more_snapshots_in_flight_than_staging_buffers_all_stay_correct(narrowing):
    n = 2048
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=n, device="cuda")
    slots = torch.empty(n, dtype=torch.int64, device="cuda")
    poison(cap, n)
    steps = []
    for step in range(5):
        ids = random_routing(DEEPSEEK, n - 100 * step, seed=100 + step)
        cap.clear_buffer()
        capture_step(cap, ids)
        slots[: len(ids)].copy_(torch.arange(len(ids), device="cuda") * (step + 1))
        steps.append((cap.snapshot(len(ids), slots[: len(ids)]), ids, slots[: len(ids)].clone()))
    for pending, ids, expected_slots in steps:
        assert_snapshot_equals(pending.result(), ids, expected_slots, DEEPSEEK)


def test_a_result_is_not_changed_by_later_snapshots(narrowing):
    n = 1024
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=n, device="cuda")
    slots = torch.arange(n, device="cuda")
    first_ids = random_routing(DEEPSEEK, n, seed=40)
    capture_step(cap, first_ids)
    first = cap.snapshot(n, slots).result()
    kept = first.routing_data.copy(), first.slot_mapping.copy()
    for step in range(4):
        capture_step(cap, random_routing(DEEPSEEK, n, seed=41 + step))
        slots.add_(n)
        cap.snapshot(n, slots).result()  # dropped: its pinned block is free for reuse
    np.testing.assert_array_equal(first.routing_data, kept[0])
    np.testing.assert_array_equal(first.slot_mapping, kept[1])


def test_snapshot_does_not_synchronise_with_the_device(narrowing):
    n = 4096
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=n, device="cuda")
    ids = random_routing(DEEPSEEK, n, seed=3)
    slots = torch.arange(n, device="cuda")
    capture_step(cap, ids)
    cap.snapshot(n, slots).result()  # first call compiles the kernel outside the check
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy for tens of ms
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = cap.snapshot(n, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not pending.done(), "the copy finished before the busy stream: snapshot() waited for the device"
    assert_snapshot_equals(pending.result(), ids, slots, DEEPSEEK)


def test_out_of_range_ids_raise_from_result_on_cuda(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=64, device="cuda")
    ids = random_routing(DEEPSEEK, 64, seed=5)
    ids[10, 60, 7] = DEEPSEEK.num_experts
    ids[63, 0, 0] = -3
    capture_step(cap, ids)
    pending = cap.snapshot(64, torch.arange(64, device="cuda"))
    with pytest.raises(ValueError, match=r"2 expert id\(s\) outside \[0, 256\)"):
        pending.result()


def test_rows_no_layer_captured_raise_from_result_on_cuda(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=64, device="cuda")
    capture_step(cap, random_routing(DEEPSEEK, 64, seed=6))
    cap.clear_buffer()
    capture_step(cap, random_routing(DEEPSEEK, 40, seed=7))
    with pytest.raises(ValueError, match=rf"{24 * 61 * 8} expert id"):
        cap.snapshot(64, torch.arange(64, device="cuda")).result()


def test_uint16_storage_round_trips_on_cuda(narrowing):
    spec = RoutingSpec(num_layers=4, top_k=6, num_experts=40_000)
    cap = RoutedExpertsCapturer(spec, max_num_tokens=256, device="cuda")
    ids = random_routing(spec, 256, seed=8)
    ids[0, 0, 0] = spec.num_experts - 1
    capture_step(cap, ids)
    slots = np.arange(256, dtype=np.int32) * 3  # a host slot mapping travels too
    lists = cap.snapshot(256, slots).result()
    assert lists.routing_data.dtype == np.uint16
    np.testing.assert_array_equal(lists.routing_data, ids.cpu().numpy().astype(np.uint16))
    np.testing.assert_array_equal(lists.slot_mapping, slots)


def test_zero_token_snapshot_is_empty_on_cuda(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=16, device="cuda")
    lists = cap.snapshot(0, torch.zeros(0, dtype=torch.int64, device="cuda")).result()
    assert lists.routing_data.shape == (0, 61, 8)
    assert lists.slot_mapping.shape == (0,)
