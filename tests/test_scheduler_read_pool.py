"""The memory the scheduler's reads land in (vLLM 0.28-0.30's whole-prompt reads,
``SlotRouting.read``): chunks reused once their results are dropped. A result is
never overwritten while it, a view of it or a buffer of it is alive; the rows are the
store's; a full pool hands out arrays of their own.
"""

from __future__ import annotations

import numpy as np
import pytest

from slotroute.spec import RoutingSpec
from slotroute.store import RoutedExpertsManager
from slotroute.vllm import routing as routing_module
from slotroute.vllm.routing import SlotRouting

SPEC = RoutingSpec(num_layers=6, top_k=4, num_experts=64)  # 24 B a token
BLOCK = 16
CHUNK = 4096  # 170 tokens a chunk


@pytest.fixture
def routing(monkeypatch):
    monkeypatch.setattr(routing_module, "CHUNK_BYTES", CHUNK)
    return SlotRouting(RoutedExpertsManager(SPEC, num_blocks=64, block_size=BLOCK), attn_gid=0)


def fill(routing, seed: int) -> np.ndarray:
    """Every slot of the store written with random ids; the rows, by slot."""
    rows = np.random.default_rng(seed).integers(0, SPEC.num_experts, (routing.store.num_slots, *SPEC.token_shape))
    rows = rows.astype(SPEC.storage_dtype)
    routing.store.store_batch(rows, np.arange(routing.store.num_slots))
    return rows


def blocks_from(first: int, count: int, num_blocks: int = 64) -> list[int]:
    return [(first + i) % num_blocks for i in range(count)]


def pooled(routing, result: np.ndarray) -> bool:
    """Whether ``result`` lies on one of the pool's chunks."""
    return any(np.shares_memory(result, chunk) for chunk in routing._results._chunks)


def expected(rows: np.ndarray, blocks: list[int], num_tokens: int, token_start: int = 0) -> np.ndarray:
    slots = np.array([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(token_start, num_tokens)], dtype=np.int64)
    return rows[slots]


def test_a_kept_result_is_never_overwritten_by_later_reads_or_writes(routing):
    rows = fill(routing, 0)
    kept = routing.read(blocks_from(0, 4), 60, 3)
    want = expected(rows, blocks_from(0, 4), 60, 3)
    assert pooled(routing, kept)  # the case this test is about
    for i in range(50):  # many chunks' worth, every other result dropped at once
        rows = fill(routing, i + 1)
        routing.read(blocks_from(i, 5), 70)
    np.testing.assert_array_equal(kept, want)


def test_a_view_or_a_buffer_of_a_result_keeps_its_rows(routing):
    rows = fill(routing, 0)
    result = routing.read(blocks_from(0, 4), 64)
    want = expected(rows, blocks_from(0, 4), 64)
    part, buffer = result[10:20], memoryview(result)  # what vLLM's serializer holds until a message is sent
    del result
    for i in range(50):
        fill(routing, i + 1)
        routing.read(blocks_from(i, 5), 70)
    np.testing.assert_array_equal(part, want[10:20])
    np.testing.assert_array_equal(np.asarray(buffer), want)


def test_chunks_are_reused_once_their_results_are_dropped(routing):
    rows = fill(routing, 0)
    for i in range(200):
        result = routing.read(blocks_from(i, 4), 64)
        np.testing.assert_array_equal(result, expected(rows, blocks_from(i, 4), 64))
        del result
    assert routing._results.nbytes == CHUNK


def test_a_full_pool_hands_out_arrays_of_their_own(monkeypatch):
    monkeypatch.setattr(routing_module, "CHUNK_BYTES", CHUNK)
    routing = SlotRouting(RoutedExpertsManager(SPEC, num_blocks=16, block_size=BLOCK), attn_gid=0)  # 6 KiB
    rows = fill(routing, 0)
    kept = [(routing.read(blocks_from(i, 4, 16), 64), blocks_from(i, 4, 16)) for i in range(16)]  # 24 KiB kept
    assert routing._results.nbytes <= routing.store.num_slots * SPEC.bytes_per_token
    assert pooled(routing, kept[0][0]) and not pooled(routing, kept[-1][0])
    for result, blocks in kept:
        np.testing.assert_array_equal(result, expected(rows, blocks, 64))


def test_pooled_reads_equal_the_stores_rows_over_random_reads(routing):
    rng = np.random.default_rng(7)
    rows, kept = fill(routing, 0), []  # kept: (a result, its rows when it was read)
    for i in range(300):
        if i % 40 == 39:
            rows = fill(routing, i)  # later writes must not reach a kept result
        count = int(rng.integers(1, 9))
        blocks = [int(b) for b in rng.choice(64, count, replace=False)]
        num_tokens = int(rng.integers(0, count * BLOCK + 1))
        start = int(rng.integers(0, num_tokens + 1))
        result, want = routing.read(blocks, num_tokens, start), expected(rows, blocks, num_tokens, start)
        np.testing.assert_array_equal(result, want)
        if rng.random() < 0.3:
            kept.append((result, want))
        if kept and rng.random() < 0.2:
            kept.pop(int(rng.integers(len(kept))))
        del result
    assert kept
    for result, want in kept:
        np.testing.assert_array_equal(result, want)


def test_a_malformed_read_raises_and_leaves_kept_results_alone(routing):
    rows = fill(routing, 0)
    kept = routing.read(blocks_from(0, 2), 32)
    with pytest.raises(ValueError, match="num_tokens"):
        routing.read(blocks_from(0, 2), 33)
    with pytest.raises(ValueError, match="token_start"):
        routing.read(blocks_from(0, 2), 10, 11)
    with pytest.raises(IndexError):
        routing.read([64], 4)
    np.testing.assert_array_equal(kept, expected(rows, blocks_from(0, 2), 32))
    np.testing.assert_array_equal(routing.read(blocks_from(3, 2), 32), expected(rows, blocks_from(3, 2), 32))


def test_a_missed_read_from_the_pool_still_fails_its_request_alone(routing):
    rows = fill(routing, 0)
    kept = routing.read(blocks_from(0, 2), 32)
    routing.store.invalidate_blocks([5])
    marker = routing.read([4, 5], 32)
    assert marker.shape[0] == 0 and len(routing._missing) == 1
    np.testing.assert_array_equal(kept, expected(rows, blocks_from(0, 2), 32))
