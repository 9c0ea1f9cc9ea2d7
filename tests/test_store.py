"""RoutedExpertsManager: a slot-indexed store that never returns routing it did not store."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from slotroute import store as store_module
from slotroute.spec import MissingRoutingError, RoutingSpec
from slotroute.store import RoutedExpertsManager

INPUT_DTYPES = (np.uint8, np.uint16, np.int32, np.int64)
# Storage uint8 (with and without a range check on uint8 input) and uint16.
SPECS = (
    RoutingSpec(num_layers=2, top_k=3, num_experts=7),
    RoutingSpec(num_layers=1, top_k=2, num_experts=256),
    RoutingSpec(num_layers=3, top_k=2, num_experts=300),
)
# Rows of consecutive slots in the tests of runs: the C loop copies each run whole.
RUN = 32


@contextlib.contextmanager
def _replaced(name: str, value):
    """``slotroute.store.<name>`` is ``value`` inside the context."""
    saved = getattr(store_module, name)
    setattr(store_module, name, value)
    try:
        yield
    finally:
        setattr(store_module, name, saved)


def streamed_results():
    """get() writes every result with non-temporal stores, as it does results of a
    quarter of the last-level cache or more."""
    return _replaced("STREAM_RESULTS_FROM", 0)


def numpy_only():
    """Stores built inside this context do their work in numpy, as where the C loops
    are not built."""
    return _replaced("_native", None)


@pytest.fixture(autouse=True, params=["C loops", "numpy"])
def store_path(request):
    """Every test runs on both implementations of the store: the C loops, and the plain
    numpy path they are checked against, as where the extension is not built."""
    if request.param == "C loops":
        yield request.param
        return
    with numpy_only():
        yield request.param


# Tests of the C loops themselves run once, on the C loops.
c_loops_only = pytest.mark.parametrize("store_path", ["C loops"])


@c_loops_only
def test_the_c_loops_are_built():
    # The install the tests run on builds slotroute._native; without it every
    # "C loops" case would test numpy twice.
    assert store_module._native is not None


def test_each_path_builds_stores_that_take_it(store_path):
    assert (make()._native is None) == (store_path == "numpy")


def make(spec: RoutingSpec = SPECS[0], num_blocks: int = 8, block_size: int = 4) -> RoutedExpertsManager:
    return RoutedExpertsManager(spec, num_blocks, block_size)


def routing(spec: RoutingSpec, n: int, seed: int = 0, dtype=None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, spec.num_experts, (n, *spec.token_shape))
    return data.astype(dtype or spec.storage_dtype)


class Snapshot:
    """Everything observable about a store: its buffer and which slots are readable."""

    def __init__(self, mgr: RoutedExpertsManager) -> None:
        self.buffer = mgr.routed_experts_by_slot.copy()
        self.readable = readable_slots(mgr)
        self.stats = mgr.stats()

    def assert_unchanged(self, mgr: RoutedExpertsManager) -> None:
        np.testing.assert_array_equal(mgr.routed_experts_by_slot, self.buffer)
        assert readable_slots(mgr) == self.readable
        assert mgr.stats().slots_written == self.stats.slots_written


def readable_slots(mgr: RoutedExpertsManager) -> set[int]:
    slots = set()
    for block in range(mgr.num_blocks):
        for offset in range(mgr.block_size):
            try:
                mgr.get([block], offset + 1, offset)
            except MissingRoutingError:
                continue
            slots.add(block * mgr.block_size + offset)
    return slots


# -- reference model ------------------------------------------------------------------


@st.composite
def slot_mappings(draw, num_slots: int, max_len: int = 80) -> np.ndarray:
    """Slot mappings as a step produces them, and worse: contiguous runs, scattered
    single slots, padding and repeats."""
    parts: list[int] = []
    while len(parts) < max_len and draw(st.booleans()):
        kind = draw(st.sampled_from(["run", "single", "padding", "repeat"]))
        if kind == "run":
            length = draw(st.integers(1, min(num_slots, RUN + 8)))
            start = draw(st.integers(0, num_slots - length))
            parts.extend(range(start, start + length))
        elif kind == "single":
            parts.append(draw(st.integers(0, num_slots - 1)))
        elif kind == "padding":
            parts.append(draw(st.integers(-3, -1)))
        elif parts:
            parts.append(draw(st.sampled_from(parts)))
    return np.array(parts, dtype=draw(st.sampled_from([np.int32, np.int64])))


class StoreMachine(RuleBasedStateMachine):
    """Random sequences of store_batch / invalidate_blocks / get against a plain
    dict of slot -> row, including calls that must fail and change nothing."""

    @initialize(
        spec=st.sampled_from(SPECS),
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 3, 4, 16]),
        stream=st.booleans(),
    )
    def setup(self, spec, num_blocks, block_size, stream):
        self._contexts = contextlib.ExitStack()
        if stream:
            self._contexts.enter_context(streamed_results())
        self.mgr = RoutedExpertsManager(spec, num_blocks, block_size)
        self.spec = spec
        self.ref: dict[int, np.ndarray] = {}

    @rule(data=st.data(), dtype=st.sampled_from(INPUT_DTYPES))
    def store_batch(self, data, dtype):
        slots = data.draw(slot_mappings(self.mgr.num_slots))
        rows = routing(self.spec, len(slots), seed=data.draw(st.integers(0, 2**16)), dtype=np.int64)
        # Padding rows may hold anything; they must be skipped, not checked.
        rows[slots < 0] = -5
        if np.iinfo(dtype).max < self.spec.num_experts - 1:
            dtype = np.int64
        self.mgr.store_batch(rows.astype(dtype), slots)
        for slot, row in zip(slots.tolist(), rows):
            if slot >= 0:
                self.ref[slot] = row.astype(self.spec.storage_dtype)

    @rule(data=st.data())
    def invalidate(self, data):
        # Up to FEW_BLOCKS plain ints take the Python path; longer lists and arrays numpy's.
        blocks = data.draw(st.lists(st.integers(0, self.mgr.num_blocks - 1), max_size=store_module.FEW_BLOCKS + 3))
        as_array = data.draw(st.booleans())
        self.mgr.invalidate_blocks(np.array(blocks, dtype=np.int64) if as_array else blocks)
        for block in blocks:
            for slot in range(block * self.mgr.block_size, (block + 1) * self.mgr.block_size):
                self.ref.pop(slot, None)

    @rule(data=st.data())
    def get(self, data):
        blocks = data.draw(st.lists(st.integers(0, self.mgr.num_blocks - 1), max_size=5))
        num_tokens = data.draw(st.integers(0, len(blocks) * self.mgr.block_size))
        token_start = data.draw(st.integers(0, num_tokens))
        slots = [blocks[t // self.mgr.block_size] * self.mgr.block_size + t % self.mgr.block_size for t in range(num_tokens)]
        missing = [t for t in range(token_start, num_tokens) if slots[t] not in self.ref]
        as_array = data.draw(st.booleans())
        ids = np.array(blocks, dtype=np.int64) if as_array else blocks
        if missing:
            with pytest.raises(MissingRoutingError) as info:
                self.mgr.get(ids, num_tokens, token_start)
            assert f"no routing stored for {len(missing)} of" in str(info.value)
            assert str(missing[0]) in str(info.value)
        else:
            out = self.mgr.get(ids, num_tokens, token_start)
            expected = np.array(
                [self.ref[s] for s in slots[token_start:]], dtype=self.spec.storage_dtype
            ).reshape(-1, *self.spec.token_shape)
            assert out.dtype == self.spec.storage_dtype
            np.testing.assert_array_equal(out, expected)

    @rule(data=st.data())
    def bad_batch_changes_nothing(self, data):
        n = data.draw(st.integers(1, 6))
        slots = np.arange(n, dtype=np.int64) % self.mgr.num_slots
        rows = routing(self.spec, n, dtype=np.int64)
        fault = data.draw(st.sampled_from(["slot", "expert", "negative", "shape"]))
        row = data.draw(st.integers(0, n - 1))
        if fault == "slot":
            slots[row] = self.mgr.num_slots + data.draw(st.integers(0, 5))
            error = IndexError
        elif fault == "expert":
            rows[row, 0, 0] = self.spec.num_experts + data.draw(st.integers(0, 5))
            error = ValueError
        elif fault == "negative":
            rows[row, -1, -1] = -1
            error = ValueError
        else:
            rows = rows[:, :, :-1]
            error = ValueError
        before = Snapshot(self.mgr)
        with pytest.raises(error):
            self.mgr.store_batch(rows.astype(np.int32), slots)
        before.assert_unchanged(self.mgr)

    def teardown(self):
        if hasattr(self, "_contexts"):
            self._contexts.close()

    @invariant()
    def slots_written_counts_reference(self):
        if hasattr(self, "mgr"):
            assert self.mgr.stats().slots_written == len(self.ref)


def test_store_matches_a_reference_model():
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=60, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- shape and memory -----------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.num_experts}experts")
def test_slot_buffer_has_pool_shape_in_storage_dtype(spec):
    mgr = make(spec, num_blocks=5, block_size=3)
    assert mgr.routed_experts_by_slot.shape == (15, *spec.token_shape)
    assert mgr.routed_experts_by_slot.dtype == spec.storage_dtype


def test_slot_buffer_is_a_read_only_view():
    mgr = make()
    mgr.store_batch(routing(mgr.spec, 1), [2])
    view = mgr.routed_experts_by_slot
    with pytest.raises(ValueError):
        view[2] = 0
    mgr.store_batch(routing(mgr.spec, 1, seed=9), [2])
    np.testing.assert_array_equal(view[2], routing(mgr.spec, 1, seed=9)[0])


@pytest.mark.parametrize(
    "args",
    [(0, 4), (4, 0), (-1, 4), (4.0, 4), (True, 4)],
    ids=["zero_blocks", "zero_block_size", "negative", "float", "bool"],
)
def test_constructor_rejects_non_positive_or_non_int_sizes(args):
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        RoutedExpertsManager(SPECS[0], *args)


def test_constructor_rejects_a_spec_that_is_not_a_routing_spec():
    with pytest.raises(ValueError, match="RoutingSpec"):
        RoutedExpertsManager((2, 3, 7), 4, 4)


def test_stats_report_capacity_and_slots_written():
    mgr = make(num_blocks=4, block_size=4)
    mgr.store_batch(routing(mgr.spec, 6), [0, 1, 2, 5, 5, -1])
    stats = mgr.stats()
    assert stats.capacity_bytes == 16 * mgr.spec.bytes_per_token
    assert stats.slots_written == 4
    mgr.invalidate_blocks([0])
    assert mgr.stats().slots_written == 1


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="process RSS is read from /proc")
def test_slot_buffer_costs_resident_memory_only_for_written_slots():
    spec = RoutingSpec(num_layers=64, top_k=8, num_experts=128)  # 512 B per token
    mib = 1 << 20
    data = routing(spec, 64 * mib // spec.bytes_per_token)  # 64 MiB of routing
    rss0 = _rss()
    mgr = RoutedExpertsManager(spec, num_blocks=(2 << 30) // (16 * 512), block_size=16)  # 2 GiB
    rss1 = _rss()
    assert mgr.stats().capacity_bytes == 2 << 30
    assert rss1 - rss0 < 8 * mib, "constructing the store must not touch the buffer"
    mgr.store_batch(data, np.arange(data.shape[0]) + (1 << 20))
    rss2 = _rss()
    assert 56 * mib < rss2 - rss1 < 120 * mib
    resident = mgr.stats().resident_bytes
    assert 64 * mib <= resident < 80 * mib


@pytest.mark.parametrize("madvise", ["madvise", "a byte per page"])
def test_populate_commits_the_whole_store_and_keeps_what_was_written(monkeypatch, madvise):
    from slotroute import store

    if store._resident_bytes(np.zeros(1)) is None:
        pytest.skip("resident memory is read with mincore, which this platform lacks")
    if madvise != "madvise":
        monkeypatch.setattr(store, "_MADVISE", None)  # a kernel without MADV_POPULATE_WRITE
    spec = RoutingSpec(num_layers=64, top_k=8, num_experts=128)  # 512 B per token
    mgr = RoutedExpertsManager(spec, num_blocks=8192, block_size=16)  # 64 MiB: pages of its own
    data = routing(spec, 40)
    mgr.store_batch(data, np.arange(40) + 1000)
    before = mgr.stats()
    assert before.resident_bytes < 16 << 20  # the pages of the rows written (the kernel may fault in more)
    assert mgr.populate() == mgr.stats().capacity_bytes + 8 * mgr.num_slots  # the rows and their stamps
    after = mgr.stats()
    assert after.resident_bytes >= after.capacity_bytes
    assert after.slots_written == before.slots_written == 40
    np.testing.assert_array_equal(mgr.get([62, 63, 64], 48, token_start=8), data)  # slots 1000-1039
    with pytest.raises(MissingRoutingError):
        mgr.get([0], 1)  # committed, not written
    assert not mgr.routed_experts_by_slot[:1000].any()


def test_resident_bytes_fall_back_to_written_slots_without_mincore(monkeypatch):
    from slotroute import store

    monkeypatch.setattr(store, "_MINCORE", None)
    mgr = make()
    mgr.store_batch(routing(mgr.spec, 3), [0, 9, 17])
    assert mgr.stats().resident_bytes == 3 * mgr.spec.bytes_per_token


# -- store_batch ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, dtype",
    [(s, d) for s in SPECS for d in INPUT_DTYPES if np.iinfo(d).max >= s.num_experts - 1],
    ids=lambda x: x.__name__ if isinstance(x, type) else f"{x.num_experts}experts",
)
def test_store_batch_accepts_every_input_dtype(spec, dtype):
    mgr = make(spec)
    data = routing(spec, 5, dtype=dtype)
    mgr.store_batch(data, np.array([3, 4, 5, 6, 7]))
    out = mgr.get([0, 1], 8, 3)
    assert out.dtype == spec.storage_dtype
    np.testing.assert_array_equal(out, data.astype(spec.storage_dtype))


def test_store_batch_skips_padding_rows_without_checking_them():
    mgr = make()
    data = routing(mgr.spec, 4, dtype=np.int32)
    data[1] = 999  # garbage in a padding row
    data[3] = -7
    mgr.store_batch(data, np.array([0, -1, 1, -1]))
    np.testing.assert_array_equal(mgr.get([0], 2), data[[0, 2]])
    assert mgr.stats().slots_written == 2


def test_store_batch_of_only_padding_writes_nothing():
    mgr = make()
    before = Snapshot(mgr)
    mgr.store_batch(routing(mgr.spec, 3), np.full(3, -1))
    before.assert_unchanged(mgr)


def test_store_batch_of_zero_rows_writes_nothing():
    mgr = make()
    before = Snapshot(mgr)
    mgr.store_batch(np.zeros((0, *mgr.spec.token_shape), np.uint8), np.zeros(0, np.int64))
    mgr.store_batch(np.zeros((0, *mgr.spec.token_shape), np.uint8), [])
    before.assert_unchanged(mgr)


def test_store_batch_last_write_wins_for_repeated_slots():
    mgr = make(num_blocks=2, block_size=4)
    data = routing(mgr.spec, 40, seed=3)
    slots = np.tile(np.arange(8), 5)[::-1].copy()  # every slot 5 times, out of order
    mgr.store_batch(data, slots)
    last = {s: i for i, s in enumerate(slots.tolist())}
    np.testing.assert_array_equal(mgr.get([0, 1], 8), data[[last[s] for s in range(8)]])


def test_store_batch_last_write_wins_when_a_decode_slot_repeats_inside_a_run():
    mgr = make(num_blocks=16, block_size=4)
    n = RUN * 2
    slots = np.concatenate([np.arange(n), [5, n - 1]])
    data = routing(mgr.spec, n + 2, seed=4)
    mgr.store_batch(data, slots)
    out = mgr.get(list(range(16)), n)
    np.testing.assert_array_equal(out[5], data[n])
    np.testing.assert_array_equal(out[n - 1], data[n + 1])
    np.testing.assert_array_equal(np.delete(out, [5, n - 1], axis=0), np.delete(data[:n], [5, n - 1], axis=0))


def test_store_batch_last_write_wins_when_a_run_repeats_an_earlier_decode_slot():
    mgr = make(num_blocks=16, block_size=4)
    n = RUN * 2
    slots = np.concatenate([[5, 7], np.arange(n)])
    data = routing(mgr.spec, n + 2, seed=6)
    mgr.store_batch(data, slots)
    np.testing.assert_array_equal(mgr.get(list(range(16)), n), data[2:])


def test_store_batch_last_write_wins_when_two_runs_overlap():
    mgr = make(num_blocks=32, block_size=4)
    first, second = np.arange(0, 2 * RUN), np.arange(RUN, 3 * RUN)
    data = routing(mgr.spec, 4 * RUN, seed=7)
    mgr.store_batch(data, np.concatenate([first, second]))
    out = mgr.get(list(range(32)), 3 * RUN)
    np.testing.assert_array_equal(out[:RUN], data[:RUN])
    np.testing.assert_array_equal(out[RUN:], data[2 * RUN :])


def test_store_batch_copies_runs_and_scattered_rows_to_their_slots():
    mgr = make(num_blocks=64, block_size=4)
    decode = [201, 7, 130]
    prefill = list(range(40, 40 + 2 * RUN)) + list(range(140, 140 + RUN))
    slots = np.array(decode + prefill + [3])
    data = routing(mgr.spec, len(slots), seed=5)
    mgr.store_batch(data, slots)
    for i, slot in enumerate(slots.tolist()):
        np.testing.assert_array_equal(mgr.get([slot // 4], slot % 4 + 1, slot % 4)[0], data[i])
    assert mgr.stats().slots_written == len(slots)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_store_batch_accepts_read_only_possibly_unaligned_arrays_from_the_wire(dtype):
    from slotroute.wire import RoutedExpertsLists

    spec = SPECS[2] if dtype != np.uint8 else SPECS[1]
    mgr = make(spec, num_blocks=16, block_size=4)
    data = routing(spec, 50, dtype=dtype)
    slots = np.arange(50, dtype=np.int64)[::-1].copy()
    step = RoutedExpertsLists.decode(RoutedExpertsLists(data, slots).encode())
    assert not step.routing_data.flags.writeable
    mgr.store_batch(step.routing_data, step.slot_mapping)
    np.testing.assert_array_equal(mgr.get(list(range(13)), 50), data[::-1])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int16])
def test_store_batch_accepts_slot_mappings_of_any_integer_dtype(dtype):
    mgr = make(num_blocks=80, block_size=4)
    # 256 rows, 1..255 then 0: in uint8, 0 - 255 wraps to +1, which must not
    # be taken for a continuing run.
    slots = np.concatenate([np.arange(1, 256), [0]]).astype(dtype)
    data = routing(mgr.spec, 256, seed=8)
    mgr.store_batch(data, slots)
    np.testing.assert_array_equal(mgr.get(list(range(64)), 256), np.roll(data, 1, axis=0))
    assert mgr.stats().slots_written == 256


def test_missing_routing_message_summarises_many_gaps():
    mgr = make(num_blocks=64, block_size=4)
    mgr.store_batch(routing(mgr.spec, 128), np.arange(0, 256, 2))
    with pytest.raises(MissingRoutingError, match=r"128 of tokens 0-255: tokens 1, 3, 5, 7, 9, 11, 13, 15, \.\.\. \(120 more ranges\)"):
        mgr.get(list(range(64)), 256)


def test_store_batch_accepts_non_contiguous_data():
    mgr = make(num_blocks=100, block_size=4)
    wide = routing(mgr.spec, 300, dtype=np.int32)
    data = np.asfortranarray(wide)[::-1]  # reversed rows, Fortran order
    mgr.store_batch(data, np.arange(300))  # one run: copied as a slice
    np.testing.assert_array_equal(mgr.get(list(range(75)), 300), wide[::-1])


def test_store_batch_accepts_non_contiguous_data_in_the_storage_dtype():
    mgr = make(num_blocks=100, block_size=4)
    narrow = routing(mgr.spec, 300)
    data = np.asfortranarray(narrow)[::-1]  # not rows of contiguous bytes
    slots = np.random.default_rng(9).permutation(400)[:300]
    mgr.store_batch(data, slots)
    np.testing.assert_array_equal(mgr.routed_experts_by_slot[slots], narrow[::-1])


def test_store_batch_reads_a_big_endian_slot_mapping_by_value():
    mgr = make(num_blocks=4, block_size=4)
    data = routing(mgr.spec, 3)
    mgr.store_batch(data, np.array([5, -1, 2], dtype=">i8"))
    np.testing.assert_array_equal(mgr.routed_experts_by_slot[[5, 2]], data[[0, 2]])
    assert mgr.stats().slots_written == 2
    with pytest.raises(IndexError, match="slot 16"):
        mgr.store_batch(data, np.array([0, 16, 1], dtype=">i4"))


def test_store_batch_accepts_slot_mapping_as_a_list():
    mgr = make()
    data = routing(mgr.spec, 3)
    mgr.store_batch(data, [4, -1, 6])
    np.testing.assert_array_equal(mgr.get([1], 1), data[:1])
    np.testing.assert_array_equal(mgr.get([1], 3, 2), data[2:])


def test_store_batch_accepts_all_256_uint8_ids_when_256_experts():
    spec = RoutingSpec(num_layers=1, top_k=2, num_experts=256)
    mgr = make(spec)
    data = np.array([[[0, 255]]], dtype=np.uint8)
    mgr.store_batch(data, [0])
    np.testing.assert_array_equal(mgr.get([0], 1), data)


def test_store_batch_overwrite_replaces_routing():
    mgr = make()
    mgr.store_batch(routing(mgr.spec, 4, seed=1), np.arange(4))
    newer = routing(mgr.spec, 4, seed=2)
    mgr.store_batch(newer, np.arange(4))
    np.testing.assert_array_equal(mgr.get([0], 4), newer)


@pytest.mark.parametrize(
    "spec, dtype, value",
    [
        (SPECS[0], np.uint8, 7),
        (SPECS[0], np.int32, 7),
        (SPECS[0], np.int32, -1),
        (SPECS[0], np.int64, -(2**40)),
        (SPECS[0], np.int64, 2**40 + 1),
        (SPECS[1], np.uint16, 256),  # would wrap to 0 in uint8 storage
        (SPECS[1], np.int32, 256 + 3),
        (SPECS[2], np.uint16, 300),
        (SPECS[2], np.int32, 65536 + 5),  # would wrap to 5 in uint16 storage
    ],
)
def test_store_batch_rejects_expert_id_outside_range_and_writes_nothing(spec, dtype, value):
    mgr = make(spec)
    data = routing(spec, 3, dtype=dtype)
    data[2, -1, 0] = value
    before = Snapshot(mgr)
    with pytest.raises(ValueError, match=rf"expert id {value} at row 2 \(slot 9\), layer {spec.num_layers - 1}, k 0"):
        mgr.store_batch(data, np.array([0, 1, 9]))
    before.assert_unchanged(mgr)


def test_store_batch_rejects_slot_beyond_capacity_and_writes_nothing():
    mgr = make(num_blocks=2, block_size=4)
    before = Snapshot(mgr)
    with pytest.raises(IndexError, match=r"slot 8 \(row 1\) is out of range: the store has 8 slots"):
        mgr.store_batch(routing(mgr.spec, 3), np.array([0, 8, 1]))
    before.assert_unchanged(mgr)


@pytest.mark.parametrize(
    "shape, slots_shape, match",
    [
        ((3, 2), (3,), r"data must have shape \(N, 2, 3\)"),
        ((3, 3, 3), (3,), r"data must have shape \(N, 2, 3\)"),
        ((3, 2, 2), (3,), r"data must have shape \(N, 2, 3\)"),
        ((3, 2, 3, 1), (3,), r"data must have shape \(N, 2, 3\)"),
        ((3, 2, 3), (2,), r"slot_mapping must have shape \(3,\)"),
        ((3, 2, 3), (3, 1), r"slot_mapping must have shape \(3,\)"),
    ],
)
def test_store_batch_rejects_wrong_shapes_and_writes_nothing(shape, slots_shape, match):
    mgr = make()
    before = Snapshot(mgr)
    with pytest.raises(ValueError, match=match):
        mgr.store_batch(np.zeros(shape, np.uint8), np.zeros(slots_shape, np.int64))
    before.assert_unchanged(mgr)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int16, np.uint32, np.bool_, ">i4"])
def test_store_batch_rejects_other_data_dtypes(dtype):
    mgr = make()
    before = Snapshot(mgr)
    with pytest.raises(ValueError, match="data dtype must be one of uint8, uint16, int32, int64"):
        mgr.store_batch(np.zeros((1, 2, 3), dtype), np.zeros(1, np.int64))
    before.assert_unchanged(mgr)


def test_store_batch_rejects_float_slots():
    mgr = make()
    with pytest.raises(ValueError, match="slot_mapping must hold integers"):
        mgr.store_batch(routing(mgr.spec, 2), np.array([0.0, 1.0]))


def test_store_batch_rejects_data_that_is_not_an_array():
    mgr = make()
    with pytest.raises(ValueError, match="data must be a numpy array, got list"):
        mgr.store_batch(routing(mgr.spec, 1).tolist(), [0])


# -- get ------------------------------------------------------------------------------


def test_get_reads_tokens_through_the_block_table():
    mgr = make(num_blocks=8, block_size=4)
    data = routing(mgr.spec, 10)
    blocks = [6, 1, 3]
    slots = [blocks[t // 4] * 4 + t % 4 for t in range(10)]
    mgr.store_batch(data, slots)
    np.testing.assert_array_equal(mgr.get(blocks, 10), data)
    np.testing.assert_array_equal(mgr.get(np.array(blocks, dtype=np.int32), 10), data)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.uint8, np.uint64])
def test_get_accepts_block_ids_of_any_integer_dtype(dtype):
    mgr = make(num_blocks=8, block_size=4)
    data = routing(mgr.spec, 8)
    mgr.store_batch(data, np.arange(20, 28))
    np.testing.assert_array_equal(mgr.get(np.array([6, 5], dtype=dtype), 8), np.concatenate([data[4:], data[:4]]))


def test_get_token_start_skips_leading_tokens():
    mgr = make(num_blocks=8, block_size=4)
    data = routing(mgr.spec, 12)
    mgr.store_batch(data, np.arange(12) + 8)
    np.testing.assert_array_equal(mgr.get([2, 3, 4], 11, 5), data[5:11])
    assert mgr.get([2, 3, 4], 11, 11).shape == (0, *mgr.spec.token_shape)


def test_get_of_zero_tokens_returns_an_empty_array():
    mgr = make()
    out = mgr.get([], 0)
    assert out.shape == (0, *mgr.spec.token_shape) and out.dtype == mgr.spec.storage_dtype


def test_get_returns_a_copy_that_later_writes_do_not_change():
    mgr = make()
    data = routing(mgr.spec, 4, seed=1)
    mgr.store_batch(data, np.arange(4))
    out = mgr.get([0], 4, 1)
    assert not np.shares_memory(out, mgr.routed_experts_by_slot)
    mgr.store_batch(routing(mgr.spec, 4, seed=2), np.arange(4))
    mgr.invalidate_blocks([0])
    np.testing.assert_array_equal(out, data[1:])
    out[:] = 0  # the copy is the caller's
    assert mgr.stats().slots_written == 0


def test_get_writes_into_out_and_returns_it():
    mgr = make(num_blocks=8, block_size=4)
    data = routing(mgr.spec, 12)
    mgr.store_batch(data, np.arange(12) + 8)
    whole = np.full((9, *mgr.spec.token_shape), 7, dtype=mgr.spec.storage_dtype)
    got = mgr.get([2, 3, 4], 11, 5, out=whole[3:])  # a tail of a larger array, as a caller assembles one
    assert got is not None and np.shares_memory(got, whole)
    np.testing.assert_array_equal(whole[3:], data[5:11])
    assert (whole[:3] == 7).all()


@pytest.mark.parametrize(
    "out, match",
    [
        (np.zeros((5, 2, 3), dtype=np.uint8), r"shape \(6, 2, 3\), got uint8 of shape \(5, 2, 3\)"),
        (np.zeros((6, 2, 3), dtype=np.int32), r"uint8 array of shape \(6, 2, 3\), got int32"),
        (np.zeros((6, 3, 2), dtype=np.uint8).transpose(0, 2, 1), "not C-contiguous"),
        ([[0]], "got list"),
    ],
)
def test_get_refuses_an_out_it_cannot_fill_and_writes_nothing(out, match):
    mgr = make(num_blocks=8, block_size=4)
    mgr.store_batch(routing(mgr.spec, 12), np.arange(12) + 8)
    before = mgr.routed_experts_by_slot.copy(), mgr.stats()
    with pytest.raises(ValueError, match=match):
        mgr.get([2, 3, 4], 11, 5, out=out)
    np.testing.assert_array_equal(mgr.routed_experts_by_slot, before[0])
    assert mgr.stats() == before[1]


def test_get_refuses_a_read_only_out():
    mgr = make(num_blocks=8, block_size=4)
    mgr.store_batch(routing(mgr.spec, 4), np.arange(4))
    out = np.zeros((4, *mgr.spec.token_shape), dtype=mgr.spec.storage_dtype)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mgr.get([0], 4, out=out)


def test_get_into_out_raises_for_missing_rows_as_without_it():
    mgr = make(num_blocks=8, block_size=4)
    mgr.store_batch(routing(mgr.spec, 6), [0, 1, 2, 3, 4, 6])
    out = np.empty((9, *mgr.spec.token_shape), dtype=mgr.spec.storage_dtype)
    with pytest.raises(MissingRoutingError, match=r"tokens 5, 7-8"):
        mgr.get([0, 1, 2], 9, out=out)


def test_get_raises_for_never_written_slots_naming_the_tokens():
    mgr = make(num_blocks=8, block_size=4)
    mgr.store_batch(routing(mgr.spec, 6), [0, 1, 2, 3, 4, 6])
    with pytest.raises(MissingRoutingError, match=r"no routing stored for 3 of tokens 0-8: tokens 5, 7-8"):
        mgr.get([0, 1, 2], 9)


def test_missing_routing_error_is_a_lookup_error():
    mgr = make()
    with pytest.raises(LookupError):
        mgr.get([0], 1)


def test_get_raises_after_block_invalidated():
    mgr = make()
    mgr.store_batch(routing(mgr.spec, 8), np.arange(8))
    mgr.invalidate_blocks([1])
    np.testing.assert_array_equal(mgr.get([0], 4), routing(mgr.spec, 8)[:4])
    with pytest.raises(MissingRoutingError, match="tokens 4-7"):
        mgr.get([0, 1], 8)


def test_store_after_invalidation_makes_only_rewritten_slots_readable():
    mgr = make()
    mgr.store_batch(routing(mgr.spec, 4), np.arange(4))
    mgr.invalidate_blocks(np.array([0]))
    newer = routing(mgr.spec, 2, seed=7)
    mgr.store_batch(newer, [0, 1])
    np.testing.assert_array_equal(mgr.get([0], 2), newer)
    with pytest.raises(MissingRoutingError, match="tokens 2-3"):
        mgr.get([0], 4)


def test_block_rewritten_to_its_last_slot_after_invalidation_is_readable_only_where_rewritten():
    mgr = make(num_blocks=2, block_size=4)
    mgr.store_batch(routing(mgr.spec, 8), np.arange(8))  # both blocks whole
    mgr.invalidate_blocks([1])
    newer = routing(mgr.spec, 2, seed=3)
    mgr.store_batch(newer, [6, 7])  # block 1's last slot again, not its first two
    with pytest.raises(MissingRoutingError, match="no routing stored for 2 of tokens 0-3: tokens 0-1"):
        mgr.get([1], 4)
    np.testing.assert_array_equal(mgr.get([1], 4, 2), newer)
    mgr.store_batch(newer, [4, 5])
    np.testing.assert_array_equal(mgr.get([1, 0], 8), np.concatenate([newer, newer, routing(mgr.spec, 8)[:4]]))


def test_block_whose_last_slot_is_written_before_the_others_is_read_by_its_stamps():
    mgr = make(num_blocks=2, block_size=4)
    data = routing(mgr.spec, 4)
    mgr.store_batch(data[3:], [3])
    mgr.store_batch(data[:1], [0])
    with pytest.raises(MissingRoutingError, match="tokens 1-2"):
        mgr.get([0], 4)
    mgr.store_batch(data[1:3], [1, 2])
    np.testing.assert_array_equal(mgr.get([0], 4), data)


@pytest.mark.parametrize("earlier", [[0, 1, 2], [0, 2]], ids=["head written", "head partly written"])
def test_run_completing_a_block_it_starts_inside_needs_the_head_written(earlier):
    """A chunked prefill: the block's first slots come from an earlier step."""
    mgr = make(num_blocks=3, block_size=4)
    data = routing(mgr.spec, 12)
    mgr.store_batch(data[earlier], earlier)
    mgr.store_batch(data[3:10], np.arange(3, 10))  # completes block 0 and block 1
    missing = sorted(set(range(3)) - set(earlier))
    if missing:
        with pytest.raises(MissingRoutingError, match=f"tokens {missing[0]}"):
            mgr.get([0], 4)
    else:
        np.testing.assert_array_equal(mgr.get([0], 4), data[:4])
    np.testing.assert_array_equal(mgr.get([1], 4), data[4:8])
    with pytest.raises(MissingRoutingError, match="tokens 2-3"):  # the run ends inside block 2
        mgr.get([2, 1], 8)


@pytest.mark.parametrize("blocks", [[0, 8], [-1], np.array([9], dtype=np.uint64)], ids=["beyond", "negative", "uint64"])
def test_get_rejects_block_id_out_of_range(blocks):
    mgr = make(num_blocks=8)
    with pytest.raises(IndexError, match=r"block id -?\d+ \(position \d\) is out of range \[0, 8\)"):
        mgr.get(blocks, 1)


@pytest.mark.parametrize(
    "blocks, num_tokens, token_start, match",
    [
        ([0, 1], 9, 0, r"num_tokens must be in \[0, 8\] for 2 blocks of 4, got 9"),
        ([0], -1, 0, r"num_tokens must be in \[0, 4\]"),
        ([0], 2, 3, r"token_start must be in \[0, 2\] \(num_tokens\), got 3"),
        ([0], 2, -1, r"token_start must be in \[0, 2\]"),
        ([0.0, 1.0], 1, 0, "block_ids must hold integers"),
        ([[0, 1]], 1, 0, r"block_ids must be 1-D"),
        ([0], 1.5, 0, "num_tokens must be an int"),
        ([0], 1, None, "token_start must be an int"),
    ],
)
def test_get_rejects_bad_arguments(blocks, num_tokens, token_start, match):
    mgr = make()
    mgr.store_batch(routing(mgr.spec, 8), np.arange(8))
    with pytest.raises(ValueError, match=match):
        mgr.get(blocks, num_tokens, token_start)


# -- engine-sized steps: both implementations agree -------------------------------------

# Rows of 329 and 630 bytes: runs start and end off the C loop's 16-byte stores.
ENGINE_SPECS = (RoutingSpec(47, 7, 128), RoutingSpec(45, 7, 300))


def engine_step(spec: RoutingSpec, num_blocks: int, block_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Scattered decode rows (one repeating a slot of the run after them), a run of
    about half a MiB over consecutive slots (past the C loop's streaming and GIL
    thresholds), tail padding."""
    rng = np.random.default_rng(seed)
    run_blocks = 1024 * 1024 // 2 // spec.bytes_per_token // block_size
    first = int(rng.integers(0, num_blocks - run_blocks))
    run = np.arange(first * block_size, (first + run_blocks) * block_size)
    free = np.setdiff1d(np.arange(num_blocks * block_size), run)
    decodes = rng.choice(free, 40, replace=False)
    decodes[7] = run[5]
    slots = np.concatenate([decodes, run, [-1, -1, -1]])
    return routing(spec, slots.shape[0], seed=seed), slots


@pytest.mark.parametrize(
    "spec, dtype",
    [(s, d) for s in ENGINE_SPECS for d in INPUT_DTYPES if np.iinfo(d).max >= s.num_experts - 1],
    ids=lambda v: v.storage_dtype.name if isinstance(v, RoutingSpec) else np.dtype(v).name,
)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@c_loops_only
def test_engine_sized_steps_store_and_read_the_same_in_c_and_numpy(spec, dtype, offset):
    num_blocks, block_size = 1024, 7  # runs start at any byte offset mod 16
    stores = [make(spec, num_blocks, block_size)]
    with numpy_only():
        stores.append(make(spec, num_blocks, block_size))
    assert stores[0]._native is not None and stores[1]._native is None
    expected = {}
    for seed in range(3):
        data, slots = engine_step(spec, num_blocks, block_size, seed)
        # Rows as a wire payload lays them: at any byte offset, read-only.
        raw = bytearray(offset + data.astype(dtype).nbytes)
        wire = np.frombuffer(raw, dtype=dtype, offset=offset).reshape(data.shape)
        raw[offset:] = data.astype(dtype).tobytes()
        wire.flags.writeable = False
        for mgr in stores:
            mgr.store_batch(wire, slots)
        for slot, row in zip(slots.tolist(), data):
            if slot >= 0:
                expected[slot] = row
    np.testing.assert_array_equal(stores[0].routed_experts_by_slot, stores[1].routed_experts_by_slot)
    written = sorted(expected)
    np.testing.assert_array_equal(stores[0].routed_experts_by_slot[written], np.array([expected[s] for s in written]))
    # A request over 40 shuffled, fully written blocks (past the prefetch distance).
    full = sorted({s // block_size for s in written if all(b in expected for b in range(s // block_size * block_size, (s // block_size + 1) * block_size))})
    blocks = np.random.default_rng(9).permutation(full)[:40].tolist()
    tokens = len(blocks) * block_size - 3
    want = np.array([expected[blocks[t // block_size] * block_size + t % block_size] for t in range(5, tokens)])
    for mgr in stores:
        np.testing.assert_array_equal(mgr.get(blocks, tokens, 5), want)
        np.testing.assert_array_equal(mgr.get(np.array(blocks, dtype=np.int32), tokens, 5), want)
    with streamed_results():  # blocks of 7 rows: most copies start off a 16-byte boundary
        np.testing.assert_array_equal(stores[0].get(blocks, tokens, 5), want)
        np.testing.assert_array_equal(stores[0].get(blocks, tokens - 1), stores[1].get(blocks, tokens - 1))
    assert stores[0].stats().slots_written == stores[1].stats().slots_written == len(expected)


def test_last_level_cache_is_the_largest_cache_the_kernel_reports(tmp_path):
    for index, size in {"index0": "48K", "index2": "2048K", "index3": "32768K", "index1": "32K"}.items():
        (tmp_path / "cache" / index).mkdir(parents=True)
        (tmp_path / "cache" / index / "size").write_text(size + "\n")
    assert store_module.last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert store_module.last_level_cache_bytes(str(tmp_path / "absent")) is None
    (tmp_path / "cache" / "index3" / "size").write_text("huge\n")
    assert store_module.last_level_cache_bytes(str(tmp_path)) is None


def test_get_reads_a_list_of_numpy_ints_and_rejects_ints_beyond_int64():
    mgr = make(num_blocks=8, block_size=4)
    data = routing(mgr.spec, 8)
    mgr.store_batch(data, np.arange(8))
    np.testing.assert_array_equal(mgr.get([np.int64(1), np.uint8(0)], 8), np.concatenate([data[4:], data[:4]]))
    with pytest.raises(ValueError, match="integers"):
        mgr.get([0, 2**70], 4)
    with pytest.raises(ValueError, match="integers"):
        mgr.get([True], 4)


# -- invalidate_blocks ----------------------------------------------------------------


@pytest.mark.parametrize("padding", [0, 12], ids=["short list", "long list"])
def test_invalidate_blocks_rejects_bad_ids_and_changes_nothing(padding):
    """Short lists of plain ints are checked in Python, others by numpy: same errors."""
    mgr = make(num_blocks=4)
    mgr.store_batch(routing(mgr.spec, 16), np.arange(16))
    before = Snapshot(mgr)
    pad = [1] * padding
    with pytest.raises(IndexError, match=r"block id 4 \(position 1\)"):
        mgr.invalidate_blocks([0, 4, *pad])
    with pytest.raises(IndexError, match=r"block id -1 \(position 2\)"):
        mgr.invalidate_blocks([0, 2, -1, *pad])
    with pytest.raises(ValueError, match="block_ids must hold integers"):
        mgr.invalidate_blocks([0.5, *pad])
    with pytest.raises(ValueError, match="block_ids must hold integers"):
        mgr.invalidate_blocks([True] * (1 + padding))
    before.assert_unchanged(mgr)
    mgr.invalidate_blocks([np.int64(1), 2, *pad])
    with pytest.raises(MissingRoutingError):
        mgr.get([1], 1)
    np.testing.assert_array_equal(mgr.get([0, 3], 8)[4:], routing(mgr.spec, 16)[12:16])


def test_invalidate_blocks_of_unwritten_block_is_harmless():
    mgr = make()
    mgr.invalidate_blocks([3, 3])
    mgr.store_batch(routing(mgr.spec, 4), np.arange(12, 16))
    np.testing.assert_array_equal(mgr.get([3], 4), routing(mgr.spec, 4))


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    dtype=st.sampled_from(INPUT_DTYPES),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_large_batches_match_a_dict_of_slots(spec, dtype, seed, data):
    """Batches of up to 300 rows, runs of consecutive slots, repeats and padding
    mixed in, agree with a plain dict."""
    if np.iinfo(dtype).max < spec.num_experts - 1:
        dtype = np.int32
    mgr = RoutedExpertsManager(spec, num_blocks=40, block_size=8)
    slots = data.draw(slot_mappings(mgr.num_slots, max_len=300))
    rows = routing(spec, len(slots), seed=seed, dtype=dtype)
    mgr.store_batch(rows, slots)
    ref = {s: rows[i] for i, s in enumerate(slots.tolist()) if s >= 0}
    buffer = mgr.routed_experts_by_slot
    for slot, row in ref.items():
        np.testing.assert_array_equal(buffer[slot], row)
    assert mgr.stats().slots_written == len(ref)


@pytest.mark.parametrize("shift", [1, 37, -37])
def test_store_batch_of_a_view_of_its_own_rows_stores_what_a_copy_would(shift):
    """Copying routing between blocks by passing ``routed_experts_by_slot`` rows back
    in: overlapping source and destination give exactly the result of a copy."""
    spec = RoutingSpec(num_layers=48, top_k=8, num_experts=128)  # 384-byte rows: the C loop streams runs
    mgr = make(spec, num_blocks=1100, block_size=4)
    n = 4000
    mgr.store_batch(routing(spec, 4400, seed=9), np.arange(4400))
    source = np.arange(100, 100 + n)
    expected = mgr.routed_experts_by_slot.copy()
    expected[source + shift] = expected[source]
    mgr.store_batch(mgr.routed_experts_by_slot[100 : 100 + n], source + shift)
    np.testing.assert_array_equal(mgr.routed_experts_by_slot, expected)


def test_importing_slotroute_reads_no_file_and_loads_no_library():
    """sysfs (the cache size) and libc (mincore) are read on first use, not at import."""
    import subprocess
    import sys

    code = (
        "import sys, numpy, msgspec\n"  # its dependencies first: numpy loads ctypes itself
        "seen = []\n"
        "sys.addaudithook(lambda event, args: seen.append((event, str(args[0])[:80])) "
        "if event in ('open', 'os.scandir', 'ctypes.dlopen') else None)\n"
        "import slotroute, slotroute.store, slotroute.wire, slotroute.spec\n"
        "print([s for s in seen if not s[1].endswith(('.py', '.pyc', '.so')) and '__pycache__' not in s[1] "
        "and 'site-packages' not in s[1] and 'slotroute' not in s[1]])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@c_loops_only
def test_c_statuses_are_the_ones_store_names():
    import re
    from pathlib import Path

    source = (Path(store_module.__file__).parent / "_native.c").read_text()
    enum = re.search(r"enum \{([^}]*)\};", source).group(1)
    found = {name: int(value) for name, value in re.findall(r"(\w+) = (\d+)", enum)}
    assert found == {name: i for i, name in enumerate(store_module.STATUSES)}


def _gather_direct(mgr, out, blocks, start, stop):
    return store_module._native.gather_blocks(*mgr._arrays, out, blocks, start, stop, 1 << 30)


@c_loops_only
def test_c_gather_refuses_blocks_that_do_not_cover_the_range():
    mgr = make(SPECS[0], num_blocks=8, block_size=4)
    mgr.store_batch(routing(SPECS[0], 32), np.arange(32))
    out = np.empty((10, *SPECS[0].token_shape), SPECS[0].storage_dtype)
    assert _gather_direct(mgr, out, [0, 1], 0, 10) == store_module.STATUSES.index("NOT_COVERED")
    assert _gather_direct(mgr, out, np.array([0, 1], np.int64), 0, 10) == store_module.STATUSES.index("NOT_COVERED")
    assert _gather_direct(mgr, out, [0, 1, 2], 0, 10) == store_module.STATUSES.index("OK")


@c_loops_only
@pytest.mark.parametrize(("rows", "start", "stop"), [(9, 0, 10), (11, 0, 10), (11, -1, 10), (0, 5, 4)])
def test_c_gather_refuses_an_output_or_range_that_does_not_fit(rows, start, stop):
    mgr = make(SPECS[0], num_blocks=8, block_size=4)
    mgr.store_batch(routing(SPECS[0], 32), np.arange(32))
    out = np.empty((rows, *SPECS[0].token_shape), SPECS[0].storage_dtype)
    assert _gather_direct(mgr, out, [0, 1, 2, 3], start, stop) == store_module.STATUSES.index("LAYOUT")


@c_loops_only
def test_an_unexpected_c_status_is_an_internal_error_not_a_wrong_message(monkeypatch):
    mgr = make(SPECS[0], num_blocks=8, block_size=4)
    mgr.store_batch(routing(SPECS[0], 8), np.arange(8))

    class Native:
        def __getattr__(self, name):
            return lambda *args: 42

    monkeypatch.setattr(mgr, "_native", Native())
    with pytest.raises(RuntimeError, match=r"internal error: gather_blocks returned status 42 \(unknown\)"):
        mgr.get(np.array([0, 1]), 8)


@c_loops_only
@pytest.mark.parametrize(
    "dtype", [np.uint8, np.uint16, np.int32, np.int64, np.int8, np.int16, np.uint32, np.uint64, np.float32]
)
def test_the_c_loops_accept_exactly_the_id_dtypes_of_the_spec(dtype):
    """One definition of the accepted id dtypes (spec.ID_DTYPES): the wire format and
    store_batch use it, and the C loop takes exactly those as they come."""
    from slotroute.spec import ID_DTYPES
    from slotroute.wire import ROUTING_DTYPES

    assert store_module.INPUT_DTYPES == ID_DTYPES
    assert ROUTING_DTYPES == tuple(d.str for d in ID_DTYPES)
    mgr = make(SPECS[0], num_blocks=2, block_size=4)
    data = routing(SPECS[0], 3).astype(dtype)
    status = store_module._native.store_rows(
        *mgr._arrays, data, np.arange(3, dtype=np.int64), *SPECS[0].token_shape, SPECS[0].num_experts, 1
    )
    expected = "OK" if np.dtype(dtype) in ID_DTYPES else "LAYOUT"
    assert store_module.STATUSES[status] == expected
