"""End to end: the OpenAI server's ``routed_experts`` for a tiny Qwen3-MoE with a dense
layer, taken through ``slotroute.replay`` to per-MoE-layer replay indices, and replayed
in Hugging Face transformers' own implementation of the model.

The replay forces each MoE router of transformers' Qwen3-MoE (float32, eager attention)
to the returned experts, with the weights its own logits give those experts. If the
routing is the rollout's, the forced forward reproduces the unforced one: same logits,
and the greedy tokens the server generated. Forcing any other experts changes them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import DENSE_LAYERS, MOE_LAYERS, TINY, prompt_tokens, wait_until_serving
from trainers_doc import run_recipe

from slotroute.replay import (
    check_routed_experts,
    decode_routed_experts,
    moe_layer_indices,
    router_replay_indices,
    select_layers,
)
from slotroute.tools.demo import free_port, serve_command, stop_process_group

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 300
SERVED_NAME = "tiny"
PROMPT_LEN, MAX_TOKENS = 150, 8


# The log of the module's server, for the messages of requests that fail.
SERVER_LOGS: list[Path] = []


def server_log() -> str:
    """The last lines the server logged."""
    return SERVER_LOGS[-1].read_text()[-4000:] if SERVER_LOGS else "(no server log)"


@pytest.fixture(scope="module")
def base_url(tiny_model, tmp_path_factory):
    """``vllm serve`` on the tiny model (prefix caching, chunked prefill at 128 tokens,
    float32, eager), in a session of its own; its ``/v1`` address. A request that
    fails shows the end of the server's log (:func:`server_log`)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    command = [
        *serve_command(tiny_model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
        "--block-size", "32", "--max-model-len", "1024", "--max-num-batched-tokens", "128",
        "--enable-prefix-caching", "--enable-return-routed-experts", "--seed", "0",
        "--kv-cache-memory-bytes", str(64 << 20),
    ]  # fmt: skip
    SERVER_LOGS.append(log_path)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    try:
        import openai

        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        wait_until_serving(process, client, server_log, STARTUP_TIMEOUT_S)
        yield url
    finally:
        stop_process_group(process)


@pytest.fixture(scope="module")
def config(tiny_model) -> dict:
    return json.loads((Path(tiny_model) / "config.json").read_text())


@pytest.fixture(scope="module")
def rollout(base_url, config):
    """One greedy completion: its prompt, generated tokens, and the replay indices
    ``slotroute.replay`` made of its ``routed_experts`` (one ``[T, K]`` per MoE layer)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    prompt = prompt_tokens(300, PROMPT_LEN)
    try:
        response = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
    except openai.APIError as exc:
        pytest.fail(f"the completion failed: {exc}\n{server_log()}")
    (choice,) = response.choices
    tokens = list(choice.token_ids)
    routed = decode_routed_experts(choice.routed_experts)
    check_routed_experts(
        routed, prompt_len=len(prompt), num_output_tokens=len(tokens), num_experts=config["num_experts"]
    )
    layers = moe_layer_indices(config)
    indices = router_replay_indices(select_layers(routed, layers))
    return prompt, tokens, routed, layers, indices


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    """transformers' Qwen3-MoE on the tiny checkpoint, float32, eager attention."""
    import torch
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        version = transformers.__version__
        pytest.skip(f"the replay forces transformers 5's Qwen3MoeTopKRouter; transformers {version} has a linear gate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def forward_logits(model, token_ids: list[int], forced: dict[int, np.ndarray] | None = None) -> np.ndarray:
    """transformers' logits ``(len(token_ids), vocab)`` for one sequence; with
    ``forced``, the router of each MoE layer ``l`` in it picks ``forced[l]`` (``[T, K]``)
    instead of its own top-k, weighted as the router weights its own choice: softmax of
    its logits at those experts, renormalised when ``norm_topk_prob``."""
    import torch

    def force(indices: np.ndarray):
        def hook(router, args, output):
            router_logits, _, own_indices = output
            chosen = torch.from_numpy(indices).to(own_indices.device)
            assert chosen.shape == own_indices.shape, f"replay {tuple(chosen.shape)}, router {tuple(own_indices.shape)}"
            probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
            scores = probs.gather(1, chosen)
            if router.norm_topk_prob:
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return router_logits, scores.to(router_logits.dtype), chosen

        return hook

    handles = [
        model.model.layers[layer].mlp.gate.register_forward_hook(force(indices))
        for layer, indices in (forced or {}).items()
    ]
    try:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].numpy()
    finally:
        for handle in handles:
            handle.remove()


def unchosen_experts(chosen: np.ndarray, num_experts: int) -> np.ndarray:
    """For each row of ``chosen`` (``[T, K]``), the ``K`` lowest expert ids not in it."""
    rows = np.arange(len(chosen))[:, None]
    taken = np.zeros((len(chosen), num_experts), dtype=bool)
    taken[rows, chosen] = True
    return np.ascontiguousarray(np.argsort(taken, axis=1, kind="stable")[:, : chosen.shape[1]])


def test_openai_routing_decodes_to_one_checked_row_per_forwarded_token(rollout):
    prompt, tokens, routed, _, _ = rollout
    assert len(tokens) == MAX_TOKENS
    assert routed.shape == (PROMPT_LEN + MAX_TOKENS - 1, TINY["num_layers"], TINY["top_k"])
    assert routed.dtype == np.uint8


def test_replay_indices_cover_the_moe_layers_only(rollout):
    _, _, routed, layers, indices = rollout
    assert layers == list(MOE_LAYERS)
    assert len(indices) == len(MOE_LAYERS)
    for layer, replay in zip(MOE_LAYERS, indices):
        assert replay.dtype == np.int64 and replay.flags.c_contiguous
        np.testing.assert_array_equal(replay, routed[:, layer, :])
    # The dense layer's rows carry no routing (vLLM fills them with 0).
    assert not routed[:, list(DENSE_LAYERS), :].any()


def test_transformers_replay_of_the_routing_reproduces_the_rollout_logits(rollout, hf_model):
    prompt, tokens, _, layers, indices = rollout
    sequence = prompt + tokens[:-1]  # every token the server forwarded
    own = forward_logits(hf_model, sequence)
    replayed = forward_logits(hf_model, sequence, dict(zip(layers, indices)))
    # Same experts with the same weights. Not bit-equal: vLLM lists a row's experts in
    # another order than torch.topk, so the renormalising sum adds the same float32
    # weights in another order (the forced forward with topk's own order is bit-equal).
    np.testing.assert_allclose(replayed, own, rtol=0, atol=1e-5)
    # And the replayed model generates what the server generated, greedily.
    assert replayed[PROMPT_LEN - 1 :].argmax(axis=-1).tolist() == tokens


def test_transformers_replay_of_other_experts_changes_the_logits(rollout, hf_model):
    prompt, tokens, _, layers, indices = rollout
    sequence = prompt + tokens[:-1]
    own = forward_logits(hf_model, sequence)
    other = {layer: unchosen_experts(replay, TINY["num_experts"]) for layer, replay in zip(layers, indices)}
    moved = forward_logits(hf_model, sequence, other)
    assert np.abs(moved - own).max() > 0.1


def test_openai_server_recipe_turns_a_live_completion_into_replay_indices(base_url, config):
    import openai

    prompt = prompt_tokens(301, 40)
    try:
        namespace = run_recipe("vLLM OpenAI server", base_url=base_url, model=SERVED_NAME, prompt=prompt, config=config)
    except openai.APIError as exc:
        pytest.fail(f"the recipe's completion failed: {exc}\n{server_log()}")
    choice, indices = namespace["choice"], namespace["indices"]
    rows = len(prompt) + len(choice.token_ids) - 1
    assert len(indices) == len(MOE_LAYERS)
    assert all(replay.shape == (rows, TINY["top_k"]) for replay in indices)
