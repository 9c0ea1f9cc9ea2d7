"""The V2 model runner's adapter on vLLM 0.31-0.32: ``vllm/v1/worker/gpu/
model_runner.py`` ``GPUModelRunner`` (the default on CUDA) with slotroute in the place
of vLLM's ``AuxOutputWorkerConnector``.

V2 builds its worker connector with ``get_aux_output_connector(model, vllm_config,
kv_cache_config)`` once the KV cache exists and calls it in three places:
``begin_step(metadata)`` before a real step's forward, ``prepare_output(input_batch)``
after sampling, and, on the object that returns, ``enqueue_cpu_copy`` on the output
copy stream and ``process_output()`` in ``AsyncOutput.get_output``, whose result
becomes ``ModelRunnerOutput.aux_output_connector_output``. V2 has no synchronous
output path: without async scheduling the worker calls ``get_output`` at once.

slotroute puts :class:`StepConnector` there. ``prepare_output`` launches slotroute's
checked narrow snapshot kernel with the step's slots of the full-attention group,
which also clears the capture buffer for the next step (so under CUDA graphs a MoE
layer that wrote nothing fails the check instead of shipping an older step's ids;
``begin_step`` clears it only after a dummy run), ``enqueue_cpu_copy`` enqueues its
one copy on V2's output copy stream where the kernel staged its bytes (none where it
wrote the pinned host memory itself, the default), and ``process_output``, called once V2 has
waited for that stream's event, returns :func:`~slotroute.vllm.worker.step_output`
with the slots of the draft tokens the sampler rejected dropped
(:func:`drop_rejected`).
"""

from __future__ import annotations

import numpy as np
import torch

from slotroute.capture import PendingSnapshot
from slotroute.vllm.patches import Patch
from slotroute.vllm.worker import WorkerRouting, step_output, v2_execute_model
from slotroute.wire import RoutedExpertsLists, StepMeta

__all__ = ["PendingStep", "StepConnector", "drop_rejected", "v2_runner_connector_patches"]

RUNNER = "vllm.v1.worker.gpu.model_runner"
ASYNC_UTILS = "vllm.v1.worker.gpu.async_utils"


def drop_rejected(shipped: RoutedExpertsLists, run_ends: np.ndarray, num_rejected: np.ndarray) -> RoutedExpertsLists:
    """The step's rows with the slots of rejected draft tokens set to -1 (padding: the
    scheduler stores nothing for them). Request ``i``'s tokens are rows
    ``run_ends[i - 1] .. run_ends[i] - 1`` (V2's ``query_start_loc``), its drafts last,
    and the sampler rejected its last ``num_rejected[i]``. A new slot array where some
    are dropped, ``shipped`` itself where none is; unchanged too where the counts do
    not fit the rows (a rejected draft's row is then stored, and rewritten when the
    token that replaces it is forwarded, as before the sampler's counts were read)."""
    n = len(run_ends)
    rejected = np.asarray(num_rejected)[:n].astype(np.int64, copy=False)
    if n == 0 or len(rejected) != n or not rejected.any():
        return shipped
    slots = shipped.slot_mapping
    starts = np.empty(n, np.int64)
    starts[0], starts[1:] = 0, run_ends[:-1]
    if run_ends[-1] != len(slots) or (rejected < 0).any() or (rejected > run_ends - starts).any():
        return shipped
    total = int(rejected.sum())
    first = np.repeat(run_ends - rejected, rejected)
    offset = np.arange(total) - np.repeat(np.cumsum(rejected) - rejected, rejected)
    slots = slots.copy()
    slots[first + offset] = -1
    return RoutedExpertsLists(routing_data=shipped.routing_data, slot_mapping=slots)


class PendingStep:
    """One step's routing on its way to the scheduler, in the place of vLLM's
    ``PendingAuxOutput``: the snapshot, where each request's tokens end in it
    (``run_ends``, ``None`` if unknown) and, once the sampler ran, how many of each
    request's draft tokens it rejected."""

    __slots__ = ("pending", "run_ends", "num_rejected", "connector")

    def __init__(self, pending: PendingSnapshot, run_ends: np.ndarray | None = None, connector=None) -> None:
        self.pending = pending
        self.run_ends = run_ends
        self.num_rejected = None
        self.connector = connector

    def enqueue_cpu_copy(self, num_sampled, num_rejected) -> None:
        """Enqueue the snapshot's one copy, if it staged, on the current stream: V2's output copy
        stream, whose blocking event ``get_output`` waits on before
        :meth:`process_output`; keep ``num_rejected`` (a host array V2 fills on the same
        stream) for it."""
        self.num_rejected = num_rejected
        self.pending.enqueue_copy()

    def process_output(self):
        """Wait for the copy; what :func:`~slotroute.vllm.worker.step_output` ships, the
        rejected drafts' slots dropped (:func:`drop_rejected`)."""
        shipped = step_output(self.pending)
        if type(shipped) is RoutedExpertsLists and self.run_ends is not None and self.num_rejected is not None:
            trimmed = drop_rejected(shipped, self.run_ends, self.num_rejected)
            if trimmed is not shipped and self.connector is not None:
                self.connector.rows_rejected += int((trimmed.slot_mapping < 0).sum() - (shipped.slot_mapping < 0).sum())
            shipped = trimmed
        return shipped


def runner_device(vllm_config) -> torch.device:
    """The device V2's runner computes on: ``vllm_config.device_config.device``, with the
    current CUDA device's index where it names none (vLLM sets it per worker)."""
    device = torch.device(vllm_config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class StepConnector:
    """What the V2 runner holds as ``aux_output_connector``: a
    :class:`~slotroute.vllm.worker.WorkerRouting` bound to the model's routers.

    Invariant: ``prepare_output`` of a step ships rows that the step's forward wrote,
    or fails the check (the previous snapshot's kernel cleared the buffer, or
    ``begin_step`` after a dummy run).
    """

    def __init__(self, model: torch.nn.Module, vllm_config, kv_cache_config) -> None:
        # The device the runner runs on, not a parameter's: --cpu-offload-gb may leave
        # the first parameters on the host.
        self.routing = WorkerRouting(vllm_config, kv_cache_config, model, runner_device(vllm_config))
        self._slots: torch.Tensor | None = None
        # Rows of rejected draft tokens dropped so far (drop_rejected).
        self.rows_rejected = 0

    def begin_step(self, metadata) -> None:
        if isinstance(metadata, StepMeta) and metadata.num_tokens:
            self.routing.begin_step(metadata.num_tokens)

    def stage_slots(self, slot_mappings_by_layer) -> None:
        """Keep the slot mapping of the step about to be sampled (V2's
        ``ExecuteModelState.slot_mappings_by_layer``) for :meth:`prepare_output`."""
        self._slots = None if slot_mappings_by_layer is None else slot_mappings_by_layer[self.routing.attn_layer]

    def prepare_output(self, input_batch) -> PendingStep | None:
        """Start shipping the step's rows (``input_batch.num_tokens``, padding excluded)
        with their slots, and where each request's tokens end among them (for the
        rejected drafts' slots, :class:`PendingStep`); ``None`` if no slot mapping was
        staged. Bounded by one kernel launch: a staged copy goes on V2's output copy stream
        (``enqueue_cpu_copy``)."""
        slots, self._slots = self._slots, None
        if slots is None:
            self.routing.forward_without_snapshot()
            return None
        starts = getattr(input_batch, "query_start_loc_np", None)
        run_ends = None if starts is None else np.array(starts[1 : input_batch.num_reqs + 1], np.int64)
        return PendingStep(self.routing.snapshot_step(input_batch.num_tokens, slots, defer_copy=True), run_ends, self)

    def close(self) -> None:
        """Nothing held beyond the capturer's buffers, which go with this object."""


# -- patches ------------------------------------------------------------------------


def _make_get_connector(original):
    """Replaces ``get_aux_output_connector`` as named in
    ``vllm/v1/worker/gpu/model_runner.py``."""

    def get_aux_output_connector(model, vllm_config, kv_cache_config) -> StepConnector:
        return StepConnector(model, vllm_config, kv_cache_config)

    return get_aux_output_connector


def _make_sample_tokens(original):
    """Wraps ``vllm/v1/worker/gpu/model_runner.py`` ``GPUModelRunner.sample_tokens``:
    stages the step's slot mapping before vLLM calls ``prepare_output``."""

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        connector = self.aux_output_connector
        if state is not None and isinstance(connector, StepConnector):
            connector.stage_slots(state.slot_mappings_by_layer)
        return original(self, grammar_output)

    return sample_tokens


def _routing_of(runner) -> WorkerRouting | None:
    connector = runner.aux_output_connector
    return connector.routing if isinstance(connector, StepConnector) else None


def v2_runner_connector_patches() -> list[Patch]:
    """The V2 runner's patches for vLLM 0.31-0.32 and the V2 code they rely on, each
    verified against the installed vLLM."""
    return [
        Patch(RUNNER, "get_aux_output_connector", ("model", "vllm_config", "kv_cache_config"),
              ("AuxOutputWorkerConnector(",), _make_get_connector),
        Patch(RUNNER, "GPUModelRunner.sample_tokens", ("self", "grammar_output"),
              ("slot_mappings_by_layer = self.execute_model_state.slot_mappings_by_layer",
               "self.aux_output_connector.prepare_output(input_batch)"),
              _make_sample_tokens),
        Patch(RUNNER, "GPUModelRunner.execute_model",
              ("self", "scheduler_output", "intermediate_tensors", "dummy_run", "..."),
              ("self.aux_output_connector.begin_step(", "scheduler_output.aux_output_connector_metadata"),
              v2_execute_model(_routing_of, begins_steps=False)),
        # Relied on, not replaced: where V2 hands a step's routing over.
        Patch(ASYNC_UTILS, "AsyncOutput.__init__", None, ("self.pending_aux_output.enqueue_cpu_copy(",), None),
        Patch(ASYNC_UTILS, "AsyncOutput.get_output", ("self",),
              ("self.model_runner_output.aux_output_connector_output = (",
               "self.pending_aux_output.process_output()"), None),
    ]
