"""What slotroute's connector answers to vLLM's configuration check and to vLLM 0.33's
cache-hit calls, without an engine (vLLM's config enters as plain objects with the
attributes the check reads). The patch sets themselves are verified against installed
vLLMs in test_vllm_plugin.py and, for 0.33, against its wheel in test_vllm_0_33.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slotroute.spec import RoutingSpec
from slotroute.tools.bench import make_scheduler_read_workload
from slotroute.vllm.connector import PD_CONNECTORS, _make_verify_config


def config(kv_connector: str | None = None, **changes) -> SimpleNamespace:
    """A VllmConfig as ``_verify_aux_output_compatibility`` reads it: routed experts on,
    a generate runner, a MoE model, no PP/DCP/PCP, and ``kv_connector`` if given."""
    kv = None
    if kv_connector is not None:
        kv = SimpleNamespace(kv_connector=kv_connector, has_connector=lambda name: name == kv_connector)
    base = dict(
        aux_output_config=SimpleNamespace(enabled=True),
        model_config=SimpleNamespace(runner_type="generate", is_moe=True),
        speculative_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        kv_transfer_config=kv,
    )
    base.update(changes)
    return SimpleNamespace(**base)


@pytest.fixture
def verify():
    return _make_verify_config(None), None


def test_a_config_vllm_accepts_is_accepted_without_the_v2_runner_or_prefix_caching(verify):
    check, _ = verify
    check(config())  # nothing about the runner or prefix caching is read


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"model_config": SimpleNamespace(runner_type="pooling", is_moe=True)}, "AuxOutput Connector only supports generate runners."),
        ({"model_config": SimpleNamespace(runner_type="generate", is_moe=False)}, "AuxOutput Connector only supports MoE models."),
        ({"speculative_config": SimpleNamespace(enable_adaptive_verification=True)},
         "--enable-return-routed-experts is incompatible with adaptive speculative verification."),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=2, decode_context_parallel_size=1,
                                             prefill_context_parallel_size=1)},
         "--enable-return-routed-experts is incompatible with pipeline parallelism (PP > 1)."),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=2,
                                             prefill_context_parallel_size=1)},
         "--enable-return-routed-experts is incompatible with context parallelism (DCP/PCP > 1)."),
    ],
)
def test_what_vllm_refuses_is_refused_in_vllms_words(verify, changes, words):
    check, _ = verify
    with pytest.raises(ValueError) as raised:
        check(config(**changes))
    assert str(raised.value) == words


@pytest.mark.parametrize("name", PD_CONNECTORS)
def test_pd_connectors_are_refused_in_vllms_words(verify, name):
    check, _ = verify
    with pytest.raises(ValueError) as raised:
        check(config(name))
    assert str(raised.value) == f"--enable-return-routed-experts is incompatible with {name}; PD auxiliary output is not supported."


@pytest.mark.parametrize("name", ["OffloadingConnector", "LMCacheConnectorV1", "ExampleConnector"])
def test_other_kv_connectors_are_served_their_hits_capped_to_the_routing_held(verify, name):
    check, _ = verify
    check(config(name))


@pytest.mark.parametrize("enable_dbo, ubatch_size", [(True, 0), (False, 2)])
def test_micro_batching_is_refused_naming_its_options(verify, enable_dbo, ubatch_size):
    check, _ = verify
    parallel = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               use_ubatching=enable_dbo or ubatch_size > 1)
    with pytest.raises(ValueError, match=r"micro-batching with slotroute \(--enable-dbo or --ubatch-size > 1\)"):
        check(config(parallel_config=parallel))


def test_micro_batching_is_refused_as_the_engine_starts_on_0_28_to_0_30():
    """vLLM 0.28-0.30 have no configuration check to patch: the scheduler's routing
    manager, which slotroute builds at engine start, refuses it with the same words."""
    from slotroute.vllm.scheduler import _make_manager

    parallel = SimpleNamespace(use_ubatching=True)
    with pytest.raises(ValueError, match=r"micro-batching with slotroute \(--enable-dbo or --ubatch-size > 1\)"):
        _make_manager(None)(SimpleNamespace(parallel_config=parallel), kv_cache_config=None)


def _scheduler(partial_hits: bool, routing=None) -> SimpleNamespace:
    """A vLLM ``Scheduler`` as its ``__init__`` leaves it, for the parts the wrappers read."""
    coordinator = SimpleNamespace(enable_partial_hash_hits=partial_hits)
    return SimpleNamespace(
        kv_cache_manager=SimpleNamespace(coordinator=coordinator, block_pool=SimpleNamespace(evict_blocks=lambda blocks: None)),
        aux_output_connector=object(), enable_return_routed_experts=True, routed_experts_mgr=routing,
    )


def test_prefix_cache_hits_inside_a_block_are_refused_as_the_engine_starts_on_every_generation():
    """Partial hash hits copy a hit's KV into a new block (copy-on-write) that routing does
    not follow: refused, naming the options, by the scheduler of 0.28-0.30 and 0.31+."""
    from slotroute.store import RoutedExpertsManager
    from slotroute.vllm import connector, scheduler
    from slotroute.vllm.routing import SlotRouting

    def built(self, *args, **kwargs):
        pass

    routing = scheduler.SchedulerRouting(SlotRouting(RoutedExpertsManager(RoutingSpec(2, 2, 4), 4, 4), 0))
    words = r"prefix-cache hits inside a KV block with slotroute .*--no-enable-prefix-caching.*--mamba-cache-mode"
    for init in (scheduler._make_scheduler_init(built), connector._make_scheduler_init(built, False)):
        with pytest.raises(ValueError, match=words):
            init(_scheduler(True, routing))
    # Without them the 0.28-0.30 wrapper connects its routing to the block pool.
    served = _scheduler(False, routing)
    scheduler._make_scheduler_init(built)(served)
    assert routing.core._evict_cached is served.kv_cache_manager.block_pool.evict_blocks


def test_a_speculative_draft_models_own_config_is_not_checked(verify):
    """vLLM builds a configuration for a draft model with the target's aux-output
    config and the ``draft`` runner; vLLM's check refuses it as not a generate runner.
    The target's configuration was checked: the drafter's passes."""
    check, _ = verify
    check(config("NixlConnector", model_config=SimpleNamespace(runner_type="draft", is_moe=False)))


def test_routing_off_is_never_refused(verify):
    check, _ = verify
    check(config("NixlConnector", aux_output_config=SimpleNamespace(enabled=False)))


# -- vLLM 0.33's cache-hit calls ------------------------------------------------------


@pytest.fixture
def routing():
    return make_scheduler_read_workload(RoutingSpec(num_layers=2, top_k=2, num_experts=8), requests=4).routing


def test_a_local_prefix_cache_hit_is_never_bounded(routing):
    request = SimpleNamespace(request_id="r", num_tokens=100)
    assert routing.max_cache_hit(request) is None  # vLLM's "no bound": num_tokens - 1


@pytest.mark.parametrize("num_local, num_external", [(0, 64), (32, 16), (48, 0)])
def test_a_hit_of_a_connector_without_a_routing_tier_is_recomputed(routing, num_local, num_external):
    from slotroute.vllm.offload import ExternalHits

    request = SimpleNamespace(request_id="r", num_tokens=200)
    assert routing.cap_external_hit(request, num_local, num_external) == 0  # no KV connector
    routing.external_hits = ExternalHits(routing)  # one whose KV arrives without routing (LMCache, ...)
    assert routing.cap_external_hit(request, num_local, num_external) == 0


def test_a_kv_load_changes_nothing_in_the_store(routing):
    before = routing.store.stats()
    routing.request_loading(SimpleNamespace(request_id="r", num_tokens=64), 32)
    assert routing.store.stats() == before and "r" not in routing._cursors


# -- the offload tier's hooks (slotroute/vllm/offload.py) ------------------------------


def offload_routing(routing):
    """An ``OffloadRouting`` over stand-ins of the offloading connector's scheduler side:
    one KV cache group of chunks of 8 tokens, one hash each."""
    from slotroute.vllm.offload import OffloadRouting

    group = SimpleNamespace(group_idx=0, tokens_per_chunk=8, hashes_per_chunk=1, tokens_per_block=4)
    scheduler = SimpleNamespace(config=SimpleNamespace(kv_group_configs=[group]), _req_status={})
    return OffloadRouting(routing, scheduler, group, lambda block_hash, gid: block_hash + bytes(4), None)


def test_a_hit_is_capped_at_the_first_chunk_whose_rows_the_tier_cannot_return(routing):
    import numpy as np

    hits = offload_routing(routing)
    spec = routing.store.spec
    key = b"h0" + bytes(4)
    hits.tier.expect([key])
    hits.tier.put(key, 0, np.zeros((8, *spec.token_shape), spec.storage_dtype))
    hits.tier.complete([key])
    request = SimpleNamespace(request_id="r", block_hashes=[b"h0", b"h1", b"h2"])
    assert hits.cap(request, 0, 24) == 8  # chunk 1's rows are not held
    assert hits.cap(request, 8, 16) == 0
    assert hits.stats["tokens_capped"] == 16 + 16


def test_an_offload_tier_hook_that_fails_logs_and_recomputes_instead_of_stopping_the_engine(routing, caplog):
    hits = offload_routing(routing)
    broken = SimpleNamespace(request_id="r")  # no block hashes: each hook that reads them raises inside
    assert hits.cap(broken, 0, 16) == 0
    hits._hit_starts["r"] = 0
    hits.loading(broken, 16)
    assert "the offload tier's cap failed" in caplog.text and "the offload tier's loading failed" in caplog.text
    assert not routing.core._pending  # nothing queued for the load
