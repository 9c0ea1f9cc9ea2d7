"""The scheduler-side ordering argument of docs/vllm.md, on vLLM's real BlockPool and
slotroute's real store: a block handed out for new data in step ``s`` is invalidated
when step ``s``'s output arrives, not earlier and not later.

Steps are driven by hand in the order vLLM's engine core uses them; with async
scheduling ``schedule()`` of step ``s + 1`` runs before ``update_from_output`` of
step ``s``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import vllm_configs

from slotroute.spec import MissingRoutingError, RoutingSpec
from slotroute.store import RoutedExpertsManager

pytestmark = pytest.mark.vllm

SPEC = RoutingSpec(num_layers=2, top_k=2, num_experts=8)
BLOCK = 4


@pytest.fixture
def pool_and_routing():
    from vllm.v1.core.block_pool import BlockPool

    from slotroute.vllm.patches import apply
    from slotroute.vllm.blocks import watch
    from slotroute.vllm.routing import SlotRouting
    from slotroute.vllm.scheduler import scheduler_patches

    # The block pool's hook, as register() installs it on every generation; idempotent.
    apply([patch for patch in scheduler_patches() if patch.qualname == "BlockPool.get_new_blocks"])
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BLOCK)
    routing = SlotRouting(RoutedExpertsManager(SPEC, num_blocks=6, block_size=BLOCK), attn_gid=0)
    watch(pool, routing.on_new_blocks)
    return pool, routing


def test_the_scheduler_store_is_committed_at_start_unless_asked_to_page_in_lazily(monkeypatch):
    from slotroute import store
    from slotroute.vllm import LAZY_STORE_ENV, routing

    if store._resident_bytes(np.zeros(1)) is None:
        pytest.skip("resident memory is read with mincore, which this platform lacks")
    monkeypatch.setattr(routing, "attention_gid", lambda kv_cache_config: 0)
    config, kv = vllm_configs(layers=64, top_k=8, experts=128, num_blocks=8192, block_size=16)  # 512 B per token
    committed = routing.SlotRouting.for_vllm(config, kv).store.stats()
    assert committed.capacity_bytes == 64 << 20 and committed.resident_bytes >= committed.capacity_bytes
    monkeypatch.setenv(LAZY_STORE_ENV, "1")
    lazy = routing.SlotRouting.for_vllm(config, kv).store.stats()
    assert lazy.resident_bytes < 16 << 20


def rows(value: int, n: int = BLOCK) -> np.ndarray:
    return np.full((n, *SPEC.token_shape), value, dtype=np.uint8)


def slots_of(block_id: int, n: int = BLOCK) -> np.ndarray:
    return block_id * BLOCK + np.arange(n)


def schedule(routing, pool, num_blocks: int):
    """One ``schedule()``: allocate blocks, seal the step."""
    blocks = pool.get_new_blocks(num_blocks)
    step = SimpleNamespace()
    routing.seal_step(step)
    return step, [b.block_id for b in blocks]


def stored_then_freed(routing, pool, value: int) -> int:
    """A block that one step filled with ``value`` and whose request then freed it."""
    step, (block,) = schedule(routing, pool, 1)
    routing.before_output(step)
    routing.store.store_batch(rows(value), slots_of(block))
    np.testing.assert_array_equal(routing.read([block], BLOCK), rows(value))
    pool.free_blocks([pool.blocks[block]])
    return block


def test_a_block_handed_out_is_unreadable_once_its_step_output_arrives(pool_and_routing):
    pool, routing = pool_and_routing
    block = stored_then_freed(routing, pool, 3)
    step2, (again,) = schedule(routing, pool, 1)
    assert again == block  # vLLM reuses the freed block first
    routing.before_output(step2)
    with pytest.raises(MissingRoutingError):
        routing.store.get([block], BLOCK)


def test_an_output_in_flight_still_serves_the_previous_owner(pool_and_routing):
    """Async scheduling: step 2 hands A's freed block to B before step 1's output
    (A's last tokens) arrives. A's read at step 1 sees A's routing; B's at step 2
    sees none of A's rows."""
    pool, routing = pool_and_routing
    step1, (block,) = schedule(routing, pool, 1)
    pool.free_blocks([pool.blocks[block]])  # A preempted while step 1 runs
    step2, (reused,) = schedule(routing, pool, 1)
    assert reused == block
    routing.before_output(step1)
    routing.store.store_batch(rows(5), slots_of(block))  # A's routing from step 1
    np.testing.assert_array_equal(routing.read([block], BLOCK), rows(5))
    routing.before_output(step2)
    routing.store.store_batch(rows(6, 2), slots_of(block, 2))  # B writes half the block
    np.testing.assert_array_equal(routing.read([block], 2), rows(6, 2))
    with pytest.raises(MissingRoutingError):
        routing.store.get([block], BLOCK)


def test_a_prefix_cache_hit_keeps_the_routing_of_its_blocks(pool_and_routing):
    pool, routing = pool_and_routing
    block = stored_then_freed(routing, pool, 7)
    pool.touch([pool.blocks[block]])  # a hit re-exposes the block; nothing handed out
    step2 = SimpleNamespace()
    routing.seal_step(step2)
    routing.before_output(step2)
    np.testing.assert_array_equal(routing.read([block], BLOCK), rows(7))


def test_an_untagged_output_applies_every_pending_invalidation(pool_and_routing):
    pool, routing = pool_and_routing
    a = stored_then_freed(routing, pool, 1)
    schedule(routing, pool, 1)  # hands `a` out again, output not yet arrived
    routing.before_output(SimpleNamespace())  # unknown step: invalidate everything queued
    with pytest.raises(MissingRoutingError):
        routing.store.get([a], BLOCK)


def test_a_missing_read_returns_an_empty_marker_and_records_the_error(pool_and_routing):
    pool, routing = pool_and_routing
    step, (block,) = schedule(routing, pool, 1)
    routing.before_output(step)
    marker = routing.read([block], BLOCK)
    assert marker.shape == (0, *SPEC.token_shape)
    assert [m is marker for m, _ in routing._missing] == [True]
    assert isinstance(routing._missing[0][1], MissingRoutingError)


# --- vLLM 0.28-0.30: block ids kept only for requests that can complete a prefill -----


class _Scheduler:
    """What ``Scheduler._update_after_schedule``'s wrapper touches: vLLM's code there
    (here: recording whether it would take its own copy of every request's block ids)."""

    def __init__(self, outputs: dict[str, int]) -> None:
        from slotroute.vllm.routing import SlotRouting
        from slotroute.vllm.scheduler import SchedulerRouting

        self.enable_return_routed_experts = True
        self.requests = {rid: SimpleNamespace(num_output_tokens=n) for rid, n in outputs.items()}
        self._re_block_ids = {"earlier": [9]}  # a step in flight's entry (async scheduling)
        blocks = {rid: [10 * i, 10 * i + 1] for i, rid in enumerate(outputs)}
        self.kv_cache_manager = SimpleNamespace(
            get_blocks=lambda rid: SimpleNamespace(get_block_ids=lambda: ([*blocks[rid]], [99])))
        core = SlotRouting(RoutedExpertsManager(SPEC, num_blocks=64, block_size=BLOCK), attn_gid=0)
        self.routed_experts_mgr = SchedulerRouting(core)
        self.copied_by_vllm = None
        self.fail = False

    def _update_after_schedule(self, scheduler_output):
        self.copied_by_vllm = self.enable_return_routed_experts
        if self.fail:
            raise RuntimeError("vLLM's code raised")


@pytest.fixture
def update_after_schedule():
    from slotroute.vllm.scheduler import _make_update_after_schedule

    return _make_update_after_schedule(_Scheduler._update_after_schedule)


def test_block_ids_are_kept_only_for_scheduled_requests_without_output_tokens(update_after_schedule):
    scheduler = _Scheduler({"prefill": 0, "decode": 5, "resumed": 2, "chunk": 0})
    update_after_schedule(scheduler, SimpleNamespace(num_scheduled_tokens={"prefill": 8, "decode": 1, "chunk": 4}))
    assert scheduler.copied_by_vllm is False  # vLLM's copy of every request's block ids skipped
    assert scheduler.enable_return_routed_experts is True
    # the attention group's ids (group 0) of the scheduled requests that have no output token
    assert scheduler._re_block_ids == {"earlier": [9], "prefill": [0, 1], "chunk": [30, 31]}


def test_vllms_flag_is_restored_when_its_code_raises(update_after_schedule):
    scheduler = _Scheduler({"prefill": 0})
    scheduler.fail = True
    with pytest.raises(RuntimeError, match="vLLM's code raised"):
        update_after_schedule(scheduler, SimpleNamespace(num_scheduled_tokens={"prefill": 8}))
    assert scheduler.enable_return_routed_experts is True


def test_without_routing_vllms_code_runs_as_it_is(update_after_schedule):
    scheduler = _Scheduler({"prefill": 0})
    scheduler.routed_experts_mgr = object()  # vLLM's own manager (SLOTROUTE_DISABLE)
    update_after_schedule(scheduler, SimpleNamespace(num_scheduled_tokens={"prefill": 8}))
    assert scheduler.copied_by_vllm is True and scheduler._re_block_ids == {"earlier": [9]}


def test_the_update_after_schedule_patch_matches_the_installed_vllm():
    from conftest import connector_generation

    from slotroute.vllm.scheduler import scheduler_patches

    if connector_generation():
        pytest.skip("vLLM 0.31+ has no routed-experts manager in its scheduler")
    (patch,) = [p for p in scheduler_patches() if p.qualname == "Scheduler._update_after_schedule"]
    assert callable(patch.verify())
