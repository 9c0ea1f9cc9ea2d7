"""The V2 model runner's adapter: ``vllm/v1/worker/gpu/model_runner.py``
``GPUModelRunner`` (vLLM 0.28-0.30; on CUDA the default of 0.29-0.30 whenever Triton is
present, of 0.28 for some architectures).

V2 keeps whatever ``init_routed_experts_capturer`` builds in
``self.routed_experts_capturer`` and uses it in two places only:
``execute_model`` calls ``capturer.get_routed_experts(slot_mappings, num_toks)``
after the forward of every real step and stores the result in
``ExecuteModelState.routed_experts``; ``AsyncOutput`` (``vllm/v1/worker/gpu/
async_utils.py``) calls ``to_cpu_nonblocking()`` on it on the output copy stream
and ``tolists()`` in ``get_output``, whose result becomes
``ModelRunnerOutput.routed_experts``. V2 has no synchronous output path: without
async scheduling the worker calls ``get_output`` at once.

slotroute puts :class:`StepCapture` in that place. ``get_routed_experts`` launches
slotroute's checked narrow snapshot kernel on the forward's stream,
``to_cpu_nonblocking`` enqueues its one copy on V2's output copy stream where the
kernel staged its bytes on the device (none where the kernel wrote the pinned host
memory itself, the default), and
``tolists``, called once V2 has waited for that stream's event, returns vLLM's
``RoutedExpertsLists`` in the storage dtype, or raises naming what the check found.
The snapshot kernel clears the capture buffer for the next step, so under CUDA graphs
(FULL or PIECEWISE) a MoE layer that wrote nothing fails the check instead of
shipping an older step's ids; ``execute_model`` clears it before a real step only
after a dummy run.
"""

from __future__ import annotations

from vllm.v1.outputs import RoutedExpertsLists as VllmRoutedExpertsLists

from slotroute.capture import PendingSnapshot
from slotroute.vllm.patches import Patch
from slotroute.vllm.worker import WorkerRouting, as_vllm_lists, v2_execute_model

__all__ = ["StepCapture", "StepRouting", "v2_runner_patches"]

RUNNER = "vllm.v1.worker.gpu.model_runner"
ASYNC_UTILS = "vllm.v1.worker.gpu.async_utils"


class StepRouting:
    """One step's routing on its way to the scheduler, in the place of vLLM's
    ``RoutedExpertsTensors``: the two methods V2 calls on it, over a
    :class:`~slotroute.capture.PendingSnapshot` that owns its pinned host memory."""

    __slots__ = ("pending",)

    def __init__(self, pending: PendingSnapshot) -> None:
        self.pending = pending

    def to_cpu_nonblocking(self) -> StepRouting:
        """Enqueue the snapshot's one copy, if it staged, on the current stream (V2's output copy
        stream, whose blocking event ``get_output`` waits on before ``tolists``): self."""
        self.pending.enqueue_copy()
        return self

    def tolists(self) -> VllmRoutedExpertsLists | None:
        """Wait for the copy; the step's narrow rows and slots, ``None`` on TP ranks
        other than 0.

        Raises
        ------
        ValueError
            An expert id outside ``[0, num_experts)``, or a MoE layer that wrote
            nothing for some token of the step.
        """
        try:  # the common case in place: one call fewer per step
            arrays = self.pending.arrays()
        except ValueError:
            return as_vllm_lists(self.pending)  # logs it and ships the failed step's slots
        return None if arrays is None else VllmRoutedExpertsLists(*arrays)


class StepCapture:
    """What the V2 runner holds as ``routed_experts_capturer``: a
    :class:`~slotroute.vllm.worker.WorkerRouting` bound to the model's routers.

    Invariant: ``get_routed_experts`` of a step sees rows that the step's forward
    wrote, or ``NOT_CAPTURED`` (the previous snapshot's kernel cleared them, or
    ``begin_step`` after a dummy run).
    """

    def __init__(self, runner) -> None:
        self.routing = WorkerRouting.of_runner(runner)
        self.routing.keep_results()  # V2's in-process engine keeps each step's rows until its requests finish

    def get_routed_experts(self, slot_mappings, num_tokens: int) -> StepRouting:
        """Start shipping the step's first ``num_tokens`` rows; ``slot_mappings`` is
        V2's ``(num_kv_cache_groups, max_num_tokens)`` device tensor, of which the
        full-attention group's row keys the store (read in place: no view per step).
        Bounded by one kernel launch: a staged copy goes on V2's output copy stream
        (``to_cpu_nonblocking``)."""
        return StepRouting(self.routing.snapshot_step(num_tokens, slot_mappings, True, self.routing.attn_gid))


# -- patches ------------------------------------------------------------------------


def _make_init_capturer(original):
    """Replaces ``vllm/v1/worker/gpu/model_runner.py``
    ``GPUModelRunner.init_routed_experts_capturer``: slotroute's capture in the place
    of vLLM's ``RoutedExpertsCapturer``."""

    def init_routed_experts_capturer(self) -> None:
        self.routed_experts_capturer = StepCapture(self)

    return init_routed_experts_capturer


def _routing_of(runner) -> WorkerRouting | None:
    capture = runner.routed_experts_capturer
    return capture.routing if isinstance(capture, StepCapture) else None


def v2_runner_patches() -> list[Patch]:
    """The V2 runner's patches and the V2 code they rely on, each verified against
    the installed vLLM."""
    return [
        Patch(RUNNER, "GPUModelRunner.init_routed_experts_capturer", ("self",),
              ("self.routed_experts_capturer = RoutedExpertsCapturer(",
               "bind_routed_experts_capturer(self.model"),
              _make_init_capturer),
        Patch(RUNNER, "GPUModelRunner.execute_model",
              ("self", "scheduler_output", "intermediate_tensors", "dummy_run", "..."),
              ("capturer.get_routed_experts(slot_mappings, num_toks)", "routed_experts=routed_experts"),
              v2_execute_model(_routing_of, begins_steps=True)),
        # Relied on, not replaced: where V2 hands the step's routing to its output.
        Patch(ASYNC_UTILS, "AsyncOutput.__init__", None,
              ("routed_experts.to_cpu_nonblocking()",), None),
        Patch(ASYNC_UTILS, "AsyncOutput.get_output", ("self",),
              ("self.model_runner_output.routed_experts = self.routed_experts_cpu.tolists()",), None),
    ]
