"""The V1 model runner's adapters: ``vllm/v1/worker/gpu_model_runner.py``
``GPUModelRunner`` (the CPU model runner inherits it).

vLLM 0.28-0.30 (:func:`v1_runner_patches`):

vLLM's own path sets ``routed_experts_initialized`` and then copies the int32 buffer
to the host in ``_bookkeeping_sync`` (sync) or in ``AsyncGPUModelRunnerOutput``
(async scheduling). slotroute's ``init_routed_experts_capturer`` binds a
:class:`~slotroute.vllm.worker.WorkerRouting` instead and leaves that flag off, so
none of vLLM's int32 copies run; ``execute_model`` resets the step's rows before the
forward and snapshots them after it (no event of slotroute's: vLLM's wait for the
sampled tokens covers the snapshot, NOTE 1 of ``_make_sample_tokens``), and
``sample_tokens`` sets
``ModelRunnerOutput.routed_experts`` from the checked narrow snapshot, on both
scheduling paths.

vLLM 0.31-0.32 (:func:`v1_runner_connector_patches`): this runner returns no routing
at all (vLLM's aux-output connector serves only the V2 runner). slotroute binds its
capture once the KV cache exists (``initialize_kv_cache``), resets and snapshots rows
the same way, and ``sample_tokens`` sets
``ModelRunnerOutput.aux_output_connector_output`` to the step's rows and slots
(:func:`~slotroute.vllm.worker.step_output`), which the scheduler side
(``connector.py``) stores.
"""

from __future__ import annotations

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from slotroute.capture import PendingSnapshot
from slotroute.vllm.patches import Patch, PatchError
from slotroute.vllm.worker import WorkerRouting, as_vllm_lists, step_output

__all__ = ["AsyncOutputWithRouting", "v1_runner_connector_patches", "v1_runner_patches"]

RUNNER = "vllm.v1.worker.gpu_model_runner"
_ATTR = "_slotroute_routing"
_PENDING = "_slotroute_pending"  # the step's snapshot, from execute_model to sample_tokens


def _ship_routed_experts(output: ModelRunnerOutput, pending: PendingSnapshot) -> None:
    """vLLM 0.28-0.30: the step's routing in ``ModelRunnerOutput.routed_experts``."""
    output.routed_experts = as_vllm_lists(pending)


def _ship_aux_output(output: ModelRunnerOutput, pending: PendingSnapshot) -> None:
    """vLLM 0.31+: the step's routing in ``ModelRunnerOutput.aux_output_connector_output``."""
    output.aux_output_connector_output = step_output(pending)


class AsyncOutputWithRouting(AsyncModelRunnerOutput):
    """vLLM's async step output plus this step's pending routing; ``get_output``
    waits for both and ships the routing with ``ship``. Any other attribute is the
    wrapped output's."""

    def __init__(self, inner: AsyncModelRunnerOutput, pending: PendingSnapshot, ship=_ship_routed_experts) -> None:
        self._inner = inner
        self._pending = pending
        self._ship = ship

    def get_output(self) -> ModelRunnerOutput:
        output = self._inner.get_output()
        self._ship(output, self._pending)
        return output

    def get_kv_connector_output(self):
        """The wrapped output's KV connector output (an abstract method from vLLM 0.33
        on, which vLLM reads when ``get_output`` raises)."""
        return self._inner.get_kv_connector_output()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


# -- patches ------------------------------------------------------------------------


def _make_init_capturer(original):
    """Replaces ``vllm/v1/worker/gpu_model_runner.py``
    ``GPUModelRunner.init_routed_experts_capturer``: binds slotroute's capturer and
    leaves ``routed_experts_initialized`` False, so vLLM's int32 copies never run."""

    def init_routed_experts_capturer(self):
        routing = self.__dict__[_ATTR] = WorkerRouting.of_runner(self)
        routing.keep_results()  # the in-process engine keeps each step's rows until its requests finish

    return init_routed_experts_capturer


def _make_initialize_kv_cache(original):
    """Wraps ``vllm/v1/worker/gpu_model_runner.py`` ``GPUModelRunner.initialize_kv_cache``
    (vLLM 0.31+): binds slotroute's capturer once the engine's KV cache exists, if the
    engine returns routed experts."""

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        original(self, kv_cache_config, *args, **kwargs)
        is_profiling = kwargs.get("is_profiling", args[0] if args else False)
        if self.vllm_config.aux_output_config.enabled and not is_profiling:
            self.__dict__[_ATTR] = WorkerRouting.of_runner(self)

    return initialize_kv_cache


def _make_execute_model(original):
    """Wraps ``vllm/v1/worker/gpu_model_runner.py`` ``GPUModelRunner.execute_model``:
    prepares the step's capture before the forward (``WorkerRouting.begin_step``) and
    snapshots it right after, before ``sample_tokens`` samples (NOTE 1)."""

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        routing = self.__dict__.get(_ATTR)
        if routing is None:
            return original(self, scheduler_output, intermediate_tensors)
        routing.begin_step(scheduler_output.total_num_scheduled_tokens)
        unread = self.__dict__.get(_PENDING)
        if unread is not None:  # the last step's sampling raised: its ring slot is free again
            unread.discard()
        self.__dict__[_PENDING] = None
        output = original(self, scheduler_output, intermediate_tensors)
        state = self.execute_model_state
        if output is None and state is not None:  # the forward ran; sample_tokens follows
            self.__dict__[_PENDING] = routing.snapshot(state)
        return output

    return execute_model


def _make_dummy_run(original):
    """Wraps ``vllm/v1/worker/gpu_model_runner.py`` ``GPUModelRunner._dummy_run``
    (profiling, CUDA-graph capture, a DP rank's idle batch): no snapshot follows it, so
    the next real step clears the capture buffer first (NOTE 1 of ``WorkerRouting``)."""

    def _dummy_run(self, *args, **kwargs):
        routing = self.__dict__.get(_ATTR)
        if routing is not None:
            routing.forward_without_snapshot()
        return original(self, *args, **kwargs)

    return _dummy_run


def _make_sample_tokens(original, ship=_ship_routed_experts):
    """Wraps ``vllm/v1/worker/gpu_model_runner.py`` ``GPUModelRunner.sample_tokens``:
    attaches the snapshot ``execute_model`` took to the sync output (with ``ship``),
    or wraps the async one.

    NOTE 1: the snapshot kernel (and its copy, where it stages) is enqueued after the
    forward and before sampling, on the forward's stream, so vLLM's own wait for the
    sampled tokens (its async output's copy event, recorded on a stream that waits for
    the forward's, or the sync path's host sync) also covers it: the snapshot records
    no event of its own, and shipping waits on none (``WorkerRouting.snapshot``).
    Launched after sampling, the kernel would not be covered by that wait."""

    def sample_tokens(self, grammar_output):
        output = original(self, grammar_output)
        pending = self.__dict__.pop(_PENDING, None)  # taken by execute_model (NOTE 1)
        if pending is None:
            return output
        if isinstance(output, AsyncModelRunnerOutput):
            return AsyncOutputWithRouting(output, pending, ship)
        if isinstance(output, ModelRunnerOutput):
            ship(output, pending)
        return output

    return sample_tokens


def v1_runner_patches() -> list[Patch]:
    """The V1 runner's patches, each verified against the installed vLLM."""
    return [
        Patch(RUNNER, "GPUModelRunner.init_routed_experts_capturer", ("self",),
              ("bind_routed_experts_capturer(self.model", "self.routed_experts_initialized = True"),
              _make_init_capturer),
        Patch(RUNNER, "GPUModelRunner.execute_model", ("self", "scheduler_output", "intermediate_tensors"),
              ("self.execute_model_state = ExecuteModelState(",), _make_execute_model),
        Patch(RUNNER, "GPUModelRunner.sample_tokens", ("self", "grammar_output"),
              ("self.execute_model_state = None", "if self.routed_experts_initialized:"),
              _make_sample_tokens),
        Patch(RUNNER, "GPUModelRunner._dummy_run", ("self", "num_tokens", "..."), ("outputs = self.model(",), _make_dummy_run),
    ]


def v1_runner_connector_patches() -> list[Patch]:
    """The V1 runner's patches for vLLM 0.31+, each verified against the installed
    vLLM.

    Raises
    ------
    PatchError
        The installed vLLM's async output declares an abstract method that
        :class:`AsyncOutputWithRouting` does not define, so it could not be built.
    """
    if AsyncOutputWithRouting.__abstractmethods__:
        missing = ", ".join(sorted(AsyncOutputWithRouting.__abstractmethods__))
        raise PatchError(f"vllm.v1.outputs.AsyncModelRunnerOutput declares {missing}, which slotroute's wrapper lacks")
    return [
        Patch(RUNNER, "GPUModelRunner.initialize_kv_cache", ("self", "kv_cache_config", "is_profiling", "..."),
              ("self.kv_cache_config = kv_cache_config",), _make_initialize_kv_cache),
        Patch(RUNNER, "GPUModelRunner.execute_model", ("self", "scheduler_output", "intermediate_tensors"),
              ("self.execute_model_state = ExecuteModelState(",), _make_execute_model),
        Patch(RUNNER, "GPUModelRunner.sample_tokens", ("self", "grammar_output"),
              ("self.execute_model_state = None", "slot_mappings,\n        ) = self.execute_model_state"),
              lambda original: _make_sample_tokens(original, _ship_aux_output)),
        Patch(RUNNER, "GPUModelRunner._dummy_run", ("self", "num_tokens", "..."), ("outputs = self.model(",), _make_dummy_run),
        Patch("vllm.v1.outputs", "ModelRunnerOutput", None, ("aux_output_connector_output",), None),
    ]
