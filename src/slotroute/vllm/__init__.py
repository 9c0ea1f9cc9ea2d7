"""slotroute as a vLLM plugin: exact, narrow, slot-indexed ``routed_experts``.

vLLM loads :func:`register` in every process it starts (API server, engine core,
workers) through the entry-point group ``vllm.general_plugins``. It patches vLLM
0.29.x and 0.30.x only; ``docs/vllm.md`` describes each patch and why.

Environment:

``SLOTROUTE_DISABLE=1``
    Patch nothing; vLLM runs as installed.
``SLOTROUTE_VLLM_MODE``
    ``slotroute`` (default): scheduler store, worker capture and CPU kernel capture.
    ``cpu-capture-only``: only the CPU kernel capture, so that vLLM's own capturer and
    manager run on the CPU backend (the baseline of the benchmarks).

Importing this package does not import vLLM; :func:`register` does.
"""

from __future__ import annotations

import logging
import os
import re

__all__ = ["DISABLE_ENV", "LOGGER_NAME", "MODES", "MODE_ENV", "register", "unsupported_reason"]

# A child of vLLM's logger, so slotroute's lines appear in vLLM's log, formatted alike.
LOGGER_NAME = "vllm.slotroute"
logger = logging.getLogger(LOGGER_NAME)

DISABLE_ENV = "SLOTROUTE_DISABLE"
MODE_ENV = "SLOTROUTE_VLLM_MODE"
MODES = ("slotroute", "cpu-capture-only")
SUPPORTED = ((0, 29), (0, 30))

# What the first register() call in this process did; later calls repeat nothing.
_outcome: str | None = None


def unsupported_reason(version: str) -> str | None:
    """Why slotroute cannot patch this vLLM version, or ``None`` if it can."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"slotroute: vLLM version {version!r} is not a release; slotroute patches 0.29.x and 0.30.x only"
    major_minor = (int(match[1]), int(match[2]))
    if major_minor in SUPPORTED:
        return None
    if major_minor > SUPPORTED[-1]:
        return (
            f"slotroute: vLLM {version} is not patched (0.31+ replaced the slot-indexed "
            "routed-experts path with its aux-output connector); slotroute supports 0.29.x and 0.30.x"
        )
    return f"slotroute: vLLM {version} is not patched; slotroute supports 0.29.x and 0.30.x"


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def register() -> str:
    """Install slotroute's patches into the running vLLM (vLLM's plugin entry point).

    Idempotent: only the first call in a process acts; later calls return its outcome.

    Returns
    -------
    str
        ``"disabled"``, ``"unsupported"`` (one warning logged saying why), or the mode
        applied: ``"slotroute"`` or ``"cpu-capture-only"``.

    Raises
    ------
    ValueError
        If ``SLOTROUTE_VLLM_MODE`` names no mode.
    slotroute.vllm.patches.PatchError
        If a supported vLLM's internals do not look as the patches expect; nothing is
        patched then.
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
    import vllm

    reason = unsupported_reason(vllm.__version__)
    if reason is not None:
        logger.warning(reason)
        _outcome = "unsupported"
        return _outcome

    from slotroute.vllm.cpu import cpu_patches
    from slotroute.vllm.patches import apply

    patches = cpu_patches()
    if mode == "slotroute":
        from slotroute.vllm.scheduler import scheduler_patches
        from slotroute.vllm.worker import worker_patches

        patches += scheduler_patches() + worker_patches()
    apply(patches)
    logger.info("slotroute: patched vLLM %s (%s mode, %d patches)", vllm.__version__, mode, len(patches))
    _outcome = mode
    return _outcome
