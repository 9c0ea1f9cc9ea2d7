"""slotroute as a vLLM plugin: exact, narrow, slot-indexed ``routed_experts``.

vLLM loads :func:`register` in every process it starts (API server, engine core,
workers) through the entry-point group ``vllm.general_plugins``. :func:`register`
picks the adapters of the installed vLLM generation once (:data:`ADAPTERS`), verifies
every patch they hold against the installed source, and installs them all or none.
``docs/vllm.md`` describes each patch and why.

A patch that does not verify leaves vLLM serving as installed: one warning names what
did not verify, and only an engine configured with ``enable_return_routed_experts``
refuses to start, saying that slotroute is not in effect and that
``SLOTROUTE_DISABLE=1`` runs vLLM's own routed-experts path instead.

Environment:

``SLOTROUTE_DISABLE=1``
    Patch nothing; vLLM runs as installed.
``SLOTROUTE_VLLM_MODE``
    ``slotroute`` (default): every adapter of the installed generation.
    ``cpu-capture-only``: only the CPU kernel capture, so that vLLM's own capturer and
    manager run on the CPU backend (the baseline of the benchmarks).
``SLOTROUTE_LAZY_STORE=1``
    The scheduler's store is paged in as steps first write each page, instead of
    being committed when the engine starts (its whole capacity, ``routed_experts``
    bytes per KV slot, in host memory from the start; ``store.py``, NOTE 4).
``SLOTROUTE_JOIN_AT_FINISH=1``
    The front end keeps each request's rows as vLLM does, a list of arrays joined when
    it finishes, instead of one array filled as they come (``outputs.py``).
``SLOTROUTE_CAPTURE_COPY_ONCE``
    ``1``: the worker writes a step's routing into its capture buffer with one kernel
    after the last MoE layer's router, instead of one copy per MoE layer (NOTE 5 of
    ``RoutedExpertsCapturer``); ``0``: one copy per MoE layer. Unset: one copy a step
    on a CUDA device, where each copy is a kernel in the step's graph; one per layer
    on the CPU, where each is a memcpy.

Importing this package does not import vLLM; :func:`register` does.
"""

from __future__ import annotations

import importlib
import logging
import os
import re

__all__ = ["ADAPTERS", "COPY_ONCE_ENV", "DISABLE_ENV", "JOIN_AT_FINISH_ENV", "LAZY_STORE_ENV", "LOGGER_NAME",
           "MODES", "MODE_ENV", "READ_AHEAD_ENV", "READ_AT_FINISH_ENV", "SWITCHES", "capture_copy_once", "register",
           "switch", "switch_setting", "unsupported_reason"]

# A child of vLLM's logger, so slotroute's lines appear in vLLM's log, formatted alike.
LOGGER_NAME = "vllm.slotroute"
logger = logging.getLogger(LOGGER_NAME)

DISABLE_ENV = "SLOTROUTE_DISABLE"
MODE_ENV = "SLOTROUTE_VLLM_MODE"
# Set to 1: the scheduler's store is paged in as steps first write it, instead of at start.
LAZY_STORE_ENV = "SLOTROUTE_LAZY_STORE"
# Set to 1 (vLLM 0.31+): a request's rows are all read when it finishes, none of its
# prompt's read ahead while it decodes (NOTE 3 of ``ConnectorRouting``).
READ_AT_FINISH_ENV = "SLOTROUTE_READ_AT_FINISH"
# Set to 0 (vLLM 0.28-0.30, async scheduling): each prompt read whole at its last prefill
# step's output, none of its rows stored before that step read while it runs
# (``SchedulerRouting.read_ahead``, on by default).
READ_AHEAD_ENV = "SLOTROUTE_READ_AHEAD"
# Set to 1: the front end joins each request's rows when it finishes, as vLLM does,
# instead of filling one array as they come (``outputs.py``, on by default).
JOIN_AT_FINISH_ENV = "SLOTROUTE_JOIN_AT_FINISH"
# 1: the worker's capture writes a step's rows with one kernel after the last MoE layer
# (NOTE 5 of ``RoutedExpertsCapturer``); 0: one copy per MoE layer; unset: see
# capture_copy_once.
COPY_ONCE_ENV = "SLOTROUTE_CAPTURE_COPY_ONCE"
MODES = ("slotroute", "cpu-capture-only")
# The on/off variables: each is 0, 1 or unset (switch_setting), checked by register() in
# every process vLLM starts, so that a mistyped value stops the engine's start naming it
# instead of leaving the switch silently at its default.
SWITCHES = (LAZY_STORE_ENV, READ_AT_FINISH_ENV, READ_AHEAD_ENV, JOIN_AT_FINISH_ENV, COPY_ONCE_ENV)

# The adapters of each vLLM generation slotroute serves, by (major, minor): names of
# the patch sets in ``_PATCH_SETS``. 0.28-0.30 have a slot-indexed routed-experts path
# (a scheduler-side RoutedExpertsManager) that slotroute's store replaces; 0.31-0.32
# have an aux-output connector that slotroute's connector replaces. Every generation's
# front end keeps each request's rows in one array (``outputs.py``; on 0.31+ the
# connector's arrays kept as they come, NOTE 2 there).
ADAPTERS: dict[tuple[int, int], tuple[str, ...]] = {
    (0, 28): ("cpu", "scheduler", "runner_v1", "runner_v2", "requests", "outputs"),
    (0, 29): ("cpu", "scheduler", "runner_v1", "runner_v2", "requests", "outputs"),
    (0, 30): ("cpu", "scheduler", "runner_v1", "runner_v2", "outputs"),
    (0, 31): ("cpu", "connector", "runner_v1_connector", "runner_v2_connector", "connector_outputs"),
    (0, 32): ("cpu", "connector", "runner_v1_connector", "runner_v2_connector", "connector_outputs"),
    (0, 33): ("cpu", "connector_0_33", "runner_v1_connector", "runner_v2_connector", "connector_outputs"),
}
SUPPORTED = tuple(sorted(ADAPTERS))
_SUPPORTED_TEXT = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)

# What the first register() call in this process did; later calls repeat nothing.
_outcome: str | None = None


def unsupported_reason(version: str) -> str | None:
    """Why slotroute cannot patch this vLLM version, or ``None`` if it can."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"slotroute: vLLM version {version!r} is not a release; slotroute supports {_SUPPORTED_TEXT}"
    major_minor = (int(match[1]), int(match[2]))
    if major_minor in ADAPTERS:
        return None
    return f"slotroute: vLLM {version} is not patched; slotroute supports {_SUPPORTED_TEXT}"


# Each adapter's patch set: the module and the function that builds it, imported only
# for the adapters of the installed generation.
_PATCH_SETS = {
    "cpu": ("slotroute.vllm.cpu", "cpu_patches"),
    "scheduler": ("slotroute.vllm.scheduler", "scheduler_patches"),
    "runner_v1": ("slotroute.vllm.runner_v1", "v1_runner_patches"),
    "runner_v2": ("slotroute.vllm.runner_v2", "v2_runner_patches"),
    "connector": ("slotroute.vllm.connector", "connector_patches"),
    "connector_0_33": ("slotroute.vllm.connector", "connector_patches_0_33"),
    "runner_v1_connector": ("slotroute.vllm.runner_v1", "v1_runner_connector_patches"),
    "runner_v2_connector": ("slotroute.vllm.runner_v2_connector", "v2_runner_connector_patches"),
    "requests": ("slotroute.vllm.requests", "request_patches"),
    "outputs": ("slotroute.vllm.outputs", "output_patches"),
    "connector_outputs": ("slotroute.vllm.outputs", "connector_output_patches"),
}


def _patch_set(name: str) -> list:
    """The patches of one adapter, built (and their module imported) on demand."""
    module, function = _PATCH_SETS[name]
    return getattr(importlib.import_module(module), function)()


def switch_setting(name: str, setting: str | None) -> str:
    """The value of the on/off variable ``name`` (``setting``, ``None`` where unset):
    ``"0"``, ``"1"`` or ``""`` (unset or empty), surrounding blanks dropped.

    Raises
    ------
    ValueError
        Any other value, naming the variable.
    """
    value = (setting or "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0, 1 or unset, got {setting!r}")
    return value


def switch(name: str) -> str:
    """The on/off variable ``name``'s value in this process's environment
    (:func:`switch_setting`)."""
    return switch_setting(name, os.environ.get(name))


def capture_copy_once(device_type: str, setting: str | None) -> bool:
    """Whether the worker's capturer writes a step's rows with one copy after the last
    MoE layer (``copy_once``), from ``SLOTROUTE_CAPTURE_COPY_ONCE``'s value (``None``
    where unset) and the type of the device the model runs on.

    Unset or empty, on a CUDA device only: there each layer's copy is a kernel in the
    step's CUDA graph, and one stack spares all but one of them; on the CPU each copy is
    a memcpy, and holding the ids until the last layer buys nothing.
    """
    value = switch_setting(COPY_ONCE_ENV, setting)
    return value == "1" or (value == "" and device_type == "cuda")


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def register() -> str:
    """Install slotroute's patches into the running vLLM (vLLM's plugin entry point).

    Idempotent: only the first call in a process acts; later calls return its outcome.
    Never raises for the installed vLLM's sake: vLLM serves either way.

    Returns
    -------
    str
        ``"disabled"``, ``"unsupported"`` (one warning logged saying why),
        ``"not-verified"`` (a patch did not verify: one warning, nothing patched, and
        an engine that asks for routed experts refuses to start), or the mode applied:
        ``"slotroute"`` or ``"cpu-capture-only"``.

    Raises
    ------
    ValueError
        If ``SLOTROUTE_VLLM_MODE`` names no mode, or one of the on/off variables
        (:data:`SWITCHES`) is set to anything but 0 or 1; the error names it.
    """
    global _outcome
    if _outcome is not None:
        return _outcome
    if _disabled():
        logger.info("slotroute: %s is set; vLLM runs unpatched", DISABLE_ENV)
        _outcome = "disabled"
        return _outcome
    mode = os.environ.get(MODE_ENV, "").strip() or MODES[0]
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    switches = {name: switch(name) for name in SWITCHES}
    join_at_finish = switches[JOIN_AT_FINISH_ENV] == "1"
    import vllm

    reason = unsupported_reason(vllm.__version__)
    if reason is not None:
        logger.warning(reason)
        _outcome = "unsupported"
        return _outcome

    from slotroute.vllm.patches import PatchError, apply

    major_minor = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", vllm.__version__).groups())
    names = ADAPTERS[major_minor] if mode == "slotroute" else ("cpu",)
    if join_at_finish:
        names = tuple(name for name in names if name not in ("outputs", "connector_outputs"))
    try:
        patches = [patch for name in names for patch in _patch_set(name)]
        apply(patches)
    except (PatchError, ImportError) as error:
        _refuse_routed_experts(f"slotroute is not in effect on vLLM {vllm.__version__}: {error}")
        _outcome = "not-verified"
        return _outcome
    logger.info(
        "slotroute: patched vLLM %s (%s mode: %s; %d patches)", vllm.__version__, mode, ", ".join(names), len(patches)
    )
    _outcome = mode
    return _outcome


def _refuse_routed_experts(reason: str) -> None:
    """Log ``reason`` once and make an engine configured with
    ``enable_return_routed_experts`` refuse to start with it (wraps
    ``vllm/config/vllm.py`` ``VllmConfig.__post_init__``, which every engine start
    runs after the plugins are loaded); any other engine starts as installed."""
    logger.warning("%s; vLLM runs as installed, and refuses enable_return_routed_experts", reason)
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__

    def __post_init__(self, *args, **kwargs):
        # vLLM 0.28-0.30 keep the flag in the model config, 0.31+ in the aux-output config.
        model_config = getattr(self, "model_config", None)
        aux_output_config = getattr(self, "aux_output_config", None)
        if getattr(model_config, "enable_return_routed_experts", False) or getattr(
            aux_output_config, "enable_return_routed_experts", False
        ):
            raise RuntimeError(
                f"{reason}. This engine asked for routed experts, which slotroute cannot provide "
                f"here; set {DISABLE_ENV}=1 to serve vLLM's own routed-experts path instead, or "
                "install the vLLM version slotroute supports"
            )
        return original(self, *args, **kwargs)

    VllmConfig.__post_init__ = __post_init__
