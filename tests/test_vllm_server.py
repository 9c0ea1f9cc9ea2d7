"""The OpenAI-compatible server: ``vllm serve`` in a subprocess on 127.0.0.1 (API
server and engine core in separate processes, each loading slotroute), queried with
the ``openai`` client. ``routed_experts`` comes back base64-encoded ``.npy``."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest
from conftest import TINY, prompt_tokens

from slotroute.demo import decode_routed_experts, free_port, serve_command

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # slotroute's "patched vLLM" line, per process
    command = serve_command(tiny_model) + [
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
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve not up after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(1)
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
