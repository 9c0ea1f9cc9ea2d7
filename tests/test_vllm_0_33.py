"""vLLM 0.33's hook points, verified against its real modules.

No CPU build of vLLM 0.33 exists (it pins torch 2.14), so its engine runs only on a GPU
(docs/vllm.md). Here its modules are imported as installed by the ``vllm033`` tox
environment (vLLM 0.33.0 and its CPU-importable dependencies), and every patch of the
``(0, 33)`` adapters is verified and installed as ``register()`` does at engine start.
These tests run only where vLLM 0.33 is installed; ``SLOTROUTE_EXPECT_VLLM=0.33`` (set by
that environment) makes their absence a failure instead of a skip.
"""

from __future__ import annotations

import os

import pytest
from conftest import probe

vllm = pytest.importorskip("vllm")

IS_0_33 = vllm.__version__.startswith("0.33.")
if os.environ.get("SLOTROUTE_EXPECT_VLLM") == "0.33":
    assert IS_0_33, f"SLOTROUTE_EXPECT_VLLM=0.33, but vLLM {vllm.__version__} is installed"

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not IS_0_33, reason="vLLM 0.33's hook points; installed: " + vllm.__version__)]


def test_every_patch_of_the_0_33_adapters_verifies_against_vllm_0_33():
    from slotroute.vllm import ADAPTERS, _patch_set

    names = ADAPTERS[(0, 33)]
    patches = [patch for name in names for patch in _patch_set(name)]
    assert len(patches) >= 15
    for patch in patches:
        patch.verify()  # raises PatchError naming what differs


def test_the_0_32_scheduler_patches_do_not_verify_on_0_33():
    """The reason 0.33 has an adapter of its own: vLLM now builds its connector over the
    KV cache manager, and its scheduler makes calls 0.32's did not."""
    from slotroute.vllm.connector import connector_patches
    from slotroute.vllm.patches import PatchError

    init = next(patch for patch in connector_patches() if patch.qualname == "Scheduler.__init__")
    with pytest.raises(PatchError, match="AuxOutputSchedulerConnector"):
        init.verify()


def test_slotroutes_connector_answers_every_call_of_vllms():
    """``ConnectorRouting`` stands where the scheduler built vLLM's
    ``AuxOutputSchedulerConnector``: it has every public method vLLM's has, with the
    same parameters."""
    import inspect

    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from slotroute.vllm.connector import ConnectorRouting

    public = [name for name, _ in inspect.getmembers(AuxOutputSchedulerConnector, inspect.isfunction)
              if not name.startswith("_")]
    assert {"max_cache_hit", "cap_external_hit", "request_loading", "take_output"} <= set(public)
    for name in public:
        ours = getattr(ConnectorRouting, name, None)
        assert ours is not None, f"ConnectorRouting lacks vLLM 0.33's {name}"
        theirs = list(inspect.signature(getattr(AuxOutputSchedulerConnector, name)).parameters)
        assert list(inspect.signature(ours).parameters)[: len(theirs)] == theirs, name


def test_the_v1_async_output_wrapper_can_be_built_and_passes_the_kv_connector_output_through():
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from slotroute.vllm.runner_v1 import AsyncOutputWithRouting

    class Inner(AsyncModelRunnerOutput):
        def get_output(self):
            raise RuntimeError("the step failed")

        def get_kv_connector_output(self):
            return "kv output"

    assert not AsyncOutputWithRouting.__abstractmethods__
    wrapped = AsyncOutputWithRouting(Inner(), pending=None)
    assert wrapped.get_kv_connector_output() == "kv output"


def test_register_installs_the_0_33_adapters():
    found = probe()
    assert found["outcomes"] == ["slotroute", "slotroute"]
    assert found["patched"] and found["scheduler_patched"] == [True, True]
