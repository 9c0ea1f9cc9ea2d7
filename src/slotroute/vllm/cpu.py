"""CPU backend: let vLLM's CPU MoE kernel report the experts it selects.

In vLLM 0.28-0.29 ``CPUUnquantizedExperts`` (``vllm/model_executor/layers/fused_moe/
experts/cpu_moe.py``, parent of ``X86CPUUnquantizedExperts`` and its siblings) is a
monolithic kernel that routes inside ``apply`` through its own ``_select_experts``,
and ``bind_routed_experts_capturer`` refuses it. These patches make it take part in
vLLM's own routing-replay interface for monolithic kernels
(``supports_routing_replay_capture`` / ``set_capture_fn``) and call the capture
function with the ids ``_select_experts`` returns: the ids the kernel then uses.

vLLM 0.30 turned the class into a modular kernel routed by ``CPURouter``, whose
``set_capture_fn`` vLLM already binds; there nothing is patched.
"""

from __future__ import annotations

import importlib

from slotroute.vllm.patches import Patch

__all__ = ["cpu_patches"]

CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _make_supports_capture(original):
    """Replaces ``FusedMoEExpertsMonolithic.supports_routing_replay_capture`` on
    ``cpu_moe.py`` ``CPUUnquantizedExperts`` (the base returns False)."""

    def supports_routing_replay_capture(self) -> bool:
        return True

    return supports_routing_replay_capture


def _make_set_capture_fn(original):
    """Replaces ``FusedMoEExpertsMonolithic.set_capture_fn`` on ``cpu_moe.py``
    ``CPUUnquantizedExperts``: keeps the function only (the base also allocates a
    replay buffer that kernels with ``routing_replay_out`` fill; this one has none)."""

    def set_capture_fn(self, capture_fn) -> None:
        self.routing_replay_capture_fn = capture_fn

    return set_capture_fn


def _make_select_experts(original):
    """Wraps ``cpu_moe.py`` ``CPUUnquantizedExperts._select_experts``: hands the
    selected ``topk_ids`` to the capture function, if one is bound."""

    def _select_experts(self, *args, **kwargs):
        topk_weights, topk_ids = original(self, *args, **kwargs)
        capture_fn = self.routing_replay_capture_fn
        if capture_fn is not None:
            capture_fn(topk_ids)
        return topk_weights, topk_ids

    return _select_experts


def cpu_kernel_is_monolithic() -> bool:
    """Whether the installed vLLM's ``CPUUnquantizedExperts`` is monolithic (0.28-0.29)."""
    module = importlib.import_module(CPU_MOE)
    return bool(module.CPUUnquantizedExperts.is_monolithic())


def cpu_patches() -> list[Patch]:
    """The patches that let the CPU kernel capture; empty where vLLM needs none.

    A vLLM build without the CPU kernels (a CUDA build that cannot import them) needs
    none either.
    """
    try:
        monolithic = cpu_kernel_is_monolithic()
    except (ImportError, AttributeError):
        return []
    if not monolithic:
        return []
    where = "CPUUnquantizedExperts"
    return [
        Patch(CPU_MOE, f"{where}._select_experts",
              ("self", "hidden_states", "router_logits", "num_expert_group", "topk_group",
               "e_score_correction_bias", "routed_scaling_factor"),
              ("return select_experts(",), _make_select_experts),
        Patch(CPU_MOE, f"{where}.supports_routing_replay_capture", None, (), _make_supports_capture),
        Patch(CPU_MOE, f"{where}.set_capture_fn", None, (), _make_set_capture_fn),
    ]
