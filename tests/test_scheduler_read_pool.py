"""The memory the scheduler's reads land in (vLLM 0.28-0.30's whole-prompt reads,
``SlotRouting.read``): chunks reused once their results are dropped, written through
at start where vLLM 0.28-0.30's scheduler builds the routing. A result is never
overwritten while it, a view of it or a buffer of it is alive; the rows are the
store's; a full pool hands out arrays of their own, as every read does with the pool
switched off (``SLOTROUTE_READ_POOL=0``); reads into reserved memory take no page faults.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from slotroute.spec import RoutingSpec
from slotroute.store import RoutedExpertsManager
from slotroute.tools.bench import minor_faults
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


def vllm_configs(layers: int, top_k: int, experts: int, num_blocks: int, block_size: int):
    """What ``SlotRouting.for_vllm`` reads of vLLM's config and KV cache config."""
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers, get_num_experts_per_tok=lambda: top_k,
                            get_num_experts=lambda: experts)
    kv = SimpleNamespace(num_blocks=num_blocks,
                         kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block_size))])
    return SimpleNamespace(model_config=model), kv


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
    # what the pool holds, and each read that got an array of its own, counted
    held, past = routing.read_pool()
    assert held == routing._results.nbytes
    assert past == sum(not pooled(routing, result) for result, _ in kept) > 0


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


def test_reads_into_reserved_memory_take_no_page_faults_while_their_results_are_all_kept():
    # A rollout's shape: every prompt's rows alive until the end (NOTE 1 of _ResultPool).
    spec = RoutingSpec(num_layers=48, top_k=8, num_experts=128)  # 384 B a token
    routing = SlotRouting(RoutedExpertsManager(spec, num_blocks=4096, block_size=BLOCK), attn_gid=0)  # 24 MiB
    routing.store.populate()
    data = np.random.default_rng(0).integers(0, 128, (routing.store.num_slots, *spec.token_shape))
    routing.store.store_batch(data.astype(spec.storage_dtype), np.arange(routing.store.num_slots))
    assert routing.reserve_reads() == routing.store.num_slots * spec.bytes_per_token  # capped at the store's size
    reads = [blocks_from(64 * r, 64, 4096) for r in range(48)]  # 48 prompts of 1,024 tokens: 18 MiB kept
    before = minor_faults()
    kept = [routing.read(blocks, 1024) for blocks in reads]
    faults = minor_faults() - before
    pages = 48 * 1024 * spec.bytes_per_token // 4096
    assert all(pooled(routing, result) for result in kept)
    assert faults <= pages // 20, f"{faults} page faults writing {pages} pages of reserved memory"
    for result, blocks in zip(kept, reads):
        np.testing.assert_array_equal(result, expected(data.astype(spec.storage_dtype), blocks, 1024))


def test_vllm_0_28_to_0_30s_scheduler_reserves_the_reads_memory_at_start_and_the_connector_does_not(monkeypatch):
    from slotroute import store
    from slotroute.vllm import LAZY_STORE_ENV
    from slotroute.vllm.scheduler import SchedulerRouting

    monkeypatch.setattr(routing_module, "attention_gid", lambda kv_cache_config: 0)
    config, kv = vllm_configs(layers=48, top_k=8, experts=128, num_blocks=50000, block_size=16)  # 384 B a token
    scheduler = SchedulerRouting.for_vllm(config, kv).core  # a 293 MiB store: the reserve's cap applies
    assert scheduler._results.nbytes == routing_module.RESERVE_BYTES
    chunks = scheduler._results._chunks
    assert all(len(chunk) == routing_module.CHUNK_BYTES for chunk in chunks)
    if store._resident_bytes(chunks[0]) is not None:  # mincore, where the platform has it
        assert sum(store._resident_bytes(chunk) for chunk in chunks) >= routing_module.RESERVE_BYTES
    assert SlotRouting.for_vllm(config, kv)._results.nbytes == 0  # 0.31+: read() is not vLLM's path
    monkeypatch.setenv(LAZY_STORE_ENV, "1")
    assert SchedulerRouting.for_vllm(config, kv).core._results.nbytes == 0  # a host short of memory


def test_with_the_read_pool_off_each_read_gets_an_array_of_its_own_and_nothing_is_reserved(monkeypatch):
    from slotroute.vllm import READ_POOL_ENV
    from slotroute.vllm.scheduler import SchedulerRouting

    monkeypatch.setattr(routing_module, "attention_gid", lambda kv_cache_config: 0)
    config, kv = vllm_configs(layers=SPEC.num_layers, top_k=SPEC.top_k, experts=SPEC.num_experts, num_blocks=64,
                              block_size=BLOCK)
    monkeypatch.setenv(READ_POOL_ENV, "0")
    scheduler = SchedulerRouting.for_vllm(config, kv).core
    assert scheduler.read_pool() == (0, 0)  # nothing written through at start
    rows = fill(scheduler, 3)
    reads = [(scheduler.read(blocks_from(i, 4), 60, i % 7), blocks_from(i, 4), i % 7) for i in range(8)]
    assert scheduler._results._chunks == [] and all(result.flags.owndata for result, _, _ in reads)
    for result, blocks, start in reads:
        np.testing.assert_array_equal(result, expected(rows, blocks, 60, start))
    assert scheduler.read_pool() == (0, len(reads))  # each counted as a read that got an array of its own
    # a malformed read still raises, and a missed one still fails its request alone
    with pytest.raises(IndexError):
        scheduler.read([64], 4)
    scheduler.store.invalidate_blocks([5])
    marker = scheduler.read([4, 5], 32)
    assert marker.shape[0] == 0 and len(scheduler._missing) == 1
    np.testing.assert_array_equal(reads[0][0], expected(rows, reads[0][1], 60, 0))
    monkeypatch.setenv(READ_POOL_ENV, "1")
    assert SchedulerRouting.for_vllm(config, kv).core.read_pool()[0] > 0  # any other value: the pool, as by default
