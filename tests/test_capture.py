"""RoutedExpertsCapturer on CPU: layouts, errors and the synchronous snapshot."""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from slotroute import capture as capture_module
from slotroute.capture import NOT_CAPTURED, BatchLayout, RoutedExpertsCapturer, owned_copy, pack_snapshot
from slotroute.spec import RoutingSpec
from slotroute.wire import RoutedExpertsLists

SPEC = RoutingSpec(num_layers=3, top_k=2, num_experts=16)
MAX_TOKENS = 32


def routing(rng, num_tokens, spec=SPEC):
    """Random routing ``(num_tokens, num_layers, top_k)`` as int64, the reference."""
    return rng.integers(0, spec.num_experts, size=(num_tokens, *spec.token_shape), dtype=np.int64)


def capture_all(cap, rows_by_layer, layout=None, dtype=torch.int32):
    """Feed every layer: ``rows_by_layer`` is ``(rows, num_layers, top_k)``."""
    for layer in range(rows_by_layer.shape[1]):
        cap.capture(layer, torch.from_numpy(np.ascontiguousarray(rows_by_layer[:, layer])).to(dtype), layout)


def captured(cap, num_tokens):
    return cap.get_device_buffer()[:num_tokens].numpy()


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def cap():
    return RoutedExpertsCapturer(SPEC, max_num_tokens=MAX_TOKENS, device="cpu")


# --- the buffer -------------------------------------------------------------------


def test_buffer_is_int32_of_max_tokens_by_layers_by_top_k(cap):
    buf = cap.get_device_buffer()
    assert buf.dtype == torch.int32
    assert tuple(buf.shape) == (MAX_TOKENS, SPEC.num_layers, SPEC.top_k)
    assert cap.device_buffer is buf


def test_buffer_never_moves(cap, rng):
    address = cap.get_device_buffer().data_ptr()
    capture_all(cap, routing(rng, 5))
    cap.snapshot(5, np.arange(5)).result()
    cap.clear_buffer()
    assert cap.get_device_buffer().data_ptr() == address


def test_new_and_cleared_buffers_mark_every_row_not_captured(cap, rng):
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()
    capture_all(cap, routing(rng, 7))
    cap.clear_buffer()
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


def test_single_rank_is_tp_rank_0_and_ships_data(cap):
    assert cap.tp_rank == 0 and cap.is_rank0
    assert cap.copy_stream is None


# --- layouts ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8])
def test_single_rank_layout_takes_every_row(cap, rng, dtype):
    ref = routing(rng, 9)
    capture_all(cap, ref, dtype=dtype)
    np.testing.assert_array_equal(captured(cap, 9), ref)


def test_int16_ids_out_of_range_reach_the_snapshot_check(cap):
    """A monolithic kernel's int16 ids are widened as they are: a negative one is found
    by the snapshot's range check, never wrapped into a valid expert."""
    for layer in range(SPEC.num_layers):
        cap.capture(layer, torch.full((2, SPEC.top_k), -2 if layer == 1 else 3, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"the first is token 0 of the step .*layer 1: -2"):
        cap.snapshot(2, np.arange(2)).result()


def test_capture_writes_only_its_layer_and_rows(cap, rng):
    ref = routing(rng, 6)
    cap.capture(1, torch.from_numpy(ref[:, 1]))
    buf = captured(cap, MAX_TOKENS)
    np.testing.assert_array_equal(buf[:6, 1], ref[:, 1])
    assert (buf[:, [0, 2]] == NOT_CAPTURED).all()
    assert (buf[6:] == NOT_CAPTURED).all()


def test_capture_returns_the_rows_it_wrote_for_a_single_rank(cap, rng):
    assert cap.capture(0, torch.from_numpy(routing(rng, 6)[:, 0])) == 6


def test_capture_returns_this_dp_ranks_token_count_under_naive_dispatch(cap, rng):
    layout = BatchLayout(num_tokens_across_dp=(4, 7, 5), dp_rank=2)
    assert cap.capture(1, torch.from_numpy(routing(rng, 16)[:, 1]), layout) == 5


@pytest.mark.parametrize("dp_rank", [0, 1, 2])
def test_naive_dispatch_takes_this_dp_ranks_span(cap, rng, dp_rank):
    counts = (4, 7, 5)
    everyone = routing(rng, sum(counts))
    capture_all(cap, everyone, BatchLayout(num_tokens_across_dp=counts, dp_rank=dp_rank))
    start = sum(counts[:dp_rank])
    np.testing.assert_array_equal(captured(cap, counts[dp_rank]), everyone[start : start + counts[dp_rank]])
    assert (captured(cap, MAX_TOKENS)[counts[dp_rank] :] == NOT_CAPTURED).all()


def test_modular_kernel_layout_takes_every_row_of_this_dp_rank(cap, rng):
    mine = routing(rng, 7)
    capture_all(cap, mine, BatchLayout(num_tokens_across_dp=(4, 7, 5), dp_rank=1))
    np.testing.assert_array_equal(captured(cap, 7), mine)


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_gathered_sequence_parallel_shards_keep_this_dp_ranks_tokens_without_padding(cap, rng, dp_rank):
    # DP=2, TP=2: DP rank 0 has 5 tokens in shards of 3 + 3 (one padding row), DP rank 1
    # has 4 tokens in shards of 2 + 2; the dispatch gathered them DP-major, TP-minor.
    counts, local_sizes = (5, 4), (3, 3, 2, 2)
    tokens = [routing(rng, c) for c in counts]
    shards = []
    for rank_tokens, (a, b) in zip(tokens, [(3, 3), (2, 2)]):
        padded = np.concatenate([rank_tokens, routing(rng, a + b - len(rank_tokens))])
        shards.append(padded)
    gathered = np.concatenate(shards)
    layout = BatchLayout(num_tokens_across_dp=counts, dp_rank=dp_rank, tp_size=2, local_sizes=local_sizes)
    capture_all(cap, gathered, layout)
    np.testing.assert_array_equal(captured(cap, counts[dp_rank]), tokens[dp_rank])
    assert (captured(cap, MAX_TOKENS)[counts[dp_rank] :] == NOT_CAPTURED).all()


def test_sequence_parallel_shard_without_tp_group_is_refused(cap, rng):
    layout = BatchLayout(num_tokens_across_dp=(7,), dp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="tp_group"):
        cap.capture(0, torch.from_numpy(routing(rng, 4)[:, 0]), layout)
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


def test_unexpected_row_count_names_every_size_expected(cap, rng):
    layout = BatchLayout(num_tokens_across_dp=(5, 4), dp_rank=1, tp_size=2, local_sizes=(3, 3, 2, 2))
    with pytest.raises(ValueError) as info:
        cap.capture(0, torch.from_numpy(routing(rng, 6)[:, 0]), layout)
    message = str(info.value)
    for expected in ("6 rows", "9 (all DP ranks", "4 (this DP rank", "10 (gathered", "2 (this TP rank"):
        assert expected in message


# --- capture errors ---------------------------------------------------------------


@pytest.mark.parametrize("layer_id", [-1, SPEC.num_layers])
def test_layer_out_of_range_raises_index_error(cap, rng, layer_id):
    with pytest.raises(IndexError, match=rf"\[0, {SPEC.num_layers}\)"):
        cap.capture(layer_id, torch.from_numpy(routing(rng, 3)[:, 0]))
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


@pytest.mark.parametrize("shape", [(3, SPEC.top_k + 1), (3,), (3, 1, SPEC.top_k)])
def test_topk_ids_of_the_wrong_shape_raise_value_error(cap, shape):
    with pytest.raises(ValueError, match=rf"\(num_rows, {SPEC.top_k}\)"):
        cap.capture(0, torch.zeros(shape, dtype=torch.int32))
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.float16])
def test_topk_ids_of_another_dtype_raise_value_error(cap, dtype):
    with pytest.raises(ValueError, match=r"must be integers \(torch.int8, .*torch.int64\), got"):
        cap.capture(0, torch.zeros((3, SPEC.top_k), dtype=dtype))


def test_more_tokens_than_max_num_tokens_raise_value_error(cap):
    with pytest.raises(ValueError, match=f"max_num_tokens={MAX_TOKENS}"):
        cap.capture(0, torch.zeros((MAX_TOKENS + 1, SPEC.top_k), dtype=torch.int32))
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


@pytest.mark.parametrize("max_num_tokens", [0, -4, 2.5, True])
def test_capturer_refuses_a_non_positive_max_num_tokens(max_num_tokens):
    with pytest.raises(ValueError, match="max_num_tokens"):
        RoutedExpertsCapturer(SPEC, max_num_tokens=max_num_tokens, device="cpu")


def test_topk_ids_on_another_device_raise_value_error(cap):
    with pytest.raises(ValueError, match="must be on cpu"):
        cap.capture(0, torch.zeros((3, SPEC.top_k), dtype=torch.int32, device="meta"))


def test_capturer_refuses_a_device_other_than_cpu_or_cuda():
    with pytest.raises(ValueError, match="'cpu' or a CUDA device"):
        RoutedExpertsCapturer(SPEC, max_num_tokens=4, device="meta")


# --- BatchLayout ------------------------------------------------------------------


def test_layout_default_is_a_single_rank():
    layout = BatchLayout()
    assert (layout.num_tokens_across_dp, layout.dp_rank, layout.tp_size, layout.local_sizes) == (None, 0, 1, None)


def test_layout_keeps_counts_as_tuples_of_ints():
    layout = BatchLayout(num_tokens_across_dp=np.array([3, 4]), dp_rank=1, tp_size=2, local_sizes=[2, 2, 2, 2])
    assert layout.num_tokens_across_dp == (3, 4) and layout.local_sizes == (2, 2, 2, 2)
    assert hash(layout) == hash(BatchLayout((3, 4), 1, 2, (2, 2, 2, 2)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_tokens_across_dp": (3, 4), "dp_rank": 2}, r"dp_rank must be in \[0, 2\)"),
        ({"num_tokens_across_dp": (3, -1)}, "counts >= 0"),
        ({"num_tokens_across_dp": ()}, "non-empty"),
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"dp_rank": 1}, "single DP rank"),
        ({"local_sizes": (2, 2)}, "single DP rank"),
        ({"num_tokens_across_dp": (3, 4), "local_sizes": (2, 2, 2)}, "same number of shards"),
        ({"num_tokens_across_dp": (3, 4), "local_sizes": (2, 2, 2, 1)}, "DP rank 1 3 rows for its 4 tokens"),
    ],
)
def test_layout_refuses_inconsistent_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchLayout(**kwargs)


# --- snapshot -----------------------------------------------------------------------


def test_snapshot_returns_the_captured_rows_in_the_storage_dtype(cap, rng):
    ref = routing(rng, 11)
    slots = rng.permutation(100)[:11]
    capture_all(cap, ref)
    lists = cap.snapshot(11, slots).result()
    assert isinstance(lists, RoutedExpertsLists)
    assert lists.routing_data.dtype == np.uint8
    np.testing.assert_array_equal(lists.routing_data, ref)
    np.testing.assert_array_equal(lists.slot_mapping, slots)


def test_snapshot_leading_reads_the_first_num_tokens_slots_of_a_longer_row(cap, rng):
    """The runner's slot-mapping row, as long as the largest step: its first
    ``num_tokens`` entries key the step, and the buffer is cleared after the read."""
    ref = routing(rng, 9)
    row = torch.from_numpy(rng.permutation(200)[:MAX_TOKENS])
    capture_all(cap, ref)
    lists = cap.snapshot_leading(9, row).result()
    np.testing.assert_array_equal(lists.routing_data, ref)
    np.testing.assert_array_equal(lists.slot_mapping, row[:9].numpy())
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


def test_snapshot_leading_reads_a_row_of_the_runners_2d_slot_mappings(cap, rng):
    """V2's slot mappings, one row per KV-cache group: ``row`` picks the group's row."""
    ref = routing(rng, 9)
    mappings = torch.from_numpy(rng.permutation(300)[: 2 * MAX_TOKENS].reshape(2, MAX_TOKENS))
    capture_all(cap, ref)
    lists = cap.snapshot_leading(9, mappings, row=1).result()
    np.testing.assert_array_equal(lists.routing_data, ref)
    np.testing.assert_array_equal(lists.slot_mapping, mappings[1, :9].numpy())
    assert (captured(cap, MAX_TOKENS) == NOT_CAPTURED).all()


@pytest.mark.parametrize(
    "slots, row",
    [(torch.zeros(2, MAX_TOKENS, dtype=torch.int64), 2), (torch.zeros(2, MAX_TOKENS, dtype=torch.int64), -1),
     (torch.zeros(MAX_TOKENS, dtype=torch.int64), 0), (torch.zeros(2, MAX_TOKENS, dtype=torch.int64), 1.0)],
)
def test_snapshot_leading_refuses_a_row_the_slots_do_not_have_and_changes_nothing(cap, rng, slots, row):
    ref = routing(rng, 9)
    capture_all(cap, ref)
    with pytest.raises(ValueError, match=r"row must be an int in \["):
        cap.snapshot_leading(9, slots, row=row)
    np.testing.assert_array_equal(captured(cap, 9), ref)


@pytest.mark.parametrize(
    "num_tokens, slots, match",
    [
        (9, torch.arange(5), r"shape \(9,\)"),
        (9, torch.arange(MAX_TOKENS, dtype=torch.float32), "integers"),
        (MAX_TOKENS + 1, torch.arange(64), "max_num_tokens"),
        (-1, torch.arange(MAX_TOKENS), r"in \[0, 32\]"),
    ],
)
def test_snapshot_leading_refuses_what_snapshot_refuses_and_changes_nothing(cap, rng, num_tokens, slots, match):
    ref = routing(rng, 9)
    capture_all(cap, ref)
    with pytest.raises(ValueError, match=match):
        cap.snapshot_leading(num_tokens, slots)
    np.testing.assert_array_equal(captured(cap, 9), ref)


def test_snapshot_uses_uint16_above_256_experts(rng):
    spec = RoutingSpec(num_layers=2, top_k=3, num_experts=300)
    cap = RoutedExpertsCapturer(spec, max_num_tokens=8, device="cpu")
    ref = routing(rng, 8, spec)
    ref[0, 0, 0] = 299
    capture_all(cap, ref)
    lists = cap.snapshot(8, np.arange(8)).result()
    assert lists.routing_data.dtype == np.uint16
    np.testing.assert_array_equal(lists.routing_data, ref)


def test_snapshot_result_is_not_changed_by_the_next_step(cap, rng):
    first, second = routing(rng, 9), routing(rng, 9)
    slots = torch.arange(9)
    capture_all(cap, first)
    pending = cap.snapshot(9, slots)
    capture_all(cap, second)
    slots += 50
    lists = pending.result()
    np.testing.assert_array_equal(lists.routing_data, first)
    np.testing.assert_array_equal(lists.slot_mapping, np.arange(9))
    np.testing.assert_array_equal(cap.snapshot(9, slots).result().routing_data, second)


def test_snapshot_result_does_not_share_a_numpy_slot_mapping(cap, rng):
    capture_all(cap, routing(rng, 5))
    slots = np.arange(5, dtype=np.int64)
    lists = cap.snapshot(5, slots).result()
    slots += 50
    np.testing.assert_array_equal(lists.slot_mapping, np.arange(5))


def test_snapshot_result_is_the_same_object_every_time(cap, rng):
    capture_all(cap, routing(rng, 4))
    pending = cap.snapshot(4, np.arange(4))
    assert pending.done()
    assert pending.result() is pending.result()


def test_snapshot_arrays_are_the_result_fields_without_the_struct(cap, rng):
    ref = routing(rng, 6)
    capture_all(cap, ref)
    pending = cap.snapshot(6, np.arange(6) + 10)
    data, slots = pending.arrays()
    np.testing.assert_array_equal(data, ref)
    np.testing.assert_array_equal(slots, np.arange(6) + 10)
    lists = pending.result()
    assert lists.routing_data is data and lists.slot_mapping is slots


def test_snapshot_arrays_raise_as_result_does(cap, rng):
    ref = routing(rng, 3)
    ref[1, 0, 0] = SPEC.num_experts
    capture_all(cap, ref)
    pending = cap.snapshot(3, np.arange(3))
    with pytest.raises(ValueError, match=r"outside \[0, "):
        pending.arrays()
    with pytest.raises(ValueError, match=r"outside \[0, "):
        pending.result()


def test_a_discarded_snapshot_raises_instead_of_returning_rows(cap, rng):
    capture_all(cap, routing(rng, 3))
    pending = cap.snapshot(3, np.arange(3))
    pending.discard()
    for read in (pending.result, pending.arrays):
        with pytest.raises(ValueError, match="snapshot of this step of 3 tokens was discarded unread"):
            read()
    assert pending.failed_slots() is None  # nothing to drop: no step failed


def test_discarding_a_snapshot_frees_the_ring_slot_it_holds():
    """The ring's bookkeeping without a GPU: the slot whose holder is the discarded
    snapshot is free again; a slot another snapshot holds stays held."""
    from types import SimpleNamespace

    from slotroute.capture import PendingSnapshot, _packed_layout

    host = torch.zeros(256, dtype=torch.uint8)
    layout = _packed_layout(2, SPEC.bytes_per_token, SPEC.num_layers * SPEC.top_k, False)

    def held_snapshot():
        slot = SimpleNamespace(holder=None)
        slot.holder = PendingSnapshot(SPEC, 2, slot=slot, layout=layout, own_stream=False,
                                      host=(host, 0, host.numpy()), host_slots=np.arange(2))
        return slot

    freed, held = held_snapshot(), held_snapshot()
    kept = held.holder
    freed.holder.discard()
    assert freed.holder is None and held.holder is kept


def test_snapshot_of_zero_tokens_is_empty(cap):
    lists = cap.snapshot(0, np.zeros(0, dtype=np.int64)).result()
    assert lists.routing_data.shape == (0, *SPEC.token_shape)
    assert lists.slot_mapping.shape == (0,)


@pytest.mark.parametrize("bad_id", [SPEC.num_experts, SPEC.num_experts + 200, -5, 2**31 - 1, -(2**31)])
def test_expert_id_out_of_range_raises_from_result(cap, rng, bad_id):
    ref = routing(rng, 5)
    ref[3, 2, 1] = bad_id
    capture_all(cap, ref)
    pending = cap.snapshot(5, np.arange(5))
    with pytest.raises(ValueError, match=rf"1 expert id\(s\) outside \[0, {SPEC.num_experts}\)"):
        pending.result()
    with pytest.raises(ValueError):
        pending.result()


def test_rows_a_layer_did_not_capture_raise_from_result(cap, rng):
    ref = routing(rng, 6)
    capture_all(cap, ref)
    cap.clear_buffer()
    capture_all(cap, ref[:, :2])  # the last layer never runs this step
    with pytest.raises(ValueError, match=rf"{6 * SPEC.top_k} expert id.*no capture\(\) wrote"):
        cap.snapshot(6, np.arange(6)).result()


def test_cpu_snapshots_take_the_c_loop():
    # The install the tests run on builds slotroute._native; without it every CPU
    # snapshot would silently take the numpy path the next test compares it with.
    assert capture_module._native is not None


@pytest.mark.parametrize("path", ["c", "numpy"])
@pytest.mark.parametrize("num_experts", [16, 256, 300, 65536])
@pytest.mark.parametrize("slot_dtype", [np.int64, np.int32, np.uint64, "strided", "tensor"])
def test_cpu_snapshot_paths_narrow_check_and_copy_like_the_reference(monkeypatch, rng, path, num_experts, slot_dtype):
    if path == "numpy":
        monkeypatch.setattr(capture_module, "_native", None)
    spec = RoutingSpec(num_layers=3, top_k=4, num_experts=num_experts)
    cap = RoutedExpertsCapturer(spec, max_num_tokens=40, device="cpu")
    for n, bad in [(0, []), (1, []), (37, []), (40, [num_experts, -1]), (5, [2**31 - 1, -(2**31), num_experts + 1])]:
        ref = routing(rng, n, spec)
        ref[..., 0].flat[: len(bad)] = bad
        cap.clear_buffer()
        capture_all(cap, ref)
        source = rng.integers(0, 10_000, size=2 * n)
        if slot_dtype == "strided":
            slots = source[::2]
        elif slot_dtype == "tensor":
            slots = torch.from_numpy(source[:n].copy())
        else:
            slots = source[:n].astype(slot_dtype)
        expected = (slots.numpy() if isinstance(slots, torch.Tensor) else slots).astype(np.int64)
        pending = cap.snapshot(n, slots)
        capture_all(cap, routing(rng, n, spec))  # the next step leaves this one alone
        if isinstance(slots, torch.Tensor):
            slots.fill_(-7)
        else:
            slots[...] = 7
        if bad:
            with pytest.raises(ValueError, match=rf"{len(bad)} expert id\(s\) outside \[0, {num_experts}\)"):
                pending.result()
            continue
        data, owned = pending.arrays()
        assert data.dtype == spec.storage_dtype and data.shape == (n, *spec.token_shape)
        assert owned.dtype == np.int64 and owned.shape == (n,)
        np.testing.assert_array_equal(data, ref)
        np.testing.assert_array_equal(owned, expected)


@pytest.mark.parametrize("num_tokens", [-1, MAX_TOKENS + 1])
def test_snapshot_refuses_num_tokens_beyond_the_buffer(cap, num_tokens):
    with pytest.raises(ValueError, match=rf"\[0, {MAX_TOKENS}\]"):
        cap.snapshot(num_tokens, np.zeros(max(num_tokens, 0), dtype=np.int64))


@pytest.mark.parametrize(
    "slot_mapping",
    [np.arange(4), np.arange(6), np.zeros((5, 1), dtype=np.int64), np.zeros(5), torch.zeros(5), torch.zeros(5, dtype=torch.bool)],
    ids=["short", "long", "2-D", "float", "float-tensor", "bool-tensor"],
)
def test_snapshot_refuses_a_slot_mapping_of_the_wrong_shape_or_dtype(cap, slot_mapping):
    with pytest.raises(ValueError, match=r"slot_mapping must be integers of shape \(5,\)"):
        cap.snapshot(5, slot_mapping)


def test_snapshot_refuses_a_slot_mapping_on_another_device(cap):
    with pytest.raises(ValueError, match="slot_mapping must be on cpu, got meta"):
        cap.snapshot(5, torch.zeros(5, dtype=torch.int64, device="meta"))


def test_snapshot_refuses_a_bool_num_tokens(cap):
    with pytest.raises(ValueError, match="num_tokens must be an int"):
        cap.snapshot(True, np.zeros(1, dtype=np.int64))


# --- the clears: the rows written since the last one (NOTE 4 of __init__) -----------


def cleared_rows(cap):
    """The rows of the capture buffer equal to a cleared row (read in place: handing the
    buffer out would make every later clear a whole one)."""
    fill = np.full(SPEC.token_shape, NOT_CAPTURED, dtype=np.int32)
    return int(np.all(cap._buffer.numpy() == fill, axis=(1, 2)).sum())


def test_a_clear_after_a_graph_replay_refills_the_rows_its_recording_captured(rng):
    cap = RoutedExpertsCapturer(SPEC, max_num_tokens=MAX_TOKENS, device="cpu")
    cap._capturing = lambda: True  # a CUDA graph being recorded: 8 rows, padded
    capture_all(cap, rng.integers(0, 16, (8, 3, 2)))
    cap._capturing = lambda: False
    cap.snapshot(8, np.arange(8), clear=True)
    assert cleared_rows(cap) == MAX_TOKENS
    # an eager step of 20 tokens, then a replay of the 8-row graph for 3 tokens, which
    # runs no Python: it writes its 8 rows unseen (here in place, as a replay does)
    capture_all(cap, rng.integers(0, 16, (20, 3, 2)))
    cap.snapshot(20, np.arange(20), clear=True)
    assert cleared_rows(cap) == MAX_TOKENS
    cap._buffer[:8] = torch.from_numpy(rng.integers(0, 16, (8, 3, 2)).astype(np.int32))
    result = cap.snapshot(3, np.arange(3), clear=True).result()
    assert result.routing_data.shape == (3, 3, 2)
    assert cleared_rows(cap) == MAX_TOKENS  # rows 3-7, past the step's tokens, too
    # the next step's missed capture is found in every row the replay wrote
    cap._buffer[:8, 0] = 5  # a replay whose layers 1 and 2 captured nothing
    with pytest.raises(ValueError, match="outside"):
        cap.snapshot(8, np.arange(8), clear=True).result()


def test_a_clear_refills_the_largest_eager_step_since_the_last_one_and_all_once_the_buffer_is_handed_out(rng):
    cap = RoutedExpertsCapturer(SPEC, max_num_tokens=MAX_TOKENS, device="cpu")
    capture_all(cap, rng.integers(0, 16, (12, 3, 2)))
    capture_all(cap, rng.integers(0, 16, (5, 3, 2)))  # a second forward before the snapshot
    cap.snapshot(5, np.arange(5), clear=True)
    assert cleared_rows(cap) == MAX_TOKENS  # the first forward's rows 5-11 too
    cap.get_device_buffer()[30] = 7  # written by its holder, past every capture
    capture_all(cap, rng.integers(0, 16, (2, 3, 2)))
    cap.snapshot(2, np.arange(2), clear=True)
    assert cleared_rows(cap) == MAX_TOKENS


# --- one copy a step (copy_once, NOTE 5) -----------------------------------------

DENSE_SPEC = RoutingSpec(num_layers=5, top_k=2, num_experts=16)
ROUTERS = (0, 2, 3)  # layers 1 and 4 are dense


@pytest.fixture
def once():
    return RoutedExpertsCapturer(DENSE_SPEC, max_num_tokens=MAX_TOKENS, device="cpu", dense_layers=(1, 4), copy_once=True)


@pytest.fixture
def stacks(monkeypatch):
    """The torch.stack calls made from here on."""
    calls = []
    stack = torch.stack

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return stack(*args, **kwargs)

    monkeypatch.setattr(torch, "stack", counted)
    return calls


def with_dense_zeros(ref):
    expected = ref.copy()
    expected[:, [1, 4]] = 0
    return expected


def capture_routers(cap, ref, layers=ROUTERS, dtype=torch.int32):
    for layer in layers:
        cap.capture(layer, torch.from_numpy(np.ascontiguousarray(ref[:, layer])).to(dtype))


def test_one_copy_a_step_writes_every_layer_once_the_last_router_captured(once, rng, stacks):
    ref = routing(rng, 7, DENSE_SPEC)
    capture_routers(once, ref, ROUTERS[:-1])
    assert (captured(once, MAX_TOKENS) == NOT_CAPTURED)[:, list(ROUTERS)].all() and stacks == []
    capture_routers(once, ref, ROUTERS[-1:])
    assert stacks == [DENSE_SPEC.num_layers]  # one stack of every layer, the dense ones from zeros
    np.testing.assert_array_equal(captured(once, 7), with_dense_zeros(ref))
    assert (captured(once, MAX_TOKENS)[7:] != with_dense_zeros(ref)[:1]).any()
    lists = once.snapshot(7, np.arange(7)).result()
    np.testing.assert_array_equal(lists.routing_data, with_dense_zeros(ref))


def test_one_copy_a_step_returns_what_a_copy_per_layer_returns_over_random_steps_and_layouts(rng):
    per_layer = RoutedExpertsCapturer(DENSE_SPEC, max_num_tokens=MAX_TOKENS, device="cpu", dense_layers=(1, 4))
    once = RoutedExpertsCapturer(DENSE_SPEC, max_num_tokens=MAX_TOKENS, device="cpu", dense_layers=(1, 4),
                                 copy_once=True)
    for step in range(40):
        dp = BatchLayout(num_tokens_across_dp=(3, int(rng.integers(1, 20)), 4), dp_rank=1) if step % 3 == 0 else None
        rows = sum(dp.num_tokens_across_dp) if dp is not None else int(rng.integers(0, MAX_TOKENS + 1))
        ref = routing(rng, rows, DENSE_SPEC)
        dtype = torch.int64 if step % 4 == 1 else torch.int32  # int64: a copy per layer instead of the stack
        results = []
        for cap in (per_layer, once):
            counts = [cap.capture(layer, torch.from_numpy(np.ascontiguousarray(ref[:, layer])).to(dtype), dp)
                      for layer in ROUTERS]
            n = counts[0]
            results.append(cap.snapshot(n, np.arange(n), clear=True).result().routing_data)
        np.testing.assert_array_equal(results[1], results[0], err_msg=f"step {step}")
        assert results[1].shape[0] == (dp.num_tokens_across_dp[1] if dp is not None else rows)


def test_a_forward_that_starts_before_the_last_router_captured_drops_what_the_one_before_held(once, rng, stacks):
    first, second = routing(rng, 6, DENSE_SPEC), routing(rng, 6, DENSE_SPEC)
    capture_routers(once, first, ROUTERS[:-1])  # a forward that never reached its last router
    with pytest.raises(ValueError, match="top_k"):
        once.capture(0, torch.zeros((6, 3), dtype=torch.int32))  # refused: holds nothing, drops nothing
    capture_routers(once, second)
    assert stacks == [DENSE_SPEC.num_layers]
    np.testing.assert_array_equal(once.snapshot(6, np.arange(6)).result().routing_data, with_dense_zeros(second))


def test_a_snapshot_writes_what_is_held_and_reports_the_router_that_never_captured(once, rng):
    ref = routing(rng, 5, DENSE_SPEC)
    capture_routers(once, ref, ROUTERS[:-1])
    with pytest.raises(ValueError, match=rf"{5 * DENSE_SPEC.top_k} expert id.*layer {ROUTERS[-1]}.*no capture\(\) wrote"):
        once.snapshot(5, np.arange(5)).result()
    np.testing.assert_array_equal(captured(once, 5)[:, list(ROUTERS[:-1])], ref[:, list(ROUTERS[:-1])])


def test_a_clear_drops_the_ids_held_before_it(once, rng):
    ref = routing(rng, 4, DENSE_SPEC)
    capture_routers(once, ref, ROUTERS[:-1])
    once.clear_buffer()  # a forward no snapshot follows (a dummy run)
    capture_routers(once, ref, ROUTERS[-1:])
    with pytest.raises(ValueError, match="no capture"):
        once.snapshot(4, np.arange(4)).result()
    np.testing.assert_array_equal(captured(once, 4)[:, ROUTERS[-1]], ref[:, ROUTERS[-1]])


# --- the fused kernel ---------------------------------------------------------------


def test_pack_snapshot_narrows_counts_copies_slots_and_clears_in_torch():
    ids = torch.tensor([[0, 15], [16, -1], [3, 255], [7, 7]], dtype=torch.int32)
    before = ids.clone()
    fill = torch.tensor([NOT_CAPTURED, 0], dtype=torch.int32)
    rows = torch.empty(6, dtype=torch.uint8)  # the first three tokens
    counts = torch.full((1,), 99, dtype=torch.int32)
    slots_out = torch.empty(3, dtype=torch.int64)
    pack_snapshot(ids.view(-1), fill, rows, counts, torch.tensor([4, 9, 2], dtype=torch.int32), slots_out, 16, True)
    assert counts.item() == 3
    src = before[:3].reshape(-1)
    np.testing.assert_array_equal(rows[src >= 0].numpy(), src[src >= 0].numpy().astype(np.uint8))
    assert slots_out.tolist() == [4, 9, 2]
    assert ids.tolist() == [[NOT_CAPTURED, 0]] * 4


CPU_RUN = """
import sys
import numpy as np, torch
from slotroute.capture import RoutedExpertsCapturer, pack_snapshot
from slotroute.spec import RoutingSpec
cap = RoutedExpertsCapturer(RoutingSpec(num_layers=2, top_k=2, num_experts=16), max_num_tokens=4, device="cpu")
for layer in range(2):
    cap.capture(layer, torch.full((4, 2), 3, dtype=torch.int32))
assert cap.snapshot(4, np.arange(4)).result().routing_data.shape == (4, 2, 2)
pack_snapshot(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.empty(4, dtype=torch.uint8),
              torch.zeros(1, dtype=torch.int32), None, None, 16, True)
print(sorted(name for name in sys.modules if name.split(".")[0] == "triton"))
"""


def test_a_cpu_capture_and_snapshot_never_import_triton():
    """Triton is imported by the first CUDA snapshot only (in a fresh process: other
    tests import it)."""
    out = subprocess.run([sys.executable, "-c", CPU_RUN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


FUSED_KERNEL_CHECK = """
import numpy as np, torch
from slotroute import _capture_kernel
from slotroute.capture import NOT_CAPTURED, PACK_BLOCK, _fill_run, _packed_layout, pack_snapshot
rng = np.random.default_rng(7)
for num_experts, dtype, layers, top_k in ((256, torch.uint8, 5, 4), (300, torch.int16, 3, 2)):
    n, rows_in_buffer = 700, 900
    before = torch.from_numpy(rng.integers(0, num_experts, size=rows_in_buffer * layers * top_k, dtype=np.int32))
    before[[5, 4097, 2099]] = torch.tensor([num_experts, -1, 70_000], dtype=torch.int32)
    fill = torch.full((layers * top_k,), NOT_CAPTURED, dtype=torch.int32)
    fill[:top_k] = 0  # layer 0 dense
    slots_in = torch.from_numpy(rng.integers(0, 10**6, size=n).astype(np.int32))
    src = before[: n * layers * top_k].numpy()
    ok = (src >= 0) & (src < num_experts)
    for clear in (False, True):
        ids = before.clone()
        rows = torch.empty(n * layers * top_k, dtype=dtype)
        counts = torch.full((-(-(n * layers * top_k) // PACK_BLOCK),), 99, dtype=torch.int32)
        slots_out = torch.full((n,), -5, dtype=torch.int64)
        _capture_kernel.pack_snapshot(ids, fill, rows, counts, slots_in, slots_out, num_experts, clear, PACK_BLOCK)
        assert int(counts.sum()) == int((~ok).sum()) == 3, counts
        np.testing.assert_array_equal(rows.numpy().view(np.uint8 if num_experts <= 256 else np.uint16)[ok], src[ok])
        np.testing.assert_array_equal(slots_out.numpy(), slots_in.numpy())
        cleared = np.broadcast_to(fill.numpy(), (rows_in_buffer, layers * top_k))
        np.testing.assert_array_equal(ids.view(-1, layers * top_k).numpy(), cleared if clear else before.view(-1, layers * top_k).numpy())
        # the torch ops of the fallback do the same
        ids2, rows2, counts2, slots2 = before.clone(), torch.empty_like(rows), torch.empty_like(counts), torch.empty_like(slots_out)
        pack_snapshot(ids2, fill, rows2, counts2, slots_in, slots2, num_experts, clear)
        assert int(counts2.sum()) == 3
        assert torch.equal(rows2, rows) and torch.equal(slots2, slots_out) and torch.equal(ids2, ids)
        # a ring slot's whole buffer through views made once, with element offsets, and the
        # slots read from the start of a longer row (snapshot_leading): the same bytes
        row_bytes = layers * top_k * rows.element_size()
        rows_end, slots_at, counts_at, total = _packed_layout(n, row_bytes, layers * top_k, True)
        whole, ids3 = torch.full((total + 8 - total % 8,), 0x5A, dtype=torch.uint8), before.clone()
        longer = torch.cat([slots_in, torch.full((37,), -9, dtype=slots_in.dtype)])
        _capture_kernel.pack_snapshot(
            ids3, fill, whole.view(dtype), whole.view(torch.int32), longer, whole.view(torch.int64), num_experts,
            clear, PACK_BLOCK, numel=n * layers * top_k, counts_at=counts_at // 4, slots_at=slots_at // 8, num_slots=n,
        )
        assert torch.equal(whole[:rows_end].view(dtype), rows) and torch.equal(ids3, ids)
        assert torch.equal(whole[slots_at:slots_at + 8 * n].view(torch.int64), slots_out)
        assert torch.equal(whole[counts_at:total].view(torch.int32), counts)
        # the capturer's launch: each part at its own address, stores padded (PAD): the
        # same bytes, zeros in the padding, nothing written past it
        span, ids4 = torch.full((-(-total // 64) * 64 + 64,), 0x5A, dtype=torch.uint8), before.clone()
        parts = lambda: (ids4, _fill_run(fill, PACK_BLOCK), span.view(dtype), span[counts_at:].view(torch.int32),
                         longer, span[slots_at:].view(torch.int64))
        numel = n * layers * top_k
        _capture_kernel.PackLauncher(0).launch(
            ("interpreter",), (0,) * 6, (numel, ids4.numel() if clear else 0, layers * top_k, n, num_experts, 0, 0),
            (True, clear, True, PACK_BLOCK), parts,
        )
        padded_end = -(-numel // 16) * 16 * rows.element_size()
        assert numel % 16 or layers * top_k != 6  # the int16 case pads its rows
        assert torch.equal(span[:rows_end].view(dtype), rows) and torch.equal(ids4, ids)
        assert not span[rows_end:padded_end].any() and (span[padded_end:slots_at] == 0x5A).all()
        assert torch.equal(span[slots_at:slots_at + 8 * n].view(torch.int64), slots_out)
        assert torch.equal(span[counts_at:total].view(torch.int32), counts) and (span[total:] == 0x5A).all()
        # a clear of the first ids only (the rows written since the last clear), ending
        # inside a token and past a program's span: those ids refilled, in phase with
        # the tokens, the rest as they were
        for cleared_ids in (5 * layers * top_k + 3, PACK_BLOCK + 7):
            ids5 = before.clone()
            _capture_kernel.PackLauncher(0).launch(
                ("interpreter",), (0,) * 6, (numel, cleared_ids if clear else 0, layers * top_k, n, num_experts, 0, 0),
                (True, clear, True, PACK_BLOCK),
                lambda: (ids5, _fill_run(fill, PACK_BLOCK), span.view(dtype), span[counts_at:].view(torch.int32),
                         longer, span[slots_at:].view(torch.int64)),
            )
            expected = before.clone()
            if clear:
                expected[:cleared_ids] = fill.repeat(rows_in_buffer)[:cleared_ids]
            assert torch.equal(ids5, expected)
print("fused kernel ok")
"""


def test_fused_kernel_casts_and_counts_like_the_reference_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", FUSED_KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused kernel ok" in out.stdout


def host_pool(min_chunk=4096, max_chunk=16384):
    """A capturer's host pool over plain CPU memory (pinned memory needs CUDA): the
    same spans and reuse, allocations counted."""
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return capture_module._HostPool(min_chunk, max_chunk, allocate), made


def test_host_pool_spans_in_use_never_overlap_and_chunks_grow_to_the_limit():
    pool, made = host_pool()
    rng = np.random.default_rng(5)
    kept = []
    for step in range(60):
        nbytes = int(rng.integers(1, 3000))
        buffer, at, view = pool.take(nbytes)
        # whole cache lines, so that a kernel views any span as int64 and int32 alike
        assert view.nbytes % 64 == 0 and nbytes <= view.nbytes < nbytes + 64
        assert at % 64 == 0 and at + view.nbytes <= buffer.numel()
        assert view.ctypes.data == buffer.data_ptr() + at  # the view is the span the copy fills
        view[:] = step % 251
        kept.append((view, step % 251))
    for view, value in kept:  # no later span wrote over a kept one
        assert (view == value).all()
    # the pool doubles from the smallest chunk, then adds chunks of the largest
    assert made[:4] == [4096, 4096, 8192, 16384] and set(made[4:]) <= {16384}
    assert pool.nbytes == sum(made)
    big = pool.take(40000)  # a step larger than the largest chunk gets a chunk of its size
    assert made[-1] == 40000 and big[1] == 0


def test_host_pool_reuses_a_chunk_once_no_view_of_it_is_alive():
    pool, made = host_pool(min_chunk=1024, max_chunk=1024)
    first = [pool.take(400) for _ in range(2)]
    kept_row = first[1][2][10:20].view(np.int16).reshape(5, 1)  # a result's view of a view
    second = [pool.take(400) for _ in range(2)]  # the first chunk is full: a new one
    assert len(made) == 2
    del first
    third = pool.take(400)  # the first chunk still has a live view: a third chunk
    assert len(made) == 3 and third[0] is not second[0][0]
    del kept_row, second, third
    again = pool.take(700)  # past the current chunk's end, every chunk unused: the first one, from its start
    assert len(made) == 3 and again[1] == 0 and again[0] is pool._chunks[0][0]


def test_host_pool_reserve_allocates_up_front_and_steps_then_allocate_nothing():
    pool, made = host_pool(min_chunk=1024, max_chunk=4096)
    pool.reserve(10000)  # chunks of at most the largest size, whole lines
    assert made == [4096, 4096, 1856] and pool.nbytes == 10048
    pool.reserve(5000)  # already held: nothing more
    assert len(made) == 3
    spans = [pool.take(900) for _ in range(8)]  # 8 spans of 960 bytes: four in each full chunk
    assert len(made) == 3 and {span[0].data_ptr() for span in spans} == {c[0].data_ptr() for c in pool._chunks[:2]}


def test_reserve_host_on_cpu_holds_nothing_and_rejects_bad_sizes():
    cap = RoutedExpertsCapturer(RoutingSpec(num_layers=2, top_k=2, num_experts=8), max_num_tokens=4, device="cpu")
    assert cap.reserve_host(1 << 20) == 0
    for bad in (-1, 2.5, True, "1"):
        with pytest.raises(ValueError, match="nbytes must be a non-negative int"):
            cap.reserve_host(bad)


@pytest.mark.parametrize("shape,dtype", [((300, 61, 8), np.uint8), ((7, 3, 2), np.uint16), ((0, 4, 2), np.uint8), ((513,), np.int64)])
def test_owned_copy_is_an_equal_array_of_its_own(shape, dtype):
    rng = np.random.default_rng(3)
    view = rng.integers(0, 200, size=(2 * shape[0] + 1, *shape[1:])).astype(dtype)[: shape[0]]
    out = owned_copy(view)
    assert out.shape == view.shape and out.dtype == view.dtype and out.flags.owndata
    np.testing.assert_array_equal(out, view)
    if out.size:
        assert not np.shares_memory(out, view)


def test_owned_copy_keeps_the_gil_where_numpy_lets_it_go():
    """A thread spinning in Python gets no bytecode in while the copy runs: the engine's
    other threads cannot take the GIL from a copy out of the ring and make it wait."""
    import sys
    import threading
    import time

    big = np.random.default_rng(4).integers(0, 255, size=(8192, 61, 16), dtype=np.uint8)
    ticks, stop = [0], [False]

    def spin():
        while not stop[0]:
            ticks[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.2)
    spinner = threading.Thread(target=spin)
    spinner.start()

    def ticks_during(copy):
        time.sleep(0.005)  # the spinner runs; this thread then holds the GIL for a fresh interval
        before = ticks[0]
        copy(big)
        return ticks[0] - before

    try:
        ours = [ticks_during(owned_copy) for _ in range(5)]
        # the control: numpy's copy of the same bytes releases the GIL, and the spinner,
        # once woken, runs (tried until it did: waking can take longer than one copy)
        numpy_released = any(ticks_during(lambda a: np.array(a, copy=True)) for _ in range(50))
    finally:
        stop[0] = True
        spinner.join()
        sys.setswitchinterval(interval)
    np.testing.assert_array_equal(owned_copy(big), big)
    assert ours == [0] * 5
    assert numpy_released
