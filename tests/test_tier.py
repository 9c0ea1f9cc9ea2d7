"""The routing tier of offloaded KV chunks (slotroute/tier.py): rows readable only while
the offload tier holds the KV they were captured with, never beyond its capacity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from slotroute.spec import RoutingSpec
from slotroute.tier import RoutingTier

SPEC = RoutingSpec(num_layers=3, top_k=2, num_experts=16)
CHUNK = 4


def rows(value: int, n: int = CHUNK) -> np.ndarray:
    return np.full((n, *SPEC.token_shape), value % SPEC.num_experts, dtype=SPEC.storage_dtype)


def stored(tier: RoutingTier, key, value: int = 1, first: int = 0) -> RoutingTier:
    tier.expect([key])
    assert tier.put(key, first, rows(value))
    tier.complete([key])
    return tier


def test_rows_are_readable_once_their_store_completes_and_are_a_read_only_copy():
    tier = RoutingTier(SPEC)
    tier.expect([b"a"])
    data = rows(3)
    assert tier.put(b"a", 8, data) and tier.get(b"a") is None and b"a" not in tier
    tier.complete([b"a"])
    first, held = tier.get(b"a")
    data[:] = 0
    assert first == 8 and np.array_equal(held, rows(3)) and not held.flags.writeable
    assert tier.nbytes == held.nbytes


def test_a_store_that_completes_before_its_rows_are_captured_holds_nothing():
    tier = RoutingTier(SPEC)
    tier.expect([b"a"])
    tier.complete([b"a"])
    assert tier.get(b"a") is None and len(tier) == 0
    assert not tier.put(b"a", 0, rows(1))  # too late: a hit on it is recomputed


@pytest.mark.parametrize("end", ["drop", "fail", "clear", "expect"])
def test_an_evicted_failed_reset_or_restored_key_returns_no_rows(end):
    tier = stored(RoutingTier(SPEC), b"a")
    {"drop": lambda: tier.drop([b"a"]), "fail": lambda: tier.fail([b"b"]), "clear": tier.clear,
     "expect": lambda: tier.expect([b"a"])}[end]()
    if end == "fail":  # a failed store of another key leaves a completed one
        assert tier.get(b"a") is not None
    else:
        assert tier.get(b"a") is None and tier.nbytes == 0


def test_rows_offered_for_a_key_never_expected_are_not_taken():
    tier = RoutingTier(SPEC)
    assert not tier.put(b"a", 0, rows(1)) and len(tier) == 0


def test_past_its_capacity_the_oldest_keys_go_first():
    tier = RoutingTier(SPEC, capacity=2)
    stored(tier, b"a")
    stored(tier, b"b")
    tier.expect([b"c"])
    assert len(tier) == 2 and tier.get(b"a") is None and tier.get(b"b") is not None


@pytest.mark.parametrize(
    "data, first, words",
    [
        (np.zeros((4, 3), np.uint8), 0, r"rows must be \[n, 3, 2\]"),
        (np.zeros((4, 3, 2), np.int64), 0, "rows must be uint8 with at least one token"),
        (np.zeros((0, 3, 2), np.uint8), 0, "at least one token"),
        ([[0]], 0, r"rows must be \[n, 3, 2\], got list"),
        (np.zeros((4, 3, 2), np.uint8), -1, "first must be a non-negative int"),
        (np.zeros((4, 3, 2), np.uint8), 1.5, "first must be a non-negative int"),
    ],
)
def test_malformed_rows_raise_naming_what_was_expected_and_change_nothing(data, first, words):
    tier = RoutingTier(SPEC)
    tier.expect([b"a"])
    with pytest.raises(ValueError, match=words):
        tier.put(b"a", first, data)
    assert tier.put(b"a", 0, rows(1))  # still awaiting its rows


@pytest.mark.parametrize("capacity", [0, -1, 1.0, True])
def test_a_capacity_that_is_not_a_positive_int_is_refused(capacity):
    with pytest.raises(ValueError, match="capacity must be a positive int or None"):
        RoutingTier(SPEC, capacity)


KEYS = st.sampled_from([b"k%d" % i for i in range(6)])


class TierAgainstItsModel(RuleBasedStateMachine):
    """Any order of the offload tier's calls: a key is readable exactly when the plain
    model says it is (its store completed after its rows were captured, and nothing
    dropped, failed, reset or re-stored it since), with the rows captured last."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = RoutingTier(SPEC, capacity=4)
        self.order: list[bytes] = []  # keys held, oldest first
        self.rows: dict[bytes, int] = {}  # key -> value of its captured rows
        self.ready: set[bytes] = set()

    def _forget(self, key) -> None:
        if key in self.order:
            self.order.remove(key)
        self.rows.pop(key, None)
        self.ready.discard(key)

    @rule(keys=st.lists(KEYS, max_size=3))
    def expect(self, keys):
        self.tier.expect(keys)
        for key in keys:
            self._forget(key)
            self.order.append(key)
        while len(self.order) > 4:
            self._forget(self.order[0])

    @rule(key=KEYS, value=st.integers(0, 100))
    def put(self, key, value):
        taken = self.tier.put(key, 0, rows(value))
        awaiting = key in self.order and key not in self.rows
        assert taken == awaiting
        if awaiting:
            self.rows[key] = value

    @rule(keys=st.lists(KEYS, max_size=3))
    def complete(self, keys):
        self.tier.complete(keys)
        for key in keys:
            if key in self.rows:
                self.ready.add(key)
            else:
                self._forget(key)

    @rule(keys=st.lists(KEYS, max_size=3))
    def fail(self, keys):
        self.tier.fail(keys)
        for key in keys:
            if key not in self.ready:
                self._forget(key)

    @rule(keys=st.lists(KEYS, max_size=3))
    def drop(self, keys):
        self.tier.drop(keys)
        for key in keys:
            self._forget(key)

    @precondition(lambda self: self.order)
    @rule()
    def clear(self):
        self.tier.clear()
        for key in list(self.order):
            self._forget(key)

    @invariant()
    def readable_exactly_as_the_model_says(self):
        for i in range(6):
            key = b"k%d" % i
            got = self.tier.get(key)
            if key in self.ready:
                assert got is not None and np.array_equal(got[1], rows(self.rows[key]))
            else:
                assert got is None and key not in self.tier
        assert len(self.tier) == len(self.order) <= 4
        assert self.tier.nbytes == len(self.rows) * rows(0).nbytes


def test_the_tier_never_returns_rows_the_offload_tier_no_longer_holds():
    run_state_machine_as_test(TierAgainstItsModel, settings=settings(max_examples=200, stateful_step_count=30,
                                                                     deadline=None))
