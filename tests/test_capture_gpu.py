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
from slotroute.tools import cuda_graph

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


def poison(cap, num_tokens=None):
    """Fill every slot of the capturer's ring, device and pinned host buffers, with
    values a correct snapshot overwrites (a nonzero count of bad ids fails ``result()``
    if it is left there)."""
    for slot in cap._ring:
        slot.device.fill_(POISON_HOST)
        slot.host.fill_(POISON_HOST)
    torch.cuda.synchronize()


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

    graph = cuda_graph.record(forward)

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


@pytest.mark.parametrize("pieces", [1, 3])
def test_one_copy_a_step_recorded_in_cuda_graphs_writes_each_replays_routing(pieces):
    """NOTE 5 of ``RoutedExpertsCapturer.__init__``: with ``copy_once`` each layer's ids
    are held and the last router layer's capture writes them all with one stack. Recorded
    as vLLM records a forward: an eager warm-up forward, then the forward in one graph
    (a full graph) or in one graph per group of layers sharing one memory pool
    (piecewise graphs, the stack recorded in the last), with allocations between the
    layers that the pool could hand a held tensor's memory to. Every replay then writes
    its own routing, dense layers 0, and nothing past its tokens."""
    spec, n = RoutingSpec(num_layers=8, top_k=4, num_experts=64), 300
    cap = RoutedExpertsCapturer(spec, max_num_tokens=512, device="cuda", dense_layers=[2], copy_once=True)
    logits = torch.randn(n, spec.num_experts, device="cuda")
    bias = torch.randn(spec.num_layers, spec.num_experts, device="cuda")
    routers = [layer for layer in range(spec.num_layers) if layer != 2]
    groups = [routers] if pieces == 1 else [routers[:2], routers[2:5], routers[5:]]

    def piece(layers):
        for layer in layers:
            scratch = (logits * (layer + 1)).tanh()  # a forward's allocations between routers
            ids = torch.topk(logits + bias[layer] + scratch[:, :1] * 0, spec.top_k, dim=-1).indices.int()
            cap.capture(layer, ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up forward, eager
        for layers in groups:
            piece(layers)
    torch.cuda.current_stream().wait_stream(side)
    pool, graphs = torch.cuda.graph_pool_handle(), []
    for layers in groups:  # the recorded forward
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            piece(layers)
        graphs.append(graph)
    assert cap._held == []

    for step, poison in enumerate([NOT_CAPTURED, 7, spec.num_experts - 1, 123456]):
        logits.copy_(torch.randn(n, spec.num_experts, device="cuda"))
        cap.get_device_buffer().fill_(poison)
        for graph in graphs:
            graph.replay()
        expected = torch.stack(
            [torch.topk(logits + bias[layer], spec.top_k, dim=-1).indices for layer in range(spec.num_layers)], dim=1
        ).int()
        expected[:, 2] = 0
        buffer = cap.get_device_buffer().cpu()
        assert torch.equal(buffer[:n], expected.cpu()), f"replay {step}"
        assert (buffer[n:] == poison).all(), f"replay {step} wrote past its {n} tokens"


def test_a_snapshots_clear_refills_every_row_a_graph_replay_wrote_past_the_steps_tokens(narrowing):
    """NOTE 4 of ``RoutedExpertsCapturer.__init__``: a clear refills the rows written
    since the last one, a recorded graph's rows among them though its replays run no
    Python; a replay padded past the step's tokens, then a replay of a forward whose
    later layers captured nothing, is found by the next snapshot."""
    spec, graph_rows = RoutingSpec(num_layers=6, top_k=4, num_experts=64), 256
    cap = RoutedExpertsCapturer(spec, max_num_tokens=2048, device="cuda")
    fill = torch.full(spec.token_shape, NOT_CAPTURED, dtype=torch.int32, device="cuda")
    logits = torch.randn(graph_rows, spec.num_experts, device="cuda")
    layers = torch.ones(spec.num_layers, dtype=torch.bool, device="cuda")  # which layers route in a replay

    def forward():
        for layer in range(spec.num_layers):
            ids = torch.topk(logits + layer, spec.top_k, dim=-1).indices.int()
            # a layer switched off writes its rows unchanged: as if it captured nothing
            kept = torch.where(layers[layer], ids, cap._buffer[:graph_rows, layer])
            cap.capture(layer, kept)

    graph = cuda_graph.record(forward)
    slots = torch.arange(4 * graph_rows, device="cuda")
    cap.snapshot_leading(graph_rows, slots).result()  # the warm-up's rows
    # an eager step of 1500 tokens: its clear covers them
    capture_step(cap, random_routing(spec, 1500, seed=5))
    cap.snapshot_leading(1500, slots.repeat(2)).result()
    assert bool((cap._buffer == fill).all())
    # a replay for 10 tokens, padded to the graph's 256: every row it wrote refilled
    graph.replay()
    lists = cap.snapshot_leading(10, slots).result()
    assert lists.routing_data.shape == (10, *spec.token_shape)
    assert bool((cap._buffer == fill).all()), "a row the replay wrote past the step's tokens was left"
    # a replay whose layers 3-5 captured nothing: the next snapshot finds them
    layers[3:] = False
    graph.replay()
    with pytest.raises(ValueError, match="outside"):
        cap.snapshot_leading(200, slots).result()


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


def test_snapshots_reuse_the_ring_allocated_once(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=512, device="cuda", ring_depth=3)
    ring = [(slot.device.data_ptr(), slot.host.data_ptr()) for slot in cap._ring]
    for step in range(7):
        ids = random_routing(DEEPSEEK, 300 + step, seed=200 + step)
        capture_step(cap, ids)
        slots = torch.arange(len(ids), device="cuda") + 1000 * step
        pending = cap.snapshot(len(ids), slots)
        assert pending._slot is cap._ring[step % 3]
        assert_snapshot_equals(pending.result(), ids, slots, DEEPSEEK)
    assert [(slot.device.data_ptr(), slot.host.data_ptr()) for slot in cap._ring] == ring


def test_results_are_views_of_the_ring_while_the_caller_drops_them(narrowing):
    """A caller that drops each result once read (vLLM 0.31+ stores the rows) gets views
    of the ring's pinned buffers, no copy, and the ring's slots come round again."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=512, device="cuda", ring_depth=3)
    hosts = {slot.host.data_ptr(): slot for slot in cap._ring}
    for step in range(9):
        ids = random_routing(DEEPSEEK, 200 + step, seed=500 + step)
        capture_step(cap, ids)
        slots = torch.arange(len(ids), device="cuda") * 3 + step
        lists = cap.snapshot(len(ids), slots, clear=True).result()
        assert lists.routing_data.base is not None and lists.routing_data.ctypes.data in hosts
        assert_snapshot_equals(lists, ids, slots, DEEPSEEK)
        del lists
    assert cap._lend and len(cap._ring) == 3
    assert not any(slot.lent() for slot in cap._ring)


def test_results_kept_past_the_ring_stay_intact_and_later_ones_have_spans_of_their_own(narrowing):
    """A caller that keeps every result (vLLM 0.28-0.30's in-process engine keeps decode
    rows until the request finishes): no later snapshot writes a kept view; once a slot
    is found lent each snapshot's copy fills a span of its own in the capturer's pinned
    host pool (no copy out of the ring), and the kept views free their slots."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=512, device="cuda", ring_depth=3)
    poison(cap)
    kept = []
    for step in range(12):
        ids = random_routing(DEEPSEEK, 512 - 16 * step, seed=600 + step)
        capture_step(cap, ids)
        slots = torch.randperm(4096, device="cuda")[: len(ids)]
        kept.append((cap.snapshot(len(ids), slots, clear=True).result(), ids, slots.clone()))
    for lists, ids, slots in kept:
        assert_snapshot_equals(lists, ids, slots, DEEPSEEK)
    assert not cap._lend and len(cap._ring) <= 6
    for lists, _, _ in kept[4:]:
        for array in (lists.routing_data, lists.slot_mapping):
            assert not array.flags.owndata  # a view, not a copy ...
            assert not any(np.shares_memory(array, slot.host_np) for slot in cap._ring)  # ... of no ring buffer
    assert len({lists.routing_data.ctypes.data for lists, _, _ in kept}) == len(kept)
    assert len(cap._pool._chunks) == 1  # 8 steps of at most 512 tokens: one chunk
    del kept, lists
    assert not any(slot.lent() for slot in cap._ring)


def test_the_host_pool_reuses_its_chunks_once_the_kept_results_are_dropped(narrowing):
    """Rounds of kept results, as rollouts one after another: the first round allocates
    the pool's chunks, later rounds reuse them (nothing allocated), every result intact."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=2048, device="cuda", ring_depth=2)
    chunks_by_round = []
    for round_ in range(3):
        kept = []
        for step in range(20):  # 20 x 2048 tokens x 488 B: past the first chunks
            ids = random_routing(DEEPSEEK, 2048, seed=1000 * round_ + step)
            capture_step(cap, ids)
            slots = torch.randperm(8192, device="cuda")[:2048]
            pending = cap.snapshot_leading(2048, slots, defer_copy=True)
            pending.enqueue_copy()
            torch.cuda.current_stream().synchronize()
            kept.append((pending.result(), ids, slots))
        for lists, ids, slots in kept:
            assert_snapshot_equals(lists, ids, slots, DEEPSEEK)
        chunks_by_round.append([chunk[0].data_ptr() for chunk in cap._pool._chunks])
        del kept, lists
    # the first round's first steps were lent ring slots; from the second on every step takes a span
    assert not cap._lend and len(chunks_by_round[1]) >= 3
    assert chunks_by_round[2] == chunks_by_round[1]


def test_a_slot_mapping_row_longer_than_the_step_is_read_in_place(narrowing):
    """``snapshot_leading``: the runner's slot-mapping row (a row of a 2-D tensor, as
    long as the largest step) gives the step's first ``num_tokens`` slots; any other
    input takes ``snapshot``'s checks and raises as it does, changing nothing."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=512, device="cuda", ring_depth=2)
    mappings = torch.randperm(2 * 4096, device="cuda").view(2, 4096)
    mappings32 = mappings.to(torch.int32)[:, 1:]  # rows not 16-byte aligned, int32
    for step, n in enumerate((512, 7, 1, 300)):
        for form in range(4):  # a row tensor; V2's 2-D mappings and a row index (int64, then int32 unaligned)
            ids = random_routing(DEEPSEEK, n, seed=700 + 10 * step + form)
            capture_step(cap, ids)
            if form == 0:
                lists, expected = cap.snapshot_leading(n, mappings[1]).result(), mappings[1, :n]
            elif form < 3:
                lists, expected = cap.snapshot_leading(n, mappings, row=form - 1).result(), mappings[form - 1, :n]
            else:
                lists, expected = cap.snapshot_leading(n, mappings32, row=1).result(), mappings32[1, :n]
            assert_snapshot_equals(lists, ids, expected, DEEPSEEK)
    ids = random_routing(DEEPSEEK, 16, seed=710)
    capture_step(cap, ids)
    for bad, match in (
        (mappings[1, :8], r"shape \(16,\)"),
        (mappings[1].float(), "integers"),
        (mappings[1].cpu().numpy()[:4], r"shape \(16,\)"),
    ):
        with pytest.raises(ValueError, match=match):
            cap.snapshot_leading(16, bad)
    with pytest.raises(ValueError, match="max_num_tokens"):
        cap.snapshot_leading(513, mappings[1])
    with pytest.raises(ValueError, match=r"row must be an int in \[0, 2\)"):
        cap.snapshot_leading(16, mappings, row=2)
    # nothing changed: the captured rows are still there for the step's snapshot
    assert_snapshot_equals(cap.snapshot_leading(16, mappings[0]).result(), ids, mappings[0, :16], DEEPSEEK)


@pytest.mark.parametrize("copy_on", ["output stream", "forward stream"])
def test_a_deferred_copy_is_covered_by_the_runners_own_output_event(narrowing, copy_on):
    """The runner's output copy stream waits for the compute stream and records a
    blocking event; waiting for that event alone, with two steps in flight, every
    result is its own step's, and slotroute recorded no event. V2 enqueues the copy
    on that output stream; V1 on the forward's stream, ahead of sampling
    (``WorkerRouting.snapshot``)."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=2048, device="cuda", ring_depth=3)
    poison(cap)
    out_stream = torch.cuda.Stream()
    in_flight = []
    for step in range(8):
        ids = random_routing(DEEPSEEK, 2048 - 64 * step, seed=300 + step)
        capture_step(cap, ids)
        slots = torch.randperm(10 * len(ids), device="cuda")[: len(ids)]
        pending = cap.snapshot(len(ids), slots, clear=True, defer_copy=True)
        if copy_on == "forward stream":
            pending.enqueue_copy()
            torch.randn(4096, 4096, device="cuda").argmax(dim=-1)  # "sampling", after it on the same stream
        out_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(out_stream):
            pending.enqueue_copy()  # a no-op where it was enqueued already
            copied = torch.cuda.Event(blocking=True)
            copied.record(out_stream)
        in_flight.append((pending, copied, ids, slots.clone()))
        if len(in_flight) == 2:  # two steps in flight, as vLLM's async scheduling keeps them
            pending, copied, ids, expected = in_flight.pop(0)
            copied.synchronize()
            assert pending.done()  # nothing of slotroute's left to wait for
            assert_snapshot_equals(pending.result(), ids, expected, DEEPSEEK)
    for pending, copied, ids, expected in in_flight:
        copied.synchronize()
        assert_snapshot_equals(pending.result(), ids, expected, DEEPSEEK)
    assert len(cap._ring) == 3  # two in flight never needed more than the ring


def test_deferred_snapshots_beyond_the_ring_grow_it_then_get_buffers_of_their_own(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=256, device="cuda", ring_depth=2)
    steps = []
    for step in range(5):  # none resolved: slots stay held, the ring grows to twice its depth, then steps allocate
        ids = random_routing(DEEPSEEK, 256, seed=400 + step)
        capture_step(cap, ids)
        slots = torch.arange(256, device="cuda") * (step + 2)
        pending = cap.snapshot(256, slots, defer_copy=True)
        pending.enqueue_copy()
        steps.append((pending, ids, slots))
    assert sum(pending._slot in cap._ring for pending, _, _ in steps) == 4 == len(cap._ring)
    assert cap._lend  # held, not lent: lending goes on
    torch.cuda.synchronize()
    for pending, ids, slots in steps:
        assert_snapshot_equals(pending.result(), ids, slots, DEEPSEEK)


def test_a_discarded_snapshot_frees_its_ring_slot_for_the_next_steps(narrowing):
    """A step whose sampling raised is discarded unread: the ring does not grow, and the
    steps after it, reusing its slot in stream order, read their own rows."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=256, device="cuda", ring_depth=2)
    for step in range(6):
        ids = random_routing(DEEPSEEK, 256, seed=600 + step)
        capture_step(cap, ids)
        slots = torch.arange(256, device="cuda") * (step + 2)
        pending = cap.snapshot_leading(256, slots, defer_copy=True)
        pending.enqueue_copy()
        if step % 2 == 0:
            pending.discard()
            with pytest.raises(ValueError, match="discarded unread"):
                pending.result()
        else:
            torch.cuda.current_stream().synchronize()
            assert_snapshot_equals(pending.result(), ids, slots, DEEPSEEK)
    assert len(cap._ring) == 2


def test_a_deferred_snapshot_whose_copy_nobody_enqueued_copies_when_resolved(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=64, device="cuda")
    ids = random_routing(DEEPSEEK, 64, seed=9)
    capture_step(cap, ids)
    slots = torch.arange(64, device="cuda")
    assert_snapshot_equals(cap.snapshot(64, slots, defer_copy=True).result(), ids, slots, DEEPSEEK)


def test_direct_launches_write_what_the_jit_launch_writes_for_every_specialisation():
    """PackLauncher: a call whose pointers' dtypes or alignment, or whose flags, differ
    from every earlier one compiles through Triton's JIT launch; repeats launch the
    compiled kernel directly, and write the same bytes as a JIT launch of the same call."""
    kernel = capture._fused_kernel()
    if kernel is None:
        pytest.fail("Triton is missing from this CUDA build of torch")
    spec, row_ids = DEEPSEEK, DEEPSEEK.num_layers * DEEPSEEK.top_k
    fill = torch.full((row_ids,), NOT_CAPTURED, dtype=torch.int32, device="cuda")
    launcher = kernel.PackLauncher(torch.cuda.current_device())
    mappings = torch.randperm(2 * 4096, device="cuda", dtype=torch.int64).view(2, 4096)
    rows32 = mappings.to(torch.int32)
    cases = []  # (slots row, clear): int64 and int32 rows, aligned and not (element 1 of an int32 row)
    for slots_in, clear in ((mappings[1], True), (rows32[0], False), (rows32[0][1:], True), (None, True)):
        cases += [(slots_in, clear, n) for n in (1, 300, 4095)]
    for step, (slots_in, clear, n) in enumerate(cases * 2):
        ids = random_routing(spec, 4096, seed=800 + step).view(-1)
        ids[5 * row_ids + 3] = 999  # one bad id, in the step when n > 5
        outputs = []
        for launch in (launcher, kernel.pack_snapshot):  # direct after the first of each case; JIT
            flat = ids.clone()
            rows = torch.full((n * row_ids,), 0x5A, dtype=torch.uint8, device="cuda")
            counts = torch.full((-(-(n * row_ids) // capture.PACK_BLOCK),), 77, dtype=torch.int32, device="cuda")
            slots_out = None if slots_in is None else torch.full((n,), -3, dtype=torch.int64, device="cuda")
            launch(flat, fill, rows, counts, slots_in, slots_out, spec.num_experts, clear, capture.PACK_BLOCK,
                   numel=n * row_ids, num_slots=0 if slots_in is None else n)
            outputs.append((flat, rows, counts, slots_out))
        for mine, reference in zip(*outputs):
            assert (mine is None and reference is None) or torch.equal(mine, reference)
        assert int(outputs[0][2].sum()) == (1 if n > 5 else 0)
    assert len(launcher._compiled) == 4  # one compiled kernel per case, every repeat launched directly


def test_the_kernel_writes_pinned_host_memory_itself_as_a_staged_copy_would(narrowing):
    """``host_writes``: with Triton the kernel writes each snapshot's bytes into its
    pinned host span (the ring slot's, then, once results are kept, the host pool's),
    with no copy; the staged path (``host_writes=False``, and the torch fallback)
    copies them. Both give the same results on the own stream and on a caller's
    output stream."""
    caps = [RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=1024, device="cuda", ring_depth=2, host_writes=direct)
            for direct in (True, False)]
    for cap in caps:
        poison(cap)
    out_stream = torch.cuda.Stream()
    kept = []
    for step in range(10):
        n = (1024, 1, 333, 64, 1024)[step % 5]
        ids = random_routing(DEEPSEEK, n, seed=900 + step)
        slots = torch.randperm(4 * n, device="cuda")[:n]
        results = []
        for cap in caps:
            capture_step(cap, ids)
            defer = step % 2 == 1
            pending = cap.snapshot(n, slots, clear=True, defer_copy=defer)
            assert pending._direct == (cap is caps[0] and narrowing == "triton")
            if defer:
                out_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(out_stream):
                    pending.enqueue_copy()
                out_stream.synchronize()
            results.append(pending.result())
        for lists in results:
            assert_snapshot_equals(lists, ids, slots, DEEPSEEK)
        if step >= 4:
            kept.append((results, ids, slots))  # kept past the ring: from here on spans of the pool
    assert not caps[0]._lend and caps[0]._pool.nbytes > 0
    if narrowing == "triton":
        assert all(chunk[2] is not None for chunk in caps[0]._pool._chunks)
        assert all(chunk[2] is None for chunk in caps[1]._pool._chunks)
    for results, ids, slots in kept:
        for lists in results:
            assert_snapshot_equals(lists, ids, slots, DEEPSEEK)


def test_reserved_host_memory_takes_every_kept_result_with_no_allocation_in_steps(narrowing):
    """``reserve_host``: the pool page-locks its memory at once; results kept from
    then on take spans of it (no ring slot lent, no chunk allocated in a step) and
    stay intact."""
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=512, device="cuda", ring_depth=2)
    held = cap.reserve_host(8 << 20)
    assert held >= 8 << 20 and not cap._lend
    chunks = [chunk[0].data_ptr() for chunk in cap._pool._chunks]
    kept = []
    for step in range(12):  # 12 steps of at most 512 tokens x 488 bytes: within the reservation
        n = (512, 3, 200)[step % 3]
        ids = random_routing(DEEPSEEK, n, seed=1000 + step)
        capture_step(cap, ids)
        slots = torch.randperm(3 * n, device="cuda")[:n]
        lists = cap.snapshot_leading(n, slots).result()
        kept.append((lists, ids, slots))
    assert [chunk[0].data_ptr() for chunk in cap._pool._chunks] == chunks
    for slot in cap._ring:
        assert not slot.lent()
    for lists, ids, slots in kept:
        assert_snapshot_equals(lists, ids, slots, DEEPSEEK)


def test_a_hooked_launch_goes_through_triton_and_writes_the_same():
    """While a profiler's launch hook is set, repeat launches go through Triton's own
    launch, which calls it; without hooks they skip it. Both write the same bytes."""
    kernel = capture._fused_kernel()
    if kernel is None:
        pytest.fail("Triton is missing from this CUDA build of torch")
    import triton

    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=256, device="cuda")
    slots = torch.arange(256, device="cuda") * 3
    seen = []

    def hook(metadata):
        seen.append(metadata)

    hooks = triton.knobs.runtime.launch_enter_hook
    for step in range(6):
        hooked = step in (3, 4)
        if hooked:
            hooks.add(hook) if hasattr(hooks, "add") else setattr(triton.knobs.runtime, "launch_enter_hook", hook)
        try:
            ids = random_routing(DEEPSEEK, 200, seed=950 + step)
            capture_step(cap, ids)
            lists = cap.snapshot_leading(200, slots).result()
        finally:
            if hooked:
                hooks.remove(hook) if hasattr(hooks, "remove") else setattr(triton.knobs.runtime, "launch_enter_hook", hooks)
        assert_snapshot_equals(lists, ids, slots[:200], DEEPSEEK)
        assert len(seen) == (0 if step < 3 else 1 if step == 3 else 2)  # the first launch compiled: no hook then


def test_clearing_snapshot_leaves_the_buffer_cleared_with_dense_layers_at_zero(narrowing):
    cap = RoutedExpertsCapturer(DEEPSEEK, max_num_tokens=128, device="cuda", dense_layers=[0, 1, 2])
    assert (cap.device_buffer[:, :3] == 0).all() and (cap.device_buffer[:, 3:] == NOT_CAPTURED).all()
    ids = random_routing(DEEPSEEK, 100, seed=11)
    ids[:, :3] = 0
    for layer in range(3, DEEPSEEK.num_layers):
        cap.capture(layer, ids[:, layer])
    lists = cap.snapshot(100, torch.arange(100, device="cuda"), clear=True).result()
    np.testing.assert_array_equal(lists.routing_data, ids.cpu().numpy().astype(np.uint8))
    assert (cap.device_buffer[:, :3] == 0).all() and (cap.device_buffer[:, 3:] == NOT_CAPTURED).all()
    # the next step: a layer that captures nothing fails the check
    for layer in range(3, DEEPSEEK.num_layers - 1):
        cap.capture(layer, ids[:50, layer])
    with pytest.raises(ValueError, match=rf"{50 * 8} expert id"):
        cap.snapshot(50, torch.arange(50, device="cuda"), clear=True).result()
