"""The OpenAI-compatible server: ``vllm serve`` in a subprocess on 127.0.0.1 (API
server and engine core in separate processes, each loading slotroute), queried with
the ``openai`` client. ``routed_experts`` comes back base64-encoded ``.npy``.

Every test runs against a server with scheduling sync and one with it async (the
production default on CUDA): the async server is started through a launcher script
that installs ``cpu_async``'s stand-ins at import, so that the engine-core process,
which vLLM spawns and which imports the launcher again as its main module, runs
``AsyncScheduler`` with its batch queue."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, connector_generation, prompt_tokens, wait_until_serving

from slotroute.tools.demo import decode_routed_experts, free_port, serve_command

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 300
# vLLM 0.31+ return routing through the aux-output connector slotroute replaces.
CONNECTOR_GENERATION = connector_generation()

# A request of this many prompt tokens loses its routing in the server: a fault the
# test injects, at startup of every server process (``sitecustomize``), by invalidating
# the request's blocks just before slotroute reads its rows (vLLM 0.31+).
LOSE_ROUTING_PROMPT_LEN = 137
LOSE_ROUTING = f"""
def _lose_routing_of_one_prompt_length():
    from slotroute.vllm.connector import ConnectorRouting

    take_output = ConnectorRouting.take_output

    def losing_take_output(self, request, output):
        if request.num_prompt_tokens == {LOSE_ROUTING_PROMPT_LEN}:
            blocks = self._coordinator.get_blocks(request.request_id)[self.attn_gid]
            self.store.invalidate_blocks([block.block_id for block in blocks])
        return take_output(self, request, output)

    ConnectorRouting.take_output = losing_take_output


_lose_routing_of_one_prompt_length()
"""

# A step of this many tokens fails the worker's check: the capture of every MoE layer
# gets an expert id of -1 (the same injection, worker side). A request of this many
# prompt tokens, alone in the server, is such a step (below the 128-token chunk).
FAIL_STEP_PROMPT_LEN = 113
FAIL_STEP = f"""
def _fail_the_steps_of_one_size():
    from slotroute.capture import RoutedExpertsCapturer

    capture = RoutedExpertsCapturer.capture

    def failing_capture(self, layer_id, topk_ids, layout=None):
        if topk_ids.shape[0] == {FAIL_STEP_PROMPT_LEN}:
            topk_ids = topk_ids.clone()
            topk_ids[0, 0] = -1
        return capture(self, layer_id, topk_ids, layout=layout)

    RoutedExpertsCapturer.capture = failing_capture


_fail_the_steps_of_one_size()
"""

# Runs the server's entry module; at import, in the API server and in the spawned
# engine core alike, installs the async stand-ins and logs which scheduler each
# engine core built.
ASYNC_LAUNCHER = """
import runpy, sys
sys.path.insert(0, %r)
from cpu_async import install_in_this_process
from vllm.v1.engine.core import EngineCore

install_in_this_process()
engine_core_init = EngineCore.__init__


def logged_init(self, *args, **kwargs):
    engine_core_init(self, *args, **kwargs)
    print(f"ENGINE CORE {type(self.scheduler).__name__} batch_queue={self.batch_queue is not None}", flush=True)


EngineCore.__init__ = logged_init
if __name__ == "__main__":
    # __main__ stays this script: the spawned engine core imports it, not the server.
    runpy.run_module(%r, run_name="__main__")
"""


@pytest.fixture(scope="module", params=["sync", "async"])
def server(request, tiny_model, tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("serve")
    log_path = work / "vllm-serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # slotroute's "patched vLLM" line, per process
    inject = work / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(LOSE_ROUTING + FAIL_STEP)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(inject), env.get("PYTHONPATH")]))
    command = serve_command(tiny_model)
    if request.param == "async":
        assert command[1] == "-m", command
        launcher = work / "serve_async.py"
        launcher.write_text(ASYNC_LAUNCHER % (str(Path(__file__).parent), command[2]))
        command = [sys.executable, str(launcher), *command[3:], "--async-scheduling"]
    command += [
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
        "--block-size", "32", "--max-model-len", "1024", "--max-num-batched-tokens", "128",
        "--enable-prefix-caching", "--enable-return-routed-experts", "--seed", "0",
        "--kv-cache-memory-bytes", str(64 << 20),
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        wait_until_serving(process, client, lambda: log_path.read_text()[-4000:], STARTUP_TIMEOUT_S)
        if request.param == "async":
            assert "ENGINE CORE AsyncScheduler batch_queue=True" in log_path.read_text()
        yield client, log_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def complete(client, prompt, max_tokens: int, **extra):
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )
    (choice,) = response.choices
    return choice, decode_routed_experts(choice.routed_experts)


def test_server_completion_returns_the_routing_of_the_in_process_reference(server, reference):
    client, _ = server
    prompt = prompt_tokens(100, 150)
    choice, routed = complete(client, prompt, 6)
    want = reference(prompt, 6)
    assert tuple(choice.token_ids) == want.tokens
    assert routed.shape == (150 + 6 - 1, TINY["num_layers"], TINY["top_k"])
    assert routed.dtype == np.uint8
    np.testing.assert_array_equal(routed, want.routed)


def test_server_prefix_hit_and_prompt_start_decode_to_the_reference_rows(server, reference):
    client, _ = server
    prompt = prompt_tokens(101, 200)
    complete(client, prompt, 4)  # warm the prefix cache
    _, routed = complete(client, prompt, 4, routed_experts_prompt_start=64)
    np.testing.assert_array_equal(routed, reference(prompt, 4).routed[64:])


def test_server_api_and_engine_core_processes_both_load_the_plugin(server):
    _, log_path = server
    text = log_path.read_text()
    assert text.count("slotroute: patched vLLM") >= 2, "expected one line per process"
    assert "slotroute: scheduler keeps routing in RoutedExpertsManager" in text


def test_server_answers_400_to_a_prompt_start_beyond_the_prompt_and_serves_on(server, reference):
    """0.29's scheduler would assert on it and stop the engine core; every version
    slotroute serves rejects it at input."""
    import openai

    client, _ = server
    prompt = prompt_tokens(102, 40)
    with pytest.raises(openai.BadRequestError, match="routed_experts_prompt_start"):
        complete(client, prompt, 3, routed_experts_prompt_start=41)
    choice, routed = complete(client, prompt, 3)
    np.testing.assert_array_equal(routed, reference(prompt, 3).routed)


@pytest.mark.skipif(not CONNECTOR_GENERATION, reason="vLLM 0.28-0.30 read routing once, at prefill end")
def test_server_answers_500_to_a_request_whose_routing_is_missing_and_serves_on(server, reference):
    import openai

    client, _ = server
    with pytest.raises(openai.InternalServerError):
        complete(client, prompt_tokens(103, LOSE_ROUTING_PROMPT_LEN), 3)
    prompt = prompt_tokens(104, 60)
    choice, routed = complete(client, prompt, 3)
    np.testing.assert_array_equal(routed, reference(prompt, 3).routed)


def test_server_answers_500_to_a_request_whose_step_fails_its_check_and_serves_on(server, reference):
    """On every generation: the step fails the worker's check, its request alone
    finishes with an error (HTTP 500), and the server serves the next one exactly."""
    import openai

    client, log_path = server
    with pytest.raises(openai.InternalServerError):
        complete(client, prompt_tokens(105, FAIL_STEP_PROMPT_LEN), 3)
    assert "expert id(s) outside" in log_path.read_text()
    prompt = prompt_tokens(106, 60)
    choice, routed = complete(client, prompt, 3)
    np.testing.assert_array_equal(routed, reference(prompt, 3).routed)
