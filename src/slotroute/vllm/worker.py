"""Worker side, shared by every model runner: slotroute's capturer bound to vLLM's
MoE routers.

vLLM 0.28-0.30 capture ``topk_ids`` into an int32 buffer and ship it as int32.
:class:`WorkerRouting` binds slotroute's own
:class:`~slotroute.capture.RoutedExpertsCapturer` to the same router hooks
(``bind_routed_experts_capturer``) and ships each step as a range-checked snapshot in
the storage dtype. Where a step starts and where its output is handed over differ per
model runner: ``runner_v1.py`` (``vllm/v1/worker/gpu_model_runner.py``, which the CPU
model runner inherits) and ``runner_v2.py`` (``vllm/v1/worker/gpu/model_runner.py``)
are the two adapters.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch
from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCaptureSource,
    bind_routed_experts_capturer,
)

from slotroute.capture import BatchLayout, PendingSnapshot, RoutedExpertsCapturer
from slotroute.vllm import COPY_ONCE_ENV, LOGGER_NAME, capture_copy_once
from slotroute.vllm.routing import attention_gid, routing_spec
from slotroute.wire import RoutedExpertsLists, StepFailure

__all__ = ["WorkerRouting", "as_vllm_lists", "incomplete_capture", "step_output", "v2_execute_model"]

logger = logging.getLogger(LOGGER_NAME)

# The most pinned host memory WorkerRouting.keep_results reserves for kept rows, and
# how many times the KV cache's rows it reserves below that (NOTE in keep_results).
KEPT_ROWS_MAX_BYTES = 256 << 20
KEPT_ROWS_PER_SLOT = 3


def moe_layer_ids(model: torch.nn.Module) -> set[int]:
    """Layer ids of the modules ``bind_routed_experts_capturer`` binds to."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return {
        module.layer_id
        for module in model.modules()
        if isinstance(module, (MoERunner, RoutedExpertsCaptureSource))
    }


class WorkerRouting:
    """One worker's capture: a slotroute capturer bound to every MoE router of the
    model, whose rows ``[0, n)`` hold exactly the current step's routing.

    Invariant: a snapshot of a step in which some MoE layer did not write every row of
    the step raises instead of shipping an older step's ids; the rows of dense layers
    hold 0.

    NOTE 1: on a CUDA device, where a graph replays ``capture`` without running
    Python, every step starts from a cleared buffer (MoE layers ``NOT_CAPTURED``,
    dense layers 0) and the snapshot's range check finds any row left unwritten. The
    snapshot's own kernel clears the buffer once it has read the step's rows, so a
    step launches nothing of slotroute's before its forward; a forward that no
    snapshot follows (a dummy run: profiling, CUDA-graph capture, a DP rank's idle
    batch, reported by :meth:`forward_without_snapshot`) makes the next
    :meth:`begin_step` clear it first. On CPU (eager only, NOTE 2) every ``capture``
    runs in Python, so a ledger of the rows each layer wrote in this step stands in
    for the clearing: no torch op per step.

    Parameters
    ----------
    config, kv_cache_config
        The engine's ``VllmConfig`` and its resolved ``KVCacheConfig``.
    model
        The model whose MoE routers are bound.
    device
        The device the model runs on.

    Raises
    ------
    ValueError
        From vLLM's binder if the model has no MoE router it can hook, or if a CPU
        model is compiled (NOTE 2).
    """

    def __init__(self, config, kv_cache_config, model: torch.nn.Module, device: torch.device) -> None:
        spec = routing_spec(config)
        eager = config.model_config.enforce_eager or int(config.compilation_config.mode) == 0
        if device.type == "cpu" and not eager:
            # NOTE 2: vLLM's compiled CPU model never calls the routers' capture hooks
            # (vLLM's own path then returns zeros); only an eager one does.
            raise ValueError(
                "slotroute captures routed experts on vLLM's CPU backend only with enforce_eager=True "
                "(--enforce-eager): the compiled CPU model does not call the routers' capture hooks"
            )
        self.tp_size = config.parallel_config.tensor_parallel_size
        self.dp_rank = config.parallel_config.data_parallel_rank
        group = get_tp_group().device_group if self.tp_size > 1 else None
        moe = moe_layer_ids(model)
        dense = [layer for layer in range(spec.num_layers) if layer not in moe]
        copy_once = capture_copy_once(device.type, os.environ.get(COPY_ONCE_ENV))
        # A ring slot per step the runner keeps in flight, and one more: vLLM resolves a
        # step's output before it starts the step max_concurrent_batches later, so each
        # snapshot finds its slot free (NOTE 1 of RoutedExpertsCapturer has the rest).
        self.capturer = RoutedExpertsCapturer(
            spec, config.scheduler_config.max_num_batched_tokens, device, tp_group=group, dense_layers=dense,
            ring_depth=getattr(config, "max_concurrent_batches", 2) + 1, copy_once=copy_once,
        )
        # The full-attention KV cache group: its slots key the scheduler's store.
        self.attn_gid = attention_gid(kv_cache_config)
        attn_group = kv_cache_config.kv_cache_groups[self.attn_gid]
        self._kv_slots = kv_cache_config.num_blocks * attn_group.kv_cache_spec.block_size
        # Whether the engine core runs in this process (an in-process executor): it then holds this worker's results.
        self._engine_process = getattr(config.parallel_config, "distributed_executor_backend", None) == "uni"
        # Every layer of the group shares the group's slot mapping; any one names it.
        self.attn_layer = kv_cache_config.kv_cache_groups[self.attn_gid].layer_names[0]
        self._single_rank = BatchLayout(tp_size=self.tp_size)
        self._dp_key: object = None
        self._dp_layout = self._single_rank
        bind_routed_experts_capturer(model, self)
        self._moe_layers = frozenset(moe)
        # Layer id -> rows its capture wrote in this step, or None where rows are cleared (NOTE 1).
        self._rows_captured: dict[int, int] | None = {} if self.capturer.device.type == "cpu" else None
        # Whether a forward ran since the buffer was last cleared (NOTE 1).
        self._dirty = False
        logger.info(
            "slotroute: capturing %s on %s (dense layers %s report 0%s)", spec, self.capturer.device, dense or "none",
            "; one copy a step after the last MoE layer" if copy_once else ""
        )

    def keep_results(self) -> int:
        """For a runner whose engine keeps each step's result until the step's requests
        finish (vLLM 0.28-0.30, where the engine core runs in the worker's process: an
        in-process executor): page-lock now the host memory the kept rows will pin,
        ``KEPT_ROWS_PER_SLOT`` times the packed bytes of as many rows as the KV cache
        has slots, at most ``KEPT_ROWS_MAX_BYTES``, rather than a chunk at a time inside
        the first steps (``RoutedExpertsCapturer.reserve_host``). Returns the bytes
        reserved: none where the engine core runs elsewhere (it gets a serialised copy
        of each result).

        NOTE: a running request's kept rows all have a KV slot, but each pins the whole
        chunk of the pool its step was written to, prefill rows of other requests
        included, until the last request with a row there finishes: the pool holds
        more than the KV cache's rows. Reserving them once still left vLLM 0.29's
        rollout on an H100 (256 x (1024 + 256) tokens) adding a chunk inside a step;
        three times is a margin, not a bound (docs/benchmarks.md).
        """
        if not self._engine_process:
            return 0
        packed_bytes = self.capturer.spec.bytes_per_token + 8  # a row and its int64 slot
        return self.capturer.reserve_host(min(KEPT_ROWS_PER_SLOT * self._kv_slots * packed_bytes, KEPT_ROWS_MAX_BYTES))

    @classmethod
    def of_runner(cls, runner) -> WorkerRouting:
        """Bound to a vLLM model runner (V1 ``GPUModelRunner`` or ``CPUModelRunner``,
        V2 ``GPUModelRunner``) after its KV cache exists."""
        return cls(runner.vllm_config, runner.kv_cache_config, runner.get_model(), runner.device)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """The callback vLLM's routers call with one layer's ``topk_ids``.

        Raises
        ------
        IndexError, ValueError
            As ``RoutedExpertsCapturer.capture``.
        """
        # Bounded by one copy launch (a torch copy_, on CPU too); with DP, also by
        # reading the token counts.
        dp = get_forward_context().dp_metadata
        layout = self._single_rank if dp is None else self._layout_for(dp)
        rows = self.capturer.capture(layer_id, topk_ids, layout=layout)
        if self._rows_captured is not None:
            self._rows_captured[layer_id] = rows

    def _layout_for(self, dp) -> BatchLayout:
        # Keyed by content: vLLM sets ``local_sizes`` on the same DPMetadata object
        # inside a context manager, so identity would miss the change.
        local_sizes = getattr(dp, "local_sizes", None)
        key = (tuple(dp.num_tokens_across_dp_cpu.tolist()), None if local_sizes is None else tuple(local_sizes))
        if key != self._dp_key:
            self._dp_key = key
            self._dp_layout = BatchLayout(
                num_tokens_across_dp=key[0], dp_rank=self.dp_rank, tp_size=self.tp_size, local_sizes=key[1]
            )
        return self._dp_layout

    def begin_step(self, num_tokens: int) -> None:
        """Prepare the capture of a step of ``num_tokens`` tokens (NOTE 1): on CPU, empty
        the ledger; on a CUDA device, nothing, unless a forward ran without a snapshot
        since the last one, which leaves the buffer to clear (one kernel)."""
        if self._rows_captured is not None:
            self._rows_captured = {}
        elif self._dirty:
            self._dirty = False
            self.capturer.clear_buffer()

    def forward_without_snapshot(self) -> None:
        """Report a forward no snapshot follows (a dummy run): the next step clears the
        buffer first (NOTE 1)."""
        self._dirty = True

    def snapshot(self, state) -> PendingSnapshot | None:
        """Start shipping the routing of the step the V1 runner's ``state``
        (``ExecuteModelState``) ran; ``None`` for a step without tokens.

        Called on the forward's stream before sampling: the snapshot's kernel, and its
        copy where it stages, are enqueued there, and vLLM's own wait for the step's
        sampled tokens covers them (the async output's copy event, recorded on a
        stream that waited for this one, or the synchronous path's host sync). So the
        snapshot records no event and its result waits on none: call
        :meth:`~slotroute.capture.PendingSnapshot.result` only after that wait.

        Raises
        ------
        ValueError
            If the step was split into micro-batches (one slot mapping per
            micro-batch), which slotroute does not support.
        """
        n = state.scheduler_output.total_num_scheduled_tokens
        if n == 0:
            return None
        if not isinstance(state.slot_mappings, dict):
            self.forward_without_snapshot()
            raise ValueError(
                "slotroute needs one slot mapping per step (a dict by layer name), got "
                f"{type(state.slot_mappings).__name__}: micro-batching is not supported"
            )
        pending = self.snapshot_step(n, state.slot_mappings[self.attn_layer], defer_copy=True)
        pending.enqueue_copy()  # on this stream, ahead of sampling
        return pending

    def snapshot_step(
        self, num_tokens: int, slots: torch.Tensor, defer_copy: bool = False, row: int | None = None
    ) -> PendingSnapshot:
        """Start shipping rows ``[0, num_tokens)`` of this step with their KV slots
        (``slots``, at least ``num_tokens`` long, on the host or the capture device;
        with ``row``, row ``row`` of the 2-D ``slots``, read in place on the device).

        On CPU, a step in which some MoE layer wrote fewer than the step's rows
        yields a snapshot whose ``result()`` raises ``ValueError`` naming the layers;
        on a CUDA device the snapshot's range check finds the rows left unwritten, and
        its kernel clears the buffer for the next step (NOTE 1). ``defer_copy`` leaves
        the copy to the runner's output copy stream (``PendingSnapshot.enqueue_copy``).

        Raises
        ------
        ValueError
            As ``RoutedExpertsCapturer.snapshot``: a malformed slot mapping.
        """
        if self._rows_captured is None:
            return self.capturer.snapshot_leading(num_tokens, slots, defer_copy, row)
        if row is not None:
            slots = slots[row]
        error = incomplete_capture(self._moe_layers, self._rows_captured, num_tokens)
        if error is not None:
            return PendingSnapshot(self.capturer.spec, num_tokens, error=error, failed_slots=slots.numpy()[:num_tokens].copy())
        # A numpy slice of the CPU slot mapping, not a torch slice: cheaper in a step.
        return self.capturer.snapshot(num_tokens, slots.numpy()[:num_tokens])


def incomplete_capture(moe_layers: frozenset[int], rows_captured: dict[int, int], num_tokens: int) -> ValueError | None:
    """The error for a step whose ledger (layer id -> rows its capture wrote) shows a
    MoE layer that wrote fewer than ``num_tokens`` rows, or none; ``None`` if every
    MoE layer wrote them all. Bounded by two C-level passes over the layers."""
    if moe_layers.issubset(rows_captured) and min(rows_captured.values(), default=num_tokens) >= num_tokens:
        return None
    short = sorted(layer for layer in moe_layers if rows_captured.get(layer, 0) < num_tokens)
    if not short:  # only a layer outside moe_layers wrote fewer rows
        return None
    unwritten = ", ".join(f"layer {layer}: tokens {rows_captured.get(layer, 0)}-{num_tokens - 1}" for layer in short)
    return ValueError(
        f"routing of a step of {num_tokens} tokens is incomplete: MoE layer(s) {short} wrote "
        f"fewer than {num_tokens} rows in this step (not written: {unwritten})"
    )


def as_vllm_lists(pending: PendingSnapshot):
    """The snapshot's result in vLLM 0.28-0.30's own type (narrow ``routing_data``),
    ``None`` on TP ranks other than 0, or, if the step failed its check, that type
    holding no rows and the KV slots the step wrote (:func:`is_failed_step`), so that
    the scheduler fails the step's requests alone and the engine serves on. The worker
    logs the failure."""
    try:
        arrays = pending.arrays()
    except ValueError as error:
        logger.error("slotroute: %s", error)
        spec = pending.spec
        rows = np.empty((0, *spec.token_shape), dtype=spec.storage_dtype)
        slots = pending.failed_slots()
        if slots is None or not len(slots):  # no slot known: still a failure, dropping no block
            slots = np.full(1, -1, dtype=np.int64)
        return _vllm_lists_type()(routing_data=rows, slot_mapping=slots)
    if arrays is None:
        return None
    return _vllm_lists_type()(routing_data=arrays[0], slot_mapping=arrays[1])


@functools.cache
def _vllm_lists_type():
    """vLLM 0.28-0.30's ``RoutedExpertsLists``, imported once (a per-step import
    statement is a dictionary lookup and an attribute read that the step can skip)."""
    from vllm.v1.outputs import RoutedExpertsLists

    return RoutedExpertsLists


def step_output(pending: PendingSnapshot):
    """What a worker ships for one step on vLLM 0.31+ (``ModelRunnerOutput.
    aux_output_connector_output``): the step's narrow rows and slots as slotroute's
    :class:`~slotroute.wire.RoutedExpertsLists`, ``None`` on TP ranks other than 0, or,
    if the step failed its check, a :class:`~slotroute.wire.StepFailure`
    naming what the check found, so that the requests of the step fail alone. The
    worker logs the failure."""
    try:
        arrays = pending.arrays()
    except ValueError as error:
        logger.error("slotroute: %s", error)
        return StepFailure(str(error), pending.failed_slots())
    if arrays is None:
        return None
    return RoutedExpertsLists(routing_data=arrays[0], slot_mapping=arrays[1])




def v2_execute_model(routing_of, begins_steps: bool):
    """The wrapper factory of ``vllm/v1/worker/gpu/model_runner.py``
    ``GPUModelRunner.execute_model`` shared by both V2 adapters: a dummy run (no
    snapshot follows it) leaves the capture buffer to clear before the next real step
    (NOTE 1 of :class:`WorkerRouting`); where ``begins_steps`` (vLLM 0.28-0.30, whose
    V2 has no step hook of its own), a real step's capture is prepared here.
    ``routing_of(runner)`` is the runner's :class:`WorkerRouting`, ``None`` where
    slotroute is not in place."""

    def make(original):
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, *args, **kwargs):
            routing = routing_of(self)
            if routing is not None:
                if dummy_run:
                    routing.forward_without_snapshot()
                elif begins_steps:
                    routing.begin_step(scheduler_output.total_num_scheduled_tokens)
            return original(self, scheduler_output, intermediate_tensors, dummy_run, *args, **kwargs)

        return execute_model

    return make
