"""``docs/trainers.md``: every recipe in it runs, with the inputs it names.

The OpenAI-server recipe needs a live ``vllm serve``; it runs in
``test_replay_e2e.py``, against that file's server."""

from __future__ import annotations

import ast
import base64
import enum
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import MOE_LAYERS, TINY, prompt_tokens
from trainers_doc import DOC, RECIPES, python_blocks, run_recipe

from slotroute.spec import MissingRoutingError
from slotroute.tools.tiny_model import hf_config, tiny_moe_params

CONFIG = hf_config(tiny_moe_params(**TINY))  # 4 layers, layer 1 dense, top-4 of 16


def sglang_response(routed: np.ndarray, prompt_len: int, output_ids: list[int]) -> dict:
    """The JSON of SGLang's ``/generate`` with ``return_routed_experts``: the ids as
    base64 of raw int32 (``pybase64.b64encode(tensor.numpy().tobytes())``), no shape."""
    return {
        "output_ids": output_ids,
        "meta_info": {
            "prompt_tokens": prompt_len,
            "completion_tokens": len(output_ids),
            "routed_experts": base64.b64encode(routed.astype("<i4").tobytes()).decode("utf-8"),
        },
    }


def rollout_routing(prompt_len: int, num_output_tokens: int) -> np.ndarray:
    """Routing as servers return it for the tiny model: every decoder layer, the dense
    one all zeros."""
    rows = prompt_len + num_output_tokens - 1
    routed = np.zeros((rows, TINY["num_layers"], TINY["top_k"]), dtype=np.int32)
    rng = np.random.default_rng(7)
    for layer in MOE_LAYERS:
        routed[:, layer] = [rng.permutation(TINY["num_experts"])[: TINY["top_k"]] for _ in range(rows)]
    return routed


# Stand-ins for Megatron's ``megatron/core/transformer/moe/router_replay.py`` (not
# installed here): the names the recipe calls, and set_replay_data's check that there is
# one array per MoE router.
class RouterReplayAction(enum.Enum):
    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


def router_replay_class(num_moe_layers: int) -> type:
    class RouterReplay:
        global_router_replay_instances: list = []

        @staticmethod
        def set_replay_data(all_layers_topk_indices):
            if len(all_layers_topk_indices) != len(RouterReplay.global_router_replay_instances):
                raise ValueError(
                    f"The number of replay tensors ({len(all_layers_topk_indices)}) "
                    f"does not match instances ({len(RouterReplay.global_router_replay_instances)})."
                )
            for i, router in enumerate(RouterReplay.global_router_replay_instances):
                router.set_target_indices(all_layers_topk_indices[i])

        @staticmethod
        def set_global_router_replay_action(action):
            for router in RouterReplay.global_router_replay_instances:
                router.router_replay_action = action

        def __init__(self):
            self.target_topk_idx = None
            self.router_replay_action = None
            RouterReplay.global_router_replay_instances.append(self)

        def set_target_indices(self, topk_indices):
            self.target_topk_idx = topk_indices

    for _ in range(num_moe_layers):
        RouterReplay()
    return RouterReplay


def run_megatron_recipe(indices: list[np.ndarray], RouterReplay: type) -> None:
    stand_ins = {"RouterReplay": RouterReplay, "RouterReplayAction": RouterReplayAction}
    run_recipe("Megatron RouterReplay", indices=indices, **stand_ins)


def test_every_python_block_of_the_doc_is_a_recipe_a_test_runs():
    blocks = {title: codes for title, codes in python_blocks(DOC.read_text()).items() if codes}
    assert blocks.keys() == RECIPES.keys()
    assert all(len(codes) == 1 for codes in blocks.values()), "one snippet per recipe"
    for test in RECIPES.values():
        module, name = test.split("::")
        tree = ast.parse((Path(__file__).parent / module).read_text())
        assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, test


def test_sglang_recipe_decodes_raw_int32_meta_info():
    routed = rollout_routing(prompt_len=12, num_output_tokens=5)
    response = sglang_response(routed, prompt_len=12, output_ids=[5, 6, 7, 8, 9])
    indices = run_recipe("SGLang server", response=response, config=CONFIG)["indices"]
    assert len(indices) == len(MOE_LAYERS)
    for layer, replay in zip(MOE_LAYERS, indices):
        assert replay.dtype == np.int64 and replay.flags.c_contiguous
        np.testing.assert_array_equal(replay, routed[:, layer])


def test_sglang_recipe_raises_for_a_response_missing_a_row():
    routed = rollout_routing(prompt_len=12, num_output_tokens=5)[1:]
    response = sglang_response(routed, prompt_len=12, output_ids=[5, 6, 7, 8, 9])
    with pytest.raises(MissingRoutingError, match="has 15 rows, expected .* = 16 \\(1 missing\\)"):
        run_recipe("SGLang server", response=response, config=CONFIG)


def test_megatron_recipe_hands_each_moe_router_its_layer():
    torch = pytest.importorskip("torch")
    routed = rollout_routing(prompt_len=12, num_output_tokens=5)
    response = sglang_response(routed, prompt_len=12, output_ids=[5, 6, 7, 8, 9])
    indices = run_recipe("SGLang server", response=response, config=CONFIG)["indices"]
    RouterReplay = router_replay_class(len(MOE_LAYERS))
    run_megatron_recipe(indices, RouterReplay)
    routers = RouterReplay.global_router_replay_instances
    for layer, router in zip(MOE_LAYERS, routers):
        target = router.target_topk_idx
        assert target.dtype == torch.int64 and target.is_contiguous() and target.shape == (16, TINY["top_k"])
        np.testing.assert_array_equal(target.numpy(), routed[:, layer])
        assert router.router_replay_action is RouterReplayAction.REPLAY_FORWARD


def test_megatron_recipe_with_dense_layers_left_in_is_refused_by_router_replay():
    pytest.importorskip("torch")
    from slotroute.replay import router_replay_indices

    every_layer = router_replay_indices(rollout_routing(prompt_len=12, num_output_tokens=5))
    RouterReplay = router_replay_class(len(MOE_LAYERS))
    with pytest.raises(ValueError, match=r"replay tensors \(4\) does not match instances \(3\)"):
        run_megatron_recipe(every_layer, RouterReplay)


@pytest.mark.vllm
def test_vllm_offline_recipe_turns_a_request_output_into_replay_indices(reference, tiny_model):
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    prompt = prompt_tokens(400, 60)
    namespace = run_recipe("vLLM offline", llm=reference.llm, prompt=prompt, config=config)
    routed, indices = namespace["routed"], namespace["indices"]
    rows = len(prompt) + len(namespace["completion"].token_ids) - 1
    assert routed.shape == (rows, TINY["num_layers"], TINY["top_k"])
    assert len(indices) == len(MOE_LAYERS)
    for layer, replay in zip(MOE_LAYERS, indices):
        assert replay.shape == (rows, TINY["top_k"])
        np.testing.assert_array_equal(replay, routed[:, layer])
