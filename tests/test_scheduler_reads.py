"""The scheduler's reads (vLLM 0.28-0.30's whole-prompt reads, ``SlotRouting.read``):
each result an array of its own, equal to the store's rows and untouched by later
writes or invalidations, freed when it is dropped, nothing of the reads' kept or
reserved by slotroute (``read``'s docstring says why); a malformed read raises and a
missed one fails its request alone.
"""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import vllm_configs

from slotroute.spec import RoutingSpec
from slotroute.store import RoutedExpertsManager
from slotroute.vllm import routing as routing_module
from slotroute.vllm.routing import SlotRouting

SPEC = RoutingSpec(num_layers=6, top_k=4, num_experts=64)  # 24 B a token
BLOCK = 16


@pytest.fixture
def routing():
    return SlotRouting(RoutedExpertsManager(SPEC, num_blocks=64, block_size=BLOCK), attn_gid=0)


def fill(routing, seed: int) -> np.ndarray:
    """Every slot of the store written with random ids; the rows, by slot."""
    rows = np.random.default_rng(seed).integers(0, SPEC.num_experts, (routing.store.num_slots, *SPEC.token_shape))
    rows = rows.astype(SPEC.storage_dtype)
    routing.store.store_batch(rows, np.arange(routing.store.num_slots))
    return rows


def blocks_from(first: int, count: int, num_blocks: int = 64) -> list[int]:
    return [(first + i) % num_blocks for i in range(count)]


def expected(rows: np.ndarray, blocks: list[int], num_tokens: int, token_start: int = 0) -> np.ndarray:
    slots = np.array([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(token_start, num_tokens)], dtype=np.int64)
    return rows[slots]


def test_reads_equal_the_stores_rows_and_kept_results_outlive_later_writes(routing):
    rng = np.random.default_rng(7)
    rows, kept = fill(routing, 0), []  # kept: (a result, its rows when it was read)
    for i in range(300):
        if i % 40 == 39:
            rows = fill(routing, i)  # later writes must not reach a kept result
        if i % 60 == 59:
            routing.store.invalidate_blocks(list(range(64)))  # nor later invalidations
            rows = fill(routing, i + 1000)
        count = int(rng.integers(1, 9))
        blocks = [int(b) for b in rng.choice(64, count, replace=False)]
        num_tokens = int(rng.integers(0, count * BLOCK + 1))
        start = int(rng.integers(0, num_tokens + 1))
        result, want = routing.read(blocks, num_tokens, start), expected(rows, blocks, num_tokens, start)
        np.testing.assert_array_equal(result, want)
        assert result.flags.owndata and result.flags.c_contiguous
        assert not np.shares_memory(result, routing.store.routed_experts_by_slot)
        if rng.random() < 0.3:
            kept.append((result, want))
        if kept and rng.random() < 0.2:
            kept.pop(int(rng.integers(len(kept))))
    assert kept
    for result, want in kept:
        np.testing.assert_array_equal(result, want)


def test_dropped_results_leave_nothing_of_the_reads_allocated(routing):
    # A rollout's prompt reads, every one kept until its request finishes, then dropped:
    # the memory they took is freed, none of it held back by slotroute for later reads.
    fill(routing, 0)
    routing.read(blocks_from(0, 4), 64)  # anything made once on the first read, made before the count
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [routing.read(blocks_from(i, 4), 64, i % 5) for i in range(32)]
        held = tracemalloc.get_traced_memory()[0] - before
        del kept
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held >= 32 * 59 * SPEC.bytes_per_token  # the results' own rows, at least
    assert left < 4096, f"{left} bytes still allocated after every result was dropped"


def test_a_malformed_read_raises_and_leaves_kept_results_alone(routing):
    rows = fill(routing, 0)
    kept = routing.read(blocks_from(0, 2), 32)
    with pytest.raises(ValueError, match="num_tokens"):
        routing.read(blocks_from(0, 2), 33)
    with pytest.raises(ValueError, match="token_start"):
        routing.read(blocks_from(0, 2), 10, 11)
    with pytest.raises(IndexError):
        routing.read([64], 4)
    assert routing._missing == []  # a malformed read is not a missed one
    np.testing.assert_array_equal(kept, expected(rows, blocks_from(0, 2), 32))
    np.testing.assert_array_equal(routing.read(blocks_from(3, 2), 32), expected(rows, blocks_from(3, 2), 32))


def test_a_missed_read_fails_its_request_alone(routing):
    rows = fill(routing, 0)
    kept = routing.read(blocks_from(0, 2), 32)
    routing.store.invalidate_blocks([5])
    marker = routing.read([4, 5], 32)
    assert marker.shape == (0, *SPEC.token_shape) and len(routing._missing) == 1
    np.testing.assert_array_equal(kept, expected(rows, blocks_from(0, 2), 32))
    np.testing.assert_array_equal(routing.read([4, 6], 32), expected(rows, [4, 6], 32))  # the next read is served


def test_the_scheduler_built_for_vllm_reads_into_arrays_of_their_own(monkeypatch):
    # Its store committed at start or paged in lazily: test_vllm_scheduler.py.
    from slotroute.vllm.scheduler import SchedulerRouting

    monkeypatch.setattr(routing_module, "attention_gid", lambda kv_cache_config: 0)
    config, kv = vllm_configs(layers=SPEC.num_layers, top_k=SPEC.top_k, experts=SPEC.num_experts, num_blocks=64,
                              block_size=BLOCK)
    core = SchedulerRouting.for_vllm(config, kv).core
    rows = fill(core, 3)
    reads = [(core.read(blocks_from(i, 4), 60, i % 7), blocks_from(i, 4), i % 7) for i in range(8)]
    for result, blocks, start in reads:
        assert result.flags.owndata
        np.testing.assert_array_equal(result, expected(rows, blocks, 60, start))


# -- reads made ahead (NOTE 2 of SchedulerRouting, on unless SLOTROUTE_READ_AHEAD=0) ----


def test_blocks_in_flux_are_those_handed_out_or_written_since_the_last_output_and_none_while_one_is_due(routing):
    out = [SimpleNamespace() for _ in range(4)]
    routing.on_new_blocks([SimpleNamespace(block_id=b) for b in (1, 2)])
    routing.seal_step(out[1])
    assert routing.blocks_in_flux() == {1, 2}  # step 1 in flight, every earlier output in
    routing.before_output(out[1])
    routing.on_new_blocks([SimpleNamespace(block_id=3)])
    routing.seal_step(out[2])
    routing.write_after_allocation(np.array([5 * BLOCK + 1]), np.zeros((1, *SPEC.token_shape), SPEC.storage_dtype))
    routing.on_new_blocks([SimpleNamespace(block_id=7)])  # handed out after the step was scheduled
    assert routing.blocks_in_flux() == {3, 5, 7}
    routing.seal_step(out[3])
    assert routing.blocks_in_flux() is None  # step 2's output is still due: its rows are not stored


def _ahead_step(monkeypatch):
    """A SchedulerRouting reading ahead (the default), step 1's output in and step 2
    scheduled: ``a`` (48 prompt tokens over blocks 0-2) and ``b`` (48 over 3-5) complete
    their prefill in step 2, which computes their last 16 tokens; block 3 was handed out
    in step 2."""
    from slotroute.vllm.scheduler import SchedulerRouting

    monkeypatch.delenv("SLOTROUTE_READ_AHEAD", raising=False)
    manager = SchedulerRouting(SlotRouting(RoutedExpertsManager(SPEC, num_blocks=64, block_size=BLOCK), attn_gid=0))
    rows = fill(manager.core, 11)
    first, second = SimpleNamespace(), SimpleNamespace(num_scheduled_tokens={"a": 16, "b": 16})
    manager.core.seal_step(first)
    manager.core.before_output(first)
    manager.core.on_new_blocks([SimpleNamespace(block_id=3)])
    manager.core.seal_step(second)
    manager._scheduled = second
    requests = {r: SimpleNamespace(num_output_tokens=0, num_prompt_tokens=48, num_computed_tokens=48,
                                   sampling_params=None) for r in "ab"}
    scheduler = SimpleNamespace(requests=requests, _re_block_ids={"a": [0, 1, 2], "b": [3, 4, 5]})
    return manager, scheduler, second, rows


def test_a_prompt_read_ahead_returns_the_rows_a_whole_read_at_its_output_returns(monkeypatch):
    manager, scheduler, step, rows = _ahead_step(monkeypatch)
    assert manager.reads_ahead
    manager.read_ahead(scheduler)
    assert set(manager._ahead) == {"a"}  # b's first block is in flux: b is read whole at its output
    assert (manager.reads_made_ahead, manager.reads_served_ahead) == (1, 0)
    ahead = manager._ahead["a"][4]
    np.testing.assert_array_equal(ahead[:32], expected(rows, [0, 1, 2], 32))
    # step 2's output: its invalidations, then its rows (a's and b's last 16 tokens)
    manager.core.before_output(step)
    new = np.random.default_rng(12).integers(0, SPEC.num_experts, (32, *SPEC.token_shape)).astype(SPEC.storage_dtype)
    slots = np.concatenate([np.arange(2 * BLOCK, 3 * BLOCK), np.arange(5 * BLOCK, 6 * BLOCK)])
    manager.store_batch(new, slots)
    rows[slots] = new
    manager.match_reads_ahead(scheduler)
    got_a = manager.get(scheduler._re_block_ids.pop("a"), 48)
    assert got_a is ahead and (manager.reads_made_ahead, manager.reads_served_ahead) == (1, 1)
    np.testing.assert_array_equal(got_a, expected(rows, [0, 1, 2], 48))
    assert manager.get(scheduler._re_block_ids.pop("b"), 48).shape == (0, *SPEC.token_shape)  # block 3 invalidated
    assert len(manager.core._missing) == 1
    manager.forget_reads_ahead()
    assert not manager._ahead and not manager._ahead_by_list


def test_a_read_other_than_the_one_made_ahead_is_read_whole(monkeypatch):
    manager, scheduler, step, rows = _ahead_step(monkeypatch)
    manager.read_ahead(scheduler)
    ahead = manager._ahead["a"][4]
    manager.core.before_output(step)
    manager.match_reads_ahead(scheduler)
    for args in (([0, 1, 2], 48), (scheduler._re_block_ids["a"], 48, 5), (scheduler._re_block_ids["a"], 40)):
        got = manager.get(*args)
        assert got is not ahead and manager.reads_served_ahead == 0
        np.testing.assert_array_equal(got, expected(rows, [0, 1, 2], *args[1:]))


def test_no_read_is_made_ahead_while_an_earlier_output_is_due_or_with_the_reads_ahead_off(monkeypatch):
    manager, scheduler, step, rows = _ahead_step(monkeypatch)
    manager.core.seal_step(SimpleNamespace())  # a third step scheduled before step 2's output
    manager._scheduled = step
    manager.read_ahead(scheduler)
    assert not manager._ahead and manager._scheduled is None
    monkeypatch.setenv("SLOTROUTE_READ_AHEAD", "0")
    from slotroute.vllm.scheduler import SchedulerRouting

    plain = SchedulerRouting(manager.core)
    plain._scheduled = step
    plain.read_ahead(scheduler)
    assert not plain.reads_ahead and not plain._ahead


@pytest.mark.parametrize("setting", ["yes", "2", "off"])
def test_a_reads_ahead_setting_other_than_0_or_1_names_the_variable(monkeypatch, setting):
    from slotroute.vllm.scheduler import SchedulerRouting

    monkeypatch.setenv("SLOTROUTE_READ_AHEAD", setting)
    core = SlotRouting(RoutedExpertsManager(SPEC, num_blocks=64, block_size=BLOCK), attn_gid=0)
    with pytest.raises(ValueError, match="SLOTROUTE_READ_AHEAD must be 0, 1 or unset"):
        SchedulerRouting(core)
    monkeypatch.setenv("SLOTROUTE_READ_AHEAD", " 1 ")
    assert SchedulerRouting(core).reads_ahead


def test_the_reads_ahead_look_up_only_the_requests_still_prefilling(monkeypatch):
    """After a step of 256 decoding requests and one prefilling one, ``read_ahead``
    looks up the prefilling request alone (the decoding ones hold no block-id
    snapshot): its cost follows the prompts in flight, not the batch."""
    manager, scheduler, step, rows = _ahead_step(monkeypatch)

    class Counted(dict):
        looked_up: list = []

        def get(self, key, default=None):
            self.looked_up.append(key)
            return super().get(key, default)

    decoding = {f"d{i}": SimpleNamespace(num_output_tokens=3, num_prompt_tokens=20, num_computed_tokens=22,
                                         sampling_params=None) for i in range(256)}
    step.num_scheduled_tokens = {**{r: 1 for r in decoding}, "a": 16}
    scheduler.requests = Counted({**decoding, "a": scheduler.requests["a"]})
    del scheduler._re_block_ids["b"]
    assert manager.reads_ahead
    manager.read_ahead(scheduler)
    assert Counted.looked_up == ["a"] and set(manager._ahead) == {"a"}
